"""``trainledger state``: the persistent state of a training setup, from real objects or a stated format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainledger.checks import instance_of
from trainledger.declared import StateSpec, declared_ledger
from trainledger.errors import InputError
from trainledger.inventory import RecoveryCheckpoint, inventory, recovery_checkpoint
from trainledger.ledger import Ledger, Payload
from trainledger.workload import Workload, count_autograd_nodes, require_workload, run_step, user_errors


@dataclass(frozen=True)
class StateResult:
    """What ``trainledger state`` reports: the ledger, the seed's payload sums, the recovery checkpoint."""

    source: str
    ledger: Ledger
    payload: Payload
    recovery: RecoveryCheckpoint
    num_graph_nodes: int | None
    """Autograd graph nodes one step creates: a node count, not FLOPs, not bytes."""

    @classmethod
    def of(cls, ledger: Ledger, *, source: str, num_graph_nodes: int | None = None) -> StateResult:
        """The result for a ledger of persistent state: its payload sums and recovery checkpoint."""
        return cls(source, ledger, ledger.payload(), recovery_checkpoint(ledger), num_graph_nodes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StateResult:
        """Read ``to_dict()`` back (``trainledger report``): the ledger is saved whole, the sums follow from it."""
        nodes = data.get("num_autograd_graph_nodes")
        return cls.of(Ledger.from_dict(data), source=str(data["source"]), num_graph_nodes=nodes)

    def to_dict(self) -> dict[str, Any]:
        out = self.ledger.to_dict()
        out["result"] = "state"
        out["source"] = self.source
        out["num_params"] = self.ledger.num_params()
        out["by_category"] = {k[0]: v for k, v in self.ledger.bytes_by("category").items()}
        out["by_role"] = [
            {"category": c, "role": r, "dtype": d, "bytes": b}
            for (c, r, d), b in self.ledger.bytes_by("category", "role", "dtype").items()
        ]
        out["payload"] = {
            "formula": "B_payload = P * sum_k b_k",
            "num_params": self.payload.num_params,
            "arrays": [
                {"label": r.label, "bytes_per_param": float(r.bytes_per_param), "bytes": r.bytes, "running_total": t}
                for r, (_, t) in zip(self.payload.rows, self.payload.running_totals(), strict=True)
            ],
            "bytes": self.payload.bytes,
            "excluded": list(self.payload.excluded),
            "full_length_not_in_formula": list(self.payload.outside),
        }
        out["recovery_checkpoint"] = {
            "bytes": self.recovery.bytes,
            "by_part": self.recovery.by_part,
            "frozen_bytes_not_included": self.recovery.frozen_bytes,
            "meaning": "durable state saved for a restart; not activation checkpointing (recompute)",
        }
        out["num_autograd_graph_nodes"] = self.num_graph_nodes
        return out


def workload_state(workload: Workload, *, take_step: bool = True) -> StateResult:
    """Inventory a workload's persistent state.

    With ``take_step`` (default) one training step runs first, without ``zero_grad``, so the optimizer
    state and the gradients exist and are inventoried as they are between ``backward`` and ``zero_grad``;
    the autograd graph that step builds is counted. Without it, state not created yet is ``declared``.

    Example:
        >>> from trainledger.examples import seed_423
        >>> r = workload_state(seed_423())
        >>> [t for _, t in r.payload.running_totals()]
        [3384, 6768, 10152, 13536]
    """
    require_workload(workload, "workload_state")
    if not isinstance(take_step, bool):
        raise InputError(f"workload_state(take_step=...) is {take_step!r}; give True or False")
    nodes: list[int] = []
    if take_step:
        with user_errors("the step"):
            run_step(workload, on_loss=lambda loss: nodes.append(count_autograd_nodes(loss)), zero_grad=False)
    optimizer = workload.get_optimizer()
    ledger = inventory(workload.model, optimizer, reference=workload.reference)
    ledger = ledger.with_entries(ledger.entries, meta={**ledger.meta, "model": workload.name})
    source = workload.name or type(workload.model).__name__
    return StateResult.of(ledger, source=source, num_graph_nodes=nodes[0] if nodes else None)


def spec_state(spec: StateSpec) -> StateResult:
    """The declared state of a stated format (no tensors).

    Example:
        >>> spec_state(StateSpec(num_params=10**9, master="fp32")).payload.bytes
        16000000000
    """
    instance_of(spec, StateSpec, "spec_state()'s spec", "give a trainledger.StateSpec(num_params=..., ...)")
    return StateResult.of(declared_ledger(spec), source=f"declared: {spec.num_params:,} parameters")
