"""How an array is divided among ranks: padded shards, whole-parameter assignment, an entry resized to its
shard. Pure, no torch."""

from __future__ import annotations

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


def greedy_owners(sizes: Sequence[int], num_ranks: int) -> list[int]:
    """``ZeroRedundancyOptimizer``'s partition: largest parameter first (stable), each to the rank
    holding the fewest elements so far (lowest rank on ties). Returns the owner of each parameter.

    Example:
        >>> greedy_owners([5, 3, 3, 1], 2)
        [0, 1, 1, 0]
    """
    owners = [0] * len(sizes)
    load = [0] * num_ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


def resized(e: Entry, numel: int, role_suffix: str = "") -> Entry:
    """``e`` holding ``numel`` elements of its dtype (its shape dropped when that changes its size)."""
    size = e.nbytes // e.numel if e.numel else dtype_bytes(e.dtype)
    shape = () if numel != e.numel else e.shape
    return replace(e, numel=numel, nbytes=numel * size, shape=shape, role=e.role + role_suffix)
