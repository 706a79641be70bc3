"""The caching allocator's size arithmetic: rounding, pools and segment sizes (no torch).

Constants are those of ``c10/core/AllocatorConfig.h`` in PyTorch 2.13.0 (``kMinBlockSize`` …); the
functions follow ``round_size``, ``roundup_power2_next_division``, ``get_pool`` and
``get_allocation_size`` in ``c10/cuda/CUDACachingAllocator.cpp``.
"""

from __future__ import annotations

MiB = 1 << 20

MIN_BLOCK_SIZE = 512
"""``kMinBlockSize``: every request is rounded up to a multiple of 512 bytes."""
SMALL_SIZE = MiB
"""``kSmallSize``: requests up to 1 MiB (after rounding) are served from the small pool."""
SMALL_BUFFER = 2 * MiB
"""``kSmallBuffer``: small requests are packed into 2 MiB segments (also the small pool's page when expandable)."""
MIN_LARGE_ALLOC = 10 * MiB
"""``kMinLargeAlloc``: large requests below 10 MiB share a ``large_segment_size`` segment."""
ROUND_LARGE = 2 * MiB
"""``kRoundLarge``: requests of 10 MiB and more get a segment of their own, rounded up to 2 MiB."""
LARGE_BUFFER = 20 * MiB
"""``kLargeBuffer``: the default ``large_segment_size`` (20 MiB), also the large pool's page when expandable."""

ROUNDUP_POWER2_INTERVALS = 16
"""``kRoundUpPowerOfTwoIntervals``: ``roundup_power2_divisions`` holds one value per power-of-two interval,
from ``[1 MiB, 2 MiB)`` (index 0; smaller sizes use it too) to ``[32 GiB, 64 GiB)`` and beyond (index 15)."""
_ROUNDUP_LOG2_START = 20  # log2(kRoundUpPowerOfTwoStart = 1 MiB)


def roundup_interval(nbytes: int) -> int:
    """Index of ``nbytes``'s power-of-two interval in a ``roundup_power2_divisions`` table.

    Example:
        >>> roundup_interval(1000), roundup_interval(3 * MiB), roundup_interval(1 << 40)
        (0, 1, 15)
    """
    return min(max(nbytes.bit_length() - 1 - _ROUNDUP_LOG2_START, 0), ROUNDUP_POWER2_INTERVALS - 1)


def roundup_power2_next_division(nbytes: int, divisions: int) -> int:
    """Round up to the next of ``divisions`` equal steps between two powers of two.

    Example (the source's own): 1200 lies in [1024, 2048); four steps are 1024, 1280, 1536, 1792.
        >>> roundup_power2_next_division(1200, 4)
        1280
    """
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)  # divisions is a power of two
    if step == 0:
        return floor << 1
    rounded_floor = nbytes & ~(step - 1)
    return nbytes if rounded_floor == nbytes else rounded_floor + step


def round_size(nbytes: int, divisions: int = 0) -> int:
    """The block size the allocator hands out for a request of ``nbytes`` (``round_size``).

    ``divisions`` is the ``roundup_power2_divisions`` value for the request's interval (0: off).

    Example:
        >>> [round_size(n) for n in (1, 511, 512, 513)]
        [512, 512, 512, 1024]
        >>> round_size(5 * MiB + 1, divisions=4)  # quarter steps of [4, 8) MiB: 4, 5, 6, 7 MiB
        6291456
    """
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if divisions > 1 and nbytes > MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(nbytes, divisions)
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def is_small(size: int) -> bool:
    """Whether a rounded size is served from the small pool (``get_pool``: ``size <= kSmallSize``)."""
    return size <= SMALL_SIZE


def allocation_size(size: int, large_segment_size: int = LARGE_BUFFER) -> int:
    """Bytes of the segment ``cudaMalloc``'d for a rounded request that no cached block serves.

    Example:
        >>> [allocation_size(s) // MiB for s in (512, 5 * MiB, 12 * MiB, 12 * MiB + 512)]
        [2, 20, 12, 14]
    """
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return large_segment_size
    return -(-size // ROUND_LARGE) * ROUND_LARGE
