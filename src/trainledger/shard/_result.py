"""What :func:`~trainledger.shard.shard` returns: every rank's ledger (one per class of identical ranks) and
the step's collectives. Pure, no torch."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from trainledger.ledger import Category, Ledger
from trainledger.shard._comm import Collective
from trainledger.shard._config import ShardConfig
from trainledger.shard._summary import RankSummary, ShardSummary


class RankLedgers(Sequence[Ledger]):
    """Every rank's ledger, computed once per class of identical ranks.

    Ranks differ only where a partition is uneven (the last ranks hold fewer real elements, possibly
    none) or where whole parameters are assigned to ranks; all the others hold the same. So the work
    and memory of a transform grow with the number of *distinct* ranks (a few per parameter shape at
    most), never with the world size: ``ranks[r]`` is the ledger of ``r``'s class, ``len(ranks)`` the
    world size, and :meth:`classes` lists each class once.
    """

    def __init__(self, world_size: int, group_size: int, starts: Sequence[int], ledgers: Sequence[Ledger]) -> None:
        self.world_size, self.group_size = world_size, group_size
        self.starts, self.ledgers = tuple(starts), tuple(ledgers)
        """``starts[k]``: the first rank (within a shard group of ``group_size``) of class ``k``."""

    def __len__(self) -> int:
        return self.world_size

    @overload
    def __getitem__(self, index: int) -> Ledger: ...
    @overload
    def __getitem__(self, index: slice) -> list[Ledger]: ...
    def __getitem__(self, index: int | slice) -> Ledger | list[Ledger]:
        if isinstance(index, slice):
            return [self[i] for i in range(self.world_size)[index]]
        if index < 0:
            index += self.world_size
        if not 0 <= index < self.world_size:
            raise IndexError(f"rank {index} out of range for {self.world_size} ranks")
        return self.ledgers[bisect.bisect_right(self.starts, index % self.group_size) - 1]

    def classes(self) -> list[tuple[int, int, int, Ledger]]:
        """``(first rank, last rank, number of ranks, ledger)`` per class; first and last are within the
        first shard group (hybrid sharding repeats the classes in every group)."""
        ends = [*self.starts[1:], self.group_size]
        replicas = self.world_size // self.group_size
        return [
            (first, end - 1, (end - first) * replicas, led)
            for first, end, led in zip(self.starts, ends, self.ledgers, strict=True)
        ]


@dataclass(frozen=True)
class ShardResult:
    """Per-rank ledgers and the collectives of one sharded step."""

    config: ShardConfig
    label: str
    source: Ledger
    ranks: Sequence[Ledger]
    """Every rank's ledger (a :class:`RankLedgers`: identical ranks share one)."""
    collectives: tuple[Collective, ...]
    """Per rank (every rank runs the same collectives)."""
    units: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def rank_classes(self) -> list[tuple[int, int, int, Ledger]]:
        """``(first rank, last rank, number of ranks, ledger)`` for each class of identical ranks."""
        if isinstance(self.ranks, RankLedgers):
            return self.ranks.classes()
        return [(r, r, 1, led) for r, led in enumerate(self.ranks)]

    def model_state_bytes(self, rank: int = 0) -> int:
        """Weights, frozen weights, gradients and optimizer state held on ``rank``, persistent ones only
        (the ZeRO paper's "model states"); gathered parameters and buffers are not included."""
        return sum(
            e.nbytes
            for e in self.ranks[rank].entries
            if e.category in _MODEL_STATE and e.role != "gathered" and e.alloc_event is None
        )

    def summary(self) -> ShardSummary:
        """What the reports print of this result: rank 0's tables, each class of identical ranks' peak, the
        collectives."""
        source = self.source
        return ShardSummary(
            strategy=self.config.strategy,
            engine=self.config.engine,
            label=self.label,
            world_size=self.config.world_size,
            num_nodes=self.config.num_nodes,
            units=tuple(self.units),
            rank0=self.ranks[0].summary(),
            rank0_groups=self.ranks[0].groups(),
            ranks=tuple(
                RankSummary(
                    first,
                    led.peak(),
                    self.model_state_bytes(first),
                    {k[0]: v for k, v in led.bytes_by("category").items()},
                    last,
                    count,
                )
                for first, last, count, led in self.rank_classes()
            ),
            collectives=tuple(self.collectives),
            notes=tuple(self.notes),
            source_notes=tuple(source.notes),
            source_single_instant=source.num_events == 1 and source.events[0].phase == "state",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form: rank 0's ledger keys at the top, each class of identical ranks under ``ranks``."""
        return self.summary().to_dict()


_MODEL_STATE = (Category.WEIGHTS, Category.FROZEN, Category.GRADIENTS, Category.OPTIMIZER)
