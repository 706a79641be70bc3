"""How an array is divided among ranks: padded shards, whole-parameter assignment, an entry resized to its
shard. Pure, no torch."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from trainledger.ledger import Entry
from trainledger.units import dtype_bytes


def shard_rows(numel: int, shape: tuple[int, ...], num_shards: int, rank: int, partition: str) -> tuple[int, int]:
    """``(held, actual)`` elements of one array on ``rank``: what its storage holds (with padding) and
    how many of those are real elements.

    ``flat``: ``ceil(numel / N)`` each (DeepSpeed's padded partitions). ``dim0``: ``ceil(d0 / N)`` rows of
    dim 0 (FSDP2's ``torch.chunk``), the last ranks holding fewer real rows, possibly none.

    Example:
        >>> [shard_rows(10 * 3, (10, 3), 4, r, "dim0") for r in range(4)]
        [(9, 9), (9, 9), (9, 9), (9, 3)]
        >>> shard_rows(7, (7,), 4, 3, "flat")
        (2, 1)
    """
    if partition == "dim0" and shape:
        d0 = shape[0]
        rest = numel // d0 if d0 else 0
        rows = -(-d0 // num_shards)
        real = max(0, min(rows, d0 - rank * rows))
        return rows * rest, real * rest
    per = -(-numel // num_shards)
    return per, max(0, min(per, numel - rank * per))


def rank_boundaries(numel: int, shape: tuple[int, ...], num_shards: int, partition: str) -> tuple[int, ...]:
    """The ranks at which :func:`shard_rows` of this array changes: every rank from one boundary up to the
    next holds the same ``(held, actual)``. Ranks below ``full`` hold a whole shard, rank ``full`` the
    remainder (if any), the ranks after it nothing; so there are at most two boundaries, whatever ``N``.

    Example:
        >>> rank_boundaries(10 * 3, (10, 3), 4, "dim0")  # ranks 0-2 hold 3 rows, rank 3 one row
        (3,)
        >>> rank_boundaries(10, (10,), 1000, "dim0")  # ranks 0-9 hold a row, ranks 10-999 none
        (10,)
    """
    length = shape[0] if partition == "dim0" and shape else numel
    per = -(-length // num_shards)
    if per == 0 or numel == 0:
        return ()
    full = length // per
    ends = {full, full + 1} if length % per else {full}
    return tuple(sorted(b for b in ends if 0 < b < num_shards))


def greedy_owners(sizes: Sequence[int], num_ranks: int) -> list[int]:
    """``ZeroRedundancyOptimizer``'s partition: largest parameter first (stable), each to the rank
    holding the fewest elements so far (lowest rank on ties). Returns the owner of each parameter.

    Work grows with the number of parameters, not of ranks: ranks never given anything all hold 0, so
    the lowest of them stands for all; the others are kept in a heap of ``(load, rank)``.

    Example:
        >>> greedy_owners([5, 3, 3, 1], 2)
        [0, 1, 1, 0]
        >>> greedy_owners([5, 3], 10**12)
        [0, 1]
    """
    owners = [0] * len(sizes)
    loaded: list[tuple[int, int]] = []  # (load, rank) of every rank given a parameter
    fresh = 0  # the lowest rank not given anything yet (load 0)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if fresh < num_ranks and (not loaded or (0, fresh) < loaded[0]):
            load, rank = 0, fresh
            fresh += 1
        else:
            load, rank = heapq.heappop(loaded)
        owners[i] = rank
        heapq.heappush(loaded, (load + sizes[i], rank))
    return owners


def resized(e: Entry, numel: int, role_suffix: str = "") -> Entry:
    """``e`` holding ``numel`` elements of its dtype (its shape dropped when that changes its size)."""
    size = e.nbytes // e.numel if e.numel else dtype_bytes(e.dtype)
    shape = () if numel != e.numel else e.shape
    return replace(e, numel=numel, nbytes=numel * size, shape=shape, role=e.role + role_suffix)
