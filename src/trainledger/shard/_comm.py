"""Communication of data-parallel sharding: what each collective moves per rank, and how long it takes.

Pure arithmetic, no torch. Volumes are the bandwidth-optimal (ring) figures every ZeRO/FSDP analysis
uses (Rajbhandari et al. 2019, §7; Patarasuk & Yuan 2009):

- all-reduce of ``S`` bytes over ``N`` ranks sends ``2(N−1)/N · S`` bytes per rank;
- reduce-scatter whose *input* is ``S`` bytes sends ``(N−1)/N · S``;
- all-gather whose *output* is ``S`` bytes sends ``(N−1)/N · S``;
- broadcasting ``S`` bytes costs ``(N−1)·S`` in all, ``(N−1)/N · S`` per rank on average (a set of
  broadcasts from every owner is an all-gather done piecewise, as ``ZeroRedundancyOptimizer`` does).

``payload_bytes`` is the size of the tensors handed to the collective (what a wrapper around the call
sees); ``wire_bytes`` is the per-rank volume above, rounded to whole bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from trainledger.checks import positive_number
from trainledger.errors import InputError

Kind = Literal["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
KINDS: tuple[Kind, ...] = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")

# Fraction of the payload each rank sends, as a function of the group size N.
_FACTOR = {
    "all_reduce": lambda n: Fraction(2 * (n - 1), n),
    "reduce_scatter": lambda n: Fraction(n - 1, n),
    "all_gather": lambda n: Fraction(n - 1, n),
    "broadcast": lambda n: Fraction(n - 1, n),
}


def wire_bytes(kind: Kind, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for one collective (ring algorithm), rounded to whole bytes.

    Example:
        >>> wire_bytes("all_reduce", 1000, 4), wire_bytes("all_gather", 1000, 4)
        (1500, 750)
    """
    if kind not in _FACTOR:
        raise InputError(f"unknown collective {kind!r}; accepted: {', '.join(KINDS)}")
    if group_size < 1:
        raise InputError(f"group size {group_size} must be at least 1")
    return round(_FACTOR[kind](group_size) * payload_bytes)


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective (or a run of calls of one kind, summed) of a step, seen from one rank."""

    kind: Kind
    phase: str
    """``forward``, ``backward`` or ``optimizer``: when in the step it runs."""
    label: str
    """What it moves: ``gradients``, ``params of blocks.0``, ``gradient bucket 2``…"""
    payload_bytes: int
    """Bytes of the tensors handed to the calls, summed (all-gather: output; reduce-scatter: input)."""
    group_size: int
    num_calls: int = 1
    """How many calls move that payload between them (it sets the latency term, not the volume)."""

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.kind, self.payload_bytes, self.group_size)


def payload_by_kind(collectives: Iterable[Collective]) -> dict[str, int]:
    """Payload bytes per kind of collective (only kinds that occur)."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.payload_bytes
    return out


def wire_by_kind(collectives: Iterable[Collective]) -> dict[str, int]:
    """Per-rank wire bytes per kind of collective (only kinds that occur)."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.wire_bytes
    return out


@dataclass(frozen=True, slots=True)
class CommTime:
    """Estimated time of a step's collectives on one link, and the part not hidden behind compute."""

    link_gbps: float
    total_seconds: float
    """All collectives back to back at the link's bandwidth (per-rank wire bytes / bandwidth)."""
    exposed_seconds: float
    """The part not overlapped with compute (see :func:`estimate_time`)."""
    by_phase_seconds: dict[str, float]
    compute_seconds: dict[str, float] | None
    """Compute time per phase used for the overlap; ``None``: none given, everything counted exposed."""


def estimate_time(
    collectives: Sequence[Collective],
    *,
    link_gbps: float,
    compute_seconds: dict[str, float] | None = None,
    latency_seconds: float = 0.0,
) -> CommTime:
    """Time of the collectives at ``link_gbps`` (10^9 bits/s) and the part exposed beyond compute.

    Overlap model: collectives of the forward and backward phases run while that phase computes (FSDP
    and DDP issue them asynchronously), so a phase exposes ``max(0, comm − compute)`` plus its first
    collective in forward (nothing to overlap before the first unit's parameters arrive) and its last in
    backward (the final bucket is reduced after the last gradient is produced). Optimizer-phase
    collectives (ZeRO-1/2 parameter gathers after the step) are all exposed. Without
    ``compute_seconds`` every collective counts as exposed (an upper bound).

    Example:
        >>> c = [Collective("all_reduce", "backward", "grads", 10**9, 2)]
        >>> t = estimate_time(c, link_gbps=8.0)
        >>> round(t.total_seconds, 3), round(t.exposed_seconds, 3)
        (1.0, 1.0)
    """
    positive_number(link_gbps, "link bandwidth", unit="gigabits per second")
    bytes_per_second = link_gbps * 1e9 / 8

    def seconds(c: Collective) -> float:
        return c.wire_bytes / bytes_per_second + c.num_calls * latency_seconds

    by_phase: dict[str, float] = {}
    for c in collectives:
        by_phase[c.phase] = by_phase.get(c.phase, 0.0) + seconds(c)
    total = sum(by_phase.values())
    if compute_seconds is None:
        exposed = total
    else:
        exposed = 0.0
        for phase, comm in by_phase.items():
            of_phase = [c for c in collectives if c.phase == phase]
            if phase not in ("forward", "backward"):
                exposed += comm
                continue
            edge_call = of_phase[0] if phase == "forward" else of_phase[-1]
            edge = seconds(edge_call) / edge_call.num_calls  # one call of it
            hidden_room = compute_seconds.get(phase, 0.0)
            exposed += min(comm, edge + max(0.0, comm - edge - hidden_room))
    return CommTime(link_gbps, total, exposed, by_phase, compute_seconds)
