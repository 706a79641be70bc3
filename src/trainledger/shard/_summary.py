"""What is reported of a sharded step, as typed summaries that JSON holds and reads back.

A :class:`~trainledger.shard.ShardResult` holds every rank's whole ledger; the reports print
rank 0's tables, every rank's peak and the collectives. :class:`ShardSummary` is exactly that, so the
``shard`` command's JSON can be re-opened (``trainledger report``) and printed as the command printed it.
No torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trainledger.allocator import ReservedPrediction
from trainledger.ledger import EntryGroup, LedgerSummary, Peak
from trainledger.shard._comm import Collective, CommTime, payload_by_kind, wire_by_kind


@dataclass(frozen=True)
class RankSummary:
    """One class of identical ranks of a sharded step: its predicted peak and what each rank holds."""

    rank: int
    """The first rank of the class."""
    peak: Peak
    model_state_bytes: int
    """Persistent weights, frozen weights, gradients and optimizer state (the ZeRO paper's model states)."""
    by_category: dict[str, int]
    """Bytes of every entry of the rank's ledger, by category (not at one instant)."""
    last_rank: int
    """The last rank of the class (within a shard group: hybrid sharding repeats it in every group)."""
    num_ranks: int
    """How many ranks hold exactly this (see ``ShardResult.rank_classes``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "last_rank": self.last_rank,
            "num_ranks": self.num_ranks,
            "predicted_peak_bytes": self.peak.bytes,
            "model_state_bytes": self.model_state_bytes,
            "peak": self.peak.to_dict(),
            "by_category": dict(self.by_category),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankSummary:
        by_cat = {str(k): int(v) for k, v in data["by_category"].items()}
        rank = int(data["rank"])
        return cls(
            rank,
            Peak.from_dict(data["peak"]),
            int(data["model_state_bytes"]),
            by_cat,
            int(data.get("last_rank", rank)),  # files saved before classes: one rank a row
            int(data.get("num_ranks", 1)),
        )


@dataclass(frozen=True)
class ShardSummary:
    """A sharded step as reported: rank 0's figures and tables, each class of identical ranks' peak, the
    collectives.

    ``ShardResult.summary()`` makes one; ``to_dict()`` is ``ShardResult.to_dict()``.
    """

    strategy: str
    engine: str
    label: str
    """The strategy as people name it: ``ZeRO-3``, ``FSDP FULL_SHARD (FSDP2 fully_shard)``…"""
    world_size: int
    num_nodes: int
    units: tuple[str, ...]
    rank0: LedgerSummary
    rank0_groups: tuple[EntryGroup, ...]
    """Rank 0's entries by category, role and dtype (its table)."""
    ranks: tuple[RankSummary, ...]
    collectives: tuple[Collective, ...]
    """Per rank (every rank runs the same collectives)."""
    notes: tuple[str, ...]
    """The transform's notes (what it leaves out), not the ledger's."""
    source_notes: tuple[str, ...]
    """The notes of the ledger that was sharded."""
    source_single_instant: bool
    """The sharded ledger was one instant (declared or inventoried state): its totals are model states."""

    def to_dict(self) -> dict[str, Any]:
        """Rank 0's ledger keys at the top, every rank's summary under ``ranks``."""
        out = self.rank0.to_dict()
        out["shard"] = {
            "strategy": self.strategy,
            "engine": self.engine,
            "label": self.label,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "units": list(self.units),
            "notes": list(self.notes),
            "source_notes": list(self.source_notes),
            "source_single_instant": self.source_single_instant,
            "rank0_groups": [g.to_dict() for g in self.rank0_groups],
        }
        out["ranks"] = [r.to_dict() for r in self.ranks]
        out["collectives"] = [{**asdict(c), "wire_bytes": c.wire_bytes} for c in self.collectives]
        out["collective_payload_bytes"] = payload_by_kind(self.collectives)
        out["collective_wire_bytes"] = wire_by_kind(self.collectives)
        out["notes"] = [*out["notes"], *self.notes]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardSummary:
        s = data["shard"]
        notes = tuple(str(n) for n in s["notes"])
        rank0 = LedgerSummary.from_dict(data)
        # the top level's notes are rank 0's followed by the transform's (see to_dict)
        own = rank0.notes[: len(rank0.notes) - len(notes)] if notes else rank0.notes
        return cls(
            strategy=str(s["strategy"]),
            engine=str(s["engine"]),
            label=str(s["label"]),
            world_size=int(s["world_size"]),
            num_nodes=int(s["num_nodes"]),
            units=tuple(s["units"]),
            rank0=LedgerSummary(
                rank0.evidence, rank0.device, rank0.peak, rank0.category_maxima, rank0.num_events, own, rank0.meta
            ),
            rank0_groups=tuple(EntryGroup.from_dict(g) for g in s["rank0_groups"]),
            ranks=tuple(RankSummary.from_dict(r) for r in data["ranks"]),
            collectives=tuple(
                Collective(**{k: v for k, v in c.items() if k != "wire_bytes"}) for c in data["collectives"]
            ),
            notes=notes,
            source_notes=tuple(str(n) for n in s["source_notes"]),
            source_single_instant=bool(s["source_single_instant"]),
        )


@dataclass(frozen=True)
class ShardReport:
    """What ``trainledger shard`` computed (without ``--run``): one summary per stage asked for."""

    source: str
    results: tuple[ShardSummary, ...]
    times: tuple[CommTime | None, ...]
    """Each stage's estimated communication time (``None``: no link bandwidth given)."""
    reserved: tuple[ReservedPrediction | None, ...] = ()
    """Each stage's rank 0 replayed through the caching allocator's model (empty: the model was off)."""

    def to_dict(self) -> dict[str, Any]:
        out = self.results[-1].to_dict()
        out["result"] = "shard"
        out["source"] = self.source
        out["stages"] = [
            {
                "strategy": r.strategy,
                "label": r.label,
                "model_state_bytes_per_rank": r.ranks[0].model_state_bytes,
                "peak_bytes_per_rank": [
                    {"first_rank": k.rank, "last_rank": k.last_rank, "num_ranks": k.num_ranks, "bytes": k.peak.bytes}
                    for k in r.ranks
                ],
                "collective_wire_bytes_per_rank": sum(c.wire_bytes for c in r.collectives),
                "comm_seconds": t.total_seconds if t else None,
                "exposed_comm_seconds": t.exposed_seconds if t else None,
                "excluded": [n for n in r.notes if n.startswith("excluded")],
                "time": asdict(t) if t else None,
                "summary": r.to_dict(),
            }
            for r, t in zip(self.results, self.times, strict=True)
        ]
        for stage, pred in zip(out["stages"], self.reserved, strict=False):
            if pred is not None:
                stage["allocator"] = pred.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardReport:
        """Read ``to_dict()`` back (``trainledger report``)."""
        stages = data["stages"]
        return cls(
            source=str(data["source"]),
            results=tuple(ShardSummary.from_dict(s["summary"]) for s in stages),
            times=tuple(CommTime(**s["time"]) if s["time"] else None for s in stages),
            reserved=tuple(ReservedPrediction.from_dict(s["allocator"]) for s in stages if "allocator" in s),
        )
