"""A model of PyTorch's CUDA caching allocator that replays a ledger (no torch).

``replay(ledger)`` runs a step's allocations and frees, in event order, through the algorithm of
``DeviceCachingAllocator`` and predicts what ``torch.cuda.max_memory_reserved()`` would report, the
fragmentation at the allocated peak, the segments held there, and whether the step fits a device once
the allocator's cache releases and retries are taken into account. ``CachingAllocatorModel`` is the
allocator itself, for driving by hand.

Source followed
---------------
PyTorch 2.13.0 (``torch.version.git_version`` ``cf30153c4c131c8164ee7798e5022d810682e2cb``). Constants and
options are those of ``c10/core/AllocatorConfig.h`` and ``c10/cuda/CUDAAllocatorConfig.h`` as that release
ships them. The algorithm is ``DeviceCachingAllocator`` in pytorch/pytorch
``c10/cuda/CUDACachingAllocator.cpp`` as it stands after pull request #172056 (``large_segment_size_mb``,
which ``max_non_split_rounding_mb`` defaults to), checked against the same file at commit
``001074d25084fdb87a799823e395a50f5ec044d3`` for the parts that did not change.

Modelled: ``round_size`` (512-byte rounding, ``roundup_power2_divisions``), small (≤ 1 MiB) and large pools
per stream, segment sizes from ``get_allocation_size`` (2 MiB; ``large_segment_size`` for large requests
under 10 MiB; the request rounded up to 2 MiB from 10 MiB), best fit ordered by (stream, size, address),
``should_split``, merging of freed neighbours, ``max_split_size`` and ``max_non_split_rounding``,
``release_available_cached_blocks``, ``release_cached_blocks`` (``empty_cache()``) and the OOM retry, and
``expandable_segments`` (one growing segment per stream and pool, mapped in 2 MiB pages for the small
pool and ``large_segment_size`` pages, 20 MiB, for the large pool; reserved bytes are the mapped bytes).

Known limitations
-----------------
- Entries that exist before the step are allocated once, in ledger order, before it: their real order
  and any frees in earlier steps (which decide the cache the step starts with) are unknown.
- Addresses are the model's: segments follow one another, never reusing a freed range, so ties between
  equal-sized cached blocks (broken by address) can go differently on a device.
- Cross-stream use (``record_stream`` and its deferred frees), CUDA graph private pools, ``MemPool``,
  ``garbage_collection_threshold``, ``per_process_memory_fraction`` (pass the capacity it leaves instead),
  the ``cudaMallocAsync`` backend and IPC are not modelled.
- ``cudaMalloc`` is assumed to succeed exactly while reserved bytes stay within the capacity given; the
  driver's own granularity and other processes' memory are not modelled.
- Only the ledger's entries are replayed; workspaces and buffers it does not list are not predicted.

Example:
    >>> from trainledger.allocator import AllocatorConfig, replay
    >>> from trainledger.ledger import Category, Entry, Event, Ledger
    >>> def act(name, mib, born):  # an activation of ``mib`` MiB, born at event ``born``, freed at the end
    ...     return Entry(name, Category.ACTIVATIONS, "saved", "float32", 1, mib << 20, alloc_event=born, free_event=3)
    >>> acts = (act("a", 6, 0), act("b", 12, 0), act("c", 6, 1), act("d", 12, 1), act("e", 3, 2))
    >>> led = Ledger(acts, tuple(Event(i, "forward") for i in range(3)))
    >>> replay(led).max_reserved_bytes >> 20  # e (3 MiB) finds only 2 MiB tails: a third 20 MiB segment
    60
    >>> replay(led, AllocatorConfig(expandable_segments=True)).max_reserved_bytes >> 20  # two pages
    40
"""

from trainledger.allocator._config import AllocatorConfig
from trainledger.allocator._engine import AllocatorOutOfMemory, CachingAllocatorModel
from trainledger.allocator._prediction import ReservedPrediction, Verdict, predict_reserved
from trainledger.allocator._replay import replay
from trainledger.allocator._results import (
    AllocatorReplay,
    BlockInfo,
    FailedRequest,
    OOMEvent,
    PeakState,
    ReservedChange,
    SegmentInfo,
)
from trainledger.allocator._sizes import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    allocation_size,
    round_size,
)

__all__ = [
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "AllocatorReplay",
    "BlockInfo",
    "CachingAllocatorModel",
    "FailedRequest",
    "OOMEvent",
    "PeakState",
    "ReservedChange",
    "ReservedPrediction",
    "SegmentInfo",
    "Verdict",
    "allocation_size",
    "predict_reserved",
    "replay",
    "round_size",
]
