"""The plans people use today, on the traced step, to set beside the plan the solver chooses.

- ``none``: no recomputation (the plain step).
- ``full``: every block of the model's stack checkpointed whole, keeping only its inputs (Hugging Face's
  ``gradient_checkpointing_enable()``, torchtitan's ``mode = "full"``).
- ``megatron``: Megatron-LM's selective recomputation (Korthikanti et al., 2022): only the attention core
  (scores, softmax, dropout, the product with the values) is recomputed. With a fused attention op (SDPA,
  flash attention) the core keeps no score matrix, so recomputing it frees nothing worth its cost: the
  baseline is then the plain step's peak with the attention's FLOPs recomputed, and says so. With unfused
  attention the core is several ops inside a module, not a module or an op type, and it is not modelled.
- ``op-sac``: torchtitan's op-level selective checkpointing on every block: keep the outputs of attention
  and of every other matmul, recompute the rest (:data:`~trainledger.remat.OP_POLICIES` ``["op-sac"]``).

Each is a set of candidates of the same step (:class:`~trainledger.remat.Candidates`), so its peak is
replayed exactly as any plan's is, and the solver's plan at a baseline's peak can be compared with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainledger.remat._candidates import Candidates, cached_events
from trainledger.remat._plan import ATTENTION_OPS, op_type

BASELINES: tuple[str, ...] = ("none", "full", "megatron", "op-sac")
LABELS = {
    "none": "no recomputation",
    "full": "full recomputation per block",
    "megatron": "Megatron selective (attention core)",
    "op-sac": "op-level SAC per block (attention + every 2nd matmul kept)",
}


@dataclass(frozen=True)
class Baseline:
    """One named baseline on the traced step: which candidates it recomputes, what that costs."""

    name: str
    """One of :data:`BASELINES`."""
    label: str
    choice: tuple[int, ...] | None
    """Candidate indices it recomputes; ``None``: not expressible on this model (``note`` says why)."""
    extra_flops: int = 0
    """FLOPs recomputed (``FlopCounterMode``'s)."""
    extra_other_flops: int = 0
    """The cost charged to the other recomputed ops (one FLOP per output element)."""
    extra_seconds: float | None = 0.0
    """Measured time of the recomputed ops (``None``: not timed, on fake tensors)."""
    note: str = ""
    peak_bytes: int | None = None
    """Its predicted peak (per rank where the step is sharded); ``None``: not expressible."""

    @property
    def cost_flops(self) -> int:
        return self.extra_flops + self.extra_other_flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "peak_bytes": self.peak_bytes,
            "extra_flops": self.extra_flops,
            "extra_other_flops": self.extra_other_flops,
            "extra_seconds": self.extra_seconds,
            "num_regions": None if self.choice is None else len(self.choice),
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Baseline:
        n = d.get("num_regions")
        return cls(
            name=str(d["name"]),
            label=str(d["label"]),
            choice=None if n is None else tuple(range(int(n))),  # (the indices are not saved, only how many)
            extra_flops=int(d["extra_flops"]),
            extra_other_flops=int(d.get("extra_other_flops", 0)),
            extra_seconds=None if d.get("extra_seconds") is None else float(d["extra_seconds"]),
            note=str(d.get("note", "")),
            peak_bytes=None if d.get("peak_bytes") is None else int(d["peak_bytes"]),
        )


def baseline_choices(cs: Candidates) -> tuple[Baseline, ...]:
    """The named baselines as sets of ``cs``'s candidates (their peaks not yet computed)."""
    out = [_of(cs, "none", ()), _of(cs, "full", cs.blocks), _megatron(cs)]
    op_sac = _op_sac(cs)
    out.append(
        _of(cs, "op-sac", op_sac)
        if op_sac
        else Baseline("op-sac", LABELS["op-sac"], None, note="no block keeps fewer bytes under it than without it")
    )
    return tuple(out)


def _of(cs: Candidates, name: str, choice: tuple[int, ...], note: str = "") -> Baseline:
    chosen = [cs.candidates[j] for j in choice]
    return Baseline(
        name,
        LABELS[name],
        tuple(choice),
        extra_flops=sum(c.flops for c in chosen),
        extra_other_flops=sum(c.other_flops for c in chosen),
        extra_seconds=sum(c.seconds for c in chosen),
        note=note,
    )


def _op_sac(cs: Candidates) -> tuple[int, ...]:
    """Per block, the candidate that keeps what ``op-sac`` keeps: its own, or the same call's candidate of
    another policy that keeps the same outputs (a GPT without an attention op: ``selective``'s with one
    matmul, ...). A block where the recipe saves nothing is left as it is."""
    out = []
    for b in cs.blocks:
        block = cs.candidates[b]
        want = cached_events(cs.plain, block.fwd[0], block.fwd[1], "op-sac")
        same = [j for j, c in enumerate(cs.candidates) if c.call == block.call and c.cached == want and want]
        out.extend(same[:1])
    return tuple(out)


def _megatron(cs: Candidates) -> Baseline:
    if not cs.blocks:
        return Baseline("megatron", LABELS["megatron"], None, note="the model has no stack of blocks")
    record = cs.record
    events = [
        f
        for b in cs.blocks
        for f in range(cs.candidates[b].fwd[0], cs.candidates[b].fwd[1] + 1)
        if op_type(cs.plain.events[f].op) in ATTENTION_OPS
    ]
    if not events:
        return Baseline(
            "megatron",
            LABELS["megatron"],
            None,
            note="attention is unfused here (the core is several ops inside a module): not modelled",
        )
    return Baseline(
        "megatron",
        LABELS["megatron"],
        (),
        extra_flops=sum(record.flops[f] for f in events) if record is not None else 0,
        extra_seconds=sum(record.seconds[f] for f in events) if record is not None else 0.0,
        note=f"attention is one fused op ({op_type(cs.plain.events[events[0]].op)}) that keeps no score matrix: "
        "recomputing it saves nothing, so its peak is the plain step's (and its FLOPs are spent for nothing)",
    )
