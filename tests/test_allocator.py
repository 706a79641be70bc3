"""The caching-allocator model against sequences worked by hand from ``CUDACachingAllocator.cpp``.

Sizes are in MiB unless said otherwise. ``layout`` writes a segment as its blocks, ``+`` allocated and
``-`` free, e.g. ``["+5", "-15"]`` for a 20 MiB segment holding one 5 MiB allocation.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainledger.allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
    allocation_size,
    replay,
    round_size,
)
from trainledger.errors import InputError
from trainledger.ledger import Category, Entry, Event, Ledger

MiB = 1 << 20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def layout(model: CachingAllocatorModel) -> list[list[str]]:
    def fmt(size: int, allocated: bool) -> str:
        value = size / MiB
        return ("+" if allocated else "-") + (f"{value:g}" if value >= 0.5 else f"{size}B")

    return [[fmt(b.size_bytes, b.allocated) for b in seg.blocks] for seg in model.segments()]


def mib(model: CachingAllocatorModel) -> tuple[float, float]:
    return model.reserved_bytes / MiB, model.allocated_bytes / MiB


# --- rounding and segment sizes --------------------------------------------------------------------------


def test_round_size_at_the_boundaries():
    # round_size: below kMinBlockSize (512) → 512; otherwise up to a multiple of 512
    assert round_size(1) == 512
    assert round_size(511) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024  # 2 × 512
    assert round_size(MiB) == MiB  # 2048 × 512: still the small pool (size <= kSmallSize)
    assert round_size(MiB + 1) == MiB + 512  # 2049 × 512: the large pool


def test_pool_and_segment_of_1_mib_and_1_mib_plus_1():
    m = CachingAllocatorModel()
    m.malloc(MiB)  # small pool: a 2 MiB segment (kSmallBuffer), 1 MiB left
    m.malloc(MiB + 1)  # 1 MiB + 512 B: large pool, under 10 MiB → a 20 MiB segment (kLargeBuffer)
    assert [(s.pool, s.size_bytes) for s in m.segments()] == [("small", 2 * MiB), ("large", 20 * MiB)]
    # 20 MiB − (1 MiB + 512) = 19 MiB − 512 remains, > kSmallSize: split
    assert m.segments()[1].blocks[1].size_bytes == 19 * MiB - 512


def test_small_request_gets_a_2_mib_segment():
    m = CachingAllocatorModel()
    m.malloc(1000)  # rounds to 1024; small pool; no cached block → cudaMalloc(kSmallBuffer = 2 MiB)
    # the 2 MiB − 1024 remainder is >= kMinBlockSize, so the small block is split
    assert [(b.size_bytes, b.allocated) for b in m.segments()[0].blocks] == [(1024, True), (2 * MiB - 1024, False)]
    assert (m.reserved_bytes, m.allocated_bytes) == (2 * MiB, 1024)


def test_5_mib_request_gets_a_20_mib_segment():
    m = CachingAllocatorModel()
    m.malloc(5 * MiB)  # 1 MiB < 5 MiB < kMinLargeAlloc (10 MiB) → kLargeBuffer = 20 MiB; 15 > 1 MiB: split
    assert layout(m) == [["+5", "-15"]]
    assert mib(m) == (20, 5)


def test_12_mib_request_gets_its_own_12_mib_segment():
    m = CachingAllocatorModel()
    m.malloc(12 * MiB)  # >= 10 MiB: kRoundLarge × ceil(12 / 2) = 12 MiB, nothing left over
    assert layout(m) == [["+12"]]
    assert allocation_size(12 * MiB + 512) == 14 * MiB  # rounded up to the next 2 MiB


def test_a_remainder_of_exactly_1_mib_is_not_split_off():
    m = CachingAllocatorModel()
    m.malloc(25 * MiB // 2)  # 12.5 → 14 MiB segment; 1.5 MiB remains, > kSmallSize: split
    m.malloc(13 * MiB)  # 13 → 14 MiB segment; 1 MiB remains, not > kSmallSize: the block goes whole
    assert layout(m) == [["+12.5", "-1.5"], ["+14"]]
    assert mib(m) == (28, 12.5 + 14)  # allocated counts the whole 14 MiB block, as memory_allocated() does


def test_roundup_power2_divisions():
    cfg = AllocatorConfig(roundup_power2_divisions=4)
    # 5 MiB + 1 lies in [4, 8) MiB, whose quarters are 4, 5, 6, 7 MiB → 6 MiB
    assert round_size(5 * MiB + 1, cfg.roundup_divisions_for(5 * MiB + 1)) == 6 * MiB
    m = CachingAllocatorModel(cfg)
    m.malloc(5 * MiB + 1)
    assert layout(m) == [["+6", "-14"]]
    # a power of two is kept as it is; below 512 × divisions the 512-byte rule applies
    assert round_size(8 * MiB, 4) == 8 * MiB
    assert round_size(1500, 4) == 1536


# --- best fit, splitting, merging ------------------------------------------------------------------------


def test_split_blocks_are_reused_best_fit():
    m = CachingAllocatorModel()
    a = m.malloc(5 * MiB)  # segment A: [+5 -15]
    m.malloc(6 * MiB)  # best fit >= 6: the 15 MiB block; 9 left, split: [+5 +6 -9]
    m.free(a)  # [-5 +6 -9]: its neighbour is allocated, no merge
    m.malloc(4 * MiB)  # best fit >= 4 among {5, 9}: 5; 1 MiB left, not > 1 MiB: taken whole
    assert layout(m) == [["+5", "+6", "-9"]]
    assert mib(m) == (20, 11)  # one segment; the 4 MiB request holds a 5 MiB block


def test_freed_neighbours_merge_into_one_block():
    m = CachingAllocatorModel()
    a = m.malloc(5 * MiB)
    b = m.malloc(6 * MiB)  # [+5 +6 -9]
    m.free(a)  # [-5 +6 -9]
    m.free(b)  # merges with the 5 before it and the 9 after it: [-20]
    assert layout(m) == [["-20"]]
    assert m.releasable_bytes() == 20 * MiB  # unsplit again: empty_cache() can return it


def test_streams_do_not_share_cached_blocks():
    m = CachingAllocatorModel()
    m.malloc(5 * MiB, stream=0)  # [+5 -15] on stream 0
    m.malloc(5 * MiB, stream=1)  # stream 0's 15 MiB block is not searched: a new 20 MiB segment
    assert [s.stream for s in m.segments()] == [0, 1]
    assert mib(m) == (40, 10)


# --- fragmentation, out of memory, expandable segments ---------------------------------------------------

FRAGMENTING = (6, 12, 6, 12, 3)  # MiB, allocated in order, never freed


def _run(sizes, config=None, capacity=None) -> CachingAllocatorModel:
    m = CachingAllocatorModel(config, capacity_bytes=capacity)
    for size in sizes:
        m.malloc(size * MiB)
    return m


def test_fragmentation_needs_a_new_segment():
    m = _run(FRAGMENTING[:4])
    # 6 → S1 [+6 -14]; 12 → best fit 14, 2 left: S1 [+6 +12 -2]; 6 → nothing >= 6: S2 [+6 -14];
    # 12 → S2 [+6 +12 -2]
    assert layout(m) == [["+6", "+12", "-2"], ["+6", "+12", "-2"]]
    assert m.largest_free_block_bytes() == 2 * MiB
    m.malloc(3 * MiB)  # 4 MiB free in total, but no block >= 3 MiB: a third 20 MiB segment
    assert mib(m) == (60, 39)


def test_fragmentation_runs_out_of_memory_although_the_bytes_fit():
    m = _run(FRAGMENTING[:4], capacity=56 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as exc:
        m.malloc(3 * MiB)  # 40 + 20 > 56; release_cached_blocks frees nothing (both segments are split)
    failed = exc.value.failed
    assert (failed.segment_bytes, failed.reserved_bytes, failed.allocated_bytes) == (20 * MiB, 40 * MiB, 36 * MiB)
    assert failed.allocated_bytes + failed.rounded_bytes <= failed.capacity_bytes  # 39 <= 56: fragmentation
    assert m.num_cache_flushes == 1


def test_expandable_segments_reserve_less_in_the_same_sequence():
    m = _run(FRAGMENTING, EXPANDABLE, capacity=56 * MiB)
    # 6 → map one 20 MiB page: [+6 -14]; 12 → [+6 +12 -2]; 6 → the 2 MiB tail plus one more page:
    # [+6 +12 +6 -16]; 12 → [.. +12 -4]; 3 → the 4 MiB tail: [.. +3 -1]. Two pages, one segment.
    assert layout(m) == [["+6", "+12", "+6", "+12", "+3", "-1"]]
    assert mib(m) == (40, 39)


def test_expandable_best_fit_prefers_a_block_that_cannot_grow():
    m = CachingAllocatorModel(EXPANDABLE)
    a = m.malloc(12 * MiB)  # one page: [+12 -8]
    m.malloc(8 * MiB)  # the tail, whole: [+12 +8]
    m.malloc(10 * MiB)  # one more page: [+12 +8 +10 -10]
    m.free(a)  # [-12 +8 +10 -10]
    # 9 MiB: the smallest fit is the 10 MiB tail, but it borders unmapped space (its "expandable size" is
    # 10 MiB plus the rest of the address space), so the 12 MiB block, which cannot grow, is chosen
    m.malloc(9 * MiB)
    assert layout(m) == [["+9", "-3", "+8", "+10", "-10"]]


def test_expandable_empty_cache_unmaps_whole_free_pages():
    m = CachingAllocatorModel(EXPANDABLE)
    a = m.malloc(30 * MiB)  # two 20 MiB pages: [+30 -10]
    m.malloc(25 * MiB)  # the 10 MiB tail plus one page: [+30 +25 -5]
    m.free(a)  # [-30 +25 -5]
    assert mib(m) == (60, 25)
    # page [0, 20) lies inside the free 30 MiB; page [20, 40) holds the start of the 25 MiB block
    assert m.releasable_bytes() == 20 * MiB
    assert m.empty_cache() == 20 * MiB
    assert layout(m) == [["-10", "+25", "-5"]]  # one mapped range, from 20 MiB on


def test_empty_cache_releases_only_whole_free_segments():
    m = CachingAllocatorModel()
    b = m.malloc(12 * MiB)  # S1 [+12]
    m.malloc(5 * MiB)  # S2 [+5 -15]
    s = m.malloc(1000)  # S3 (small) [+1024B -rest]
    m.free(b)
    m.free(s)  # S1 and S3 are single free blocks; S2 is split around a live block
    assert m.empty_cache() == 14 * MiB  # 12 + 2
    assert layout(m) == [["+5", "-15"]]
    assert m.max_reserved_bytes == 34 * MiB


def test_cache_flush_lets_a_step_fit():
    m = CachingAllocatorModel(capacity_bytes=20 * MiB)
    m.free(m.malloc(12 * MiB))  # a cached, unsplit 12 MiB segment
    m.malloc(14 * MiB)  # 12 + 14 > 20 → release_cached_blocks frees the 12, the retry succeeds
    assert mib(m) == (14, 14)
    assert m.num_cache_flushes == 1


# --- max_split_size --------------------------------------------------------------------------------------

SPLIT_40 = AllocatorConfig(max_split_size_bytes=40 * MiB)


def test_oversize_blocks_are_not_given_to_smaller_requests():
    m = CachingAllocatorModel(SPLIT_40)
    m.free(m.malloc(50 * MiB))  # a cached 50 MiB segment: oversize (>= 40)
    m.malloc(35 * MiB)  # 35 < 40: may not take an oversize block → a 36 MiB segment
    assert mib(m) == (86, 36)
    m.malloc(45 * MiB)  # 45 >= 40: takes the 50 MiB block (50 < 45 + 20), whole: oversize blocks never split
    assert layout(m) == [["+50"], ["+36"]]  # the 35 MiB request's 1 MiB remainder was not > 1 MiB: no split
    assert mib(m) == (86, 86)


def test_oversize_requests_take_oversize_blocks_only_within_the_rounding_slack():
    m = CachingAllocatorModel(SPLIT_40)
    m.free(m.malloc(100 * MiB))
    m.malloc(60 * MiB)  # 100 >= 60 + 20 (max_non_split_rounding, default 20 MiB): not taken
    assert mib(m) == (160, 60)
    m.malloc(85 * MiB)  # 100 < 85 + 20: taken whole
    assert mib(m) == (160, 160)
    wider = CachingAllocatorModel(AllocatorConfig(max_split_size_bytes=40 * MiB, max_non_split_rounding_bytes=50 * MiB))
    wider.free(wider.malloc(100 * MiB))
    wider.malloc(60 * MiB)  # 100 < 60 + 50
    assert mib(wider) == (100, 100)


def test_oversize_cached_blocks_are_released_before_a_full_flush():
    m = CachingAllocatorModel(SPLIT_40, capacity_bytes=150 * MiB)
    m.free(m.malloc(100 * MiB))
    # 60 MiB: the cached 100 is out of slack; 100 + 60 > 150 → release_available_cached_blocks frees the
    # smallest oversize block >= max(60, 40), the 100, and the retry cudaMallocs 60 (no full flush)
    m.malloc(60 * MiB)
    assert mib(m) == (60, 60)
    assert (m.max_reserved_bytes, m.num_cache_flushes) == (100 * MiB, 0)


def test_split_remainder_rule_follows_max_split_size():
    m = CachingAllocatorModel(SPLIT_40)
    m.malloc(38 * MiB + 1)  # rounds to 38 MiB + 512 → 40 MiB segment; 38 MiB + 512 < 40: may split, but
    # the remainder, 2 MiB − 512, is > 1 MiB: split
    assert layout(m)[0][0] == f"+{(38 * MiB + 512) / MiB:g}"
    m2 = CachingAllocatorModel(SPLIT_40)
    m2.malloc(41 * MiB)  # 42 MiB segment; 41 >= max_split_size: never split, 1 MiB stays in the block
    assert layout(m2) == [["+42"]]


# --- invariants on random sequences ----------------------------------------------------------------------

_SIZES = st.one_of(st.integers(1, 2 * MiB), st.integers(MiB, 48 * MiB), st.sampled_from([512, MiB, 10 * MiB, 20 * MiB]))
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), _SIZES, st.integers(0, 1)),
        st.tuples(st.just("free"), st.integers(0, 10**6), st.just(0)),
    ),
    max_size=60,
)


def _check(m: CachingAllocatorModel, live: dict[int, int]) -> int:
    segments = m.segments()
    assert m.reserved_bytes >= m.allocated_bytes
    assert m.reserved_bytes % (2 * MiB) == 0  # segments, and expandable pages, are multiples of 2 MiB
    assert m.reserved_bytes == sum(s.size_bytes for s in segments)
    assert m.allocated_bytes == sum(s.allocated_bytes for s in segments)
    if m.capacity_bytes is not None:
        assert m.reserved_bytes <= m.capacity_bytes
    spans = []
    for seg in segments:
        address = seg.address
        for block in seg.blocks:  # blocks tile their segment
            assert block.address == address
            address += block.size_bytes
            if block.allocated:
                spans.append((block.address, block.address + block.size_bytes))
        assert address == seg.address + seg.size_bytes
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no overlap
    assert sorted(live) == [s for s, _ in spans]
    return len(spans)


@settings(max_examples=100, deadline=None, database=None)
@given(
    ops=_OPS,
    expandable=st.booleans(),
    split=st.sampled_from([None, 40 * MiB]),
    capacity=st.sampled_from([None, 160 * MiB]),
)
def test_invariants_hold_on_random_sequences(ops, expandable, split, capacity):
    cfg = AllocatorConfig(expandable_segments=expandable, max_split_size_bytes=split)
    m = CachingAllocatorModel(cfg, capacity_bytes=capacity)
    live: dict[int, int] = {}
    for op, value, stream in ops:
        if op == "alloc":
            try:
                live[m.malloc(value, stream)] = value
            except AllocatorOutOfMemory:
                assert capacity is not None
        elif live:
            address = sorted(live)[value % len(live)]
            m.free(address)
            del live[address]
        _check(m, live)
    assert m.max_reserved_bytes >= m.reserved_bytes
    for address in list(live):
        m.free(address)
        del live[address]
    assert _check(m, live) == 0 and m.allocated_bytes == 0
    # everything freed: every segment (every mapped range) is one cached free block, all of it releasable
    assert all(len(seg.blocks) == 1 for seg in m.segments())
    assert m.releasable_bytes() == m.reserved_bytes
    m.empty_cache()
    assert m.reserved_bytes == 0 and m.segments() == ()


# --- replaying a ledger ----------------------------------------------------------------------------------


def _entry(name, size_mib, alloc=None, free=None, device="cpu"):
    return Entry(
        name, Category.ACTIVATIONS, "saved", "float32", 1, size_mib * MiB, device, alloc_event=alloc, free_event=free
    )


def _events(n):
    return tuple(Event(i, "forward", f"op{i}") for i in range(n))


def test_replay_frees_before_it_allocates_at_an_event():
    # w exists before the step; x lives at event 0, y at event 1: at event 1 x is freed before y is
    # allocated, so y reuses x's cached 12 MiB segment: 12 + 12 reserved, not 36
    led = Ledger((_entry("w", 12), _entry("x", 12, 0, 1), _entry("y", 12, 1, 2)), _events(2))
    r = replay(led)
    assert (r.reserved_before_step_bytes, r.max_reserved_bytes) == (12 * MiB, 24 * MiB)
    assert r.max_reserved_event == 0
    assert [(c.event, c.reserved_bytes) for c in r.reserved_timeline] == [(0, 24 * MiB)]
    assert r.peak.event == 0 and r.peak.allocated_bytes == 24 * MiB
    assert r.releasable_after_step_bytes == 12 * MiB  # y's segment, freed at the end; w is never freed
    assert any("before the step" in note for note in r.notes)


def test_replay_peak_snapshot_names_the_blocks():
    led = Ledger((_entry("w", 5), _entry("a", 12, 0, 2), _entry("b", 3, 1, 2)), _events(2))
    r = replay(led)
    # w: [+5 -15]; a 12 → best fit 15: [+5 +12 -3]; b 3 → the 3 MiB block, whole
    assert r.peak.event == 1
    assert [b.label for b in r.peak.segments[0].blocks] == ["w", "a", "b"]
    assert (r.peak.reserved_bytes, r.peak.fragmentation_bytes, r.peak.num_segments) == (20 * MiB, 0, 1)


def test_replay_counts_transient_entries():
    # t lives for no event (alloc_event == free_event): it is allocated and freed before the event's
    # allocations, so its 30 MiB segment is reserved and then serves u (2 MiB, split off the cached 30)
    led = Ledger((_entry("t", 30, 0, 0), _entry("u", 2, 0, 1)), _events(1))
    r = replay(led)
    assert r.max_reserved_bytes == 30 * MiB
    assert r.max_allocated_bytes == 30 * MiB  # t, for the moment it lived
    assert r.peak.allocated_bytes == 2 * MiB  # the ledger's instant: u only


def test_replay_reports_the_failing_entry():
    led = Ledger(
        tuple(_entry(n, s, i, 5) for i, (n, s) in enumerate(zip("abcde", FRAGMENTING, strict=True))), _events(5)
    )
    r = replay(led)
    assert r.max_reserved_bytes == 60 * MiB and r.oom is None
    assert r.fits(60 * MiB) and not r.fits(56 * MiB)
    oom = r.oom_at(56 * MiB)
    assert (oom.event, oom.entry, oom.is_fragmentation) == (4, "e", True)
    assert r.rounded_peak_bytes == 39 * MiB  # what the bytes alone would need
    assert replay(led, EXPANDABLE).fits(56 * MiB)


def test_replay_oom_before_the_step():
    led = Ledger((_entry("w", 30),), _events(1))
    r = replay(led, capacity_bytes=20 * MiB)
    assert r.oom.event is None and r.peak is None


def test_replay_devices():
    entries = (_entry("g0", 12, 0, 1, "cuda:0"), _entry("c", 12, 0, 1, "cpu"), _entry("g1", 12, 0, 1, "cuda:1"))
    led = Ledger(entries, _events(1))
    with pytest.raises(InputError, match="span cuda:0, cuda:1"):
        replay(led)
    assert replay(led, device="cuda:1").max_reserved_bytes == 24 * MiB  # g1 and c (replayed as if on the GPU)
    assert replay(led, device="cuda", non_cuda="skip").max_reserved_bytes == 12 * MiB  # g0 only
    with pytest.raises(InputError, match="not a CUDA device"):
        replay(led, device="cpu")


def test_replay_streams():
    led = Ledger((_entry("a", 5, 0, 1), _entry("b", 5, 0, 1)), _events(1))
    assert replay(led).max_reserved_bytes == 20 * MiB
    assert replay(led, stream_of=lambda e: 0 if e.name == "a" else 1).max_reserved_bytes == 40 * MiB


def test_replay_of_an_analytic_7b_step_agrees_with_the_ledger():
    from trainledger.analytic import Setup, estimate

    config = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    }
    led = estimate(config, Setup(micro_batch=1, seq_len=4096)).ledger
    r = replay(led)
    assert r.num_entries == len(led.entries)  # all on cuda, none empty
    assert r.requested_peak_bytes == led.peak().bytes  # the ledger's own peak, taken at the same instant
    assert r.peak.requested_bytes == led.peak().bytes and r.peak.event == led.peak().event
    # rounding, whole blocks and cached segments only ever add
    assert led.peak().bytes <= r.rounded_peak_bytes <= r.max_allocated_bytes <= r.max_reserved_bytes
    assert r.peak.reserved_bytes == sum(s.size_bytes for s in r.peak.segments)
    assert r.max_reserved_bytes % (2 * MiB) == 0


# --- configuration ---------------------------------------------------------------------------------------


def test_alloc_conf_parsing():
    cfg = AllocatorConfig.from_alloc_conf(
        "expandable_segments:True, max_split_size_mb:256, roundup_power2_divisions:[64:8,128:2,>:1],"
        "pinned_use_cuda_host_register:True"
    )
    assert cfg.expandable_segments and cfg.max_split_size_bytes == 256 * MiB
    # first boundary 64 MiB (interval 6) covers the intervals below it too; '>' covers those above 128 MiB
    assert cfg.roundup_power2_divisions == (8,) * 7 + (2,) + (1,) * 8
    assert AllocatorConfig.from_alloc_conf("large_segment_size_mb:64").non_split_rounding_bytes == 64 * MiB


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_split_size_mb:10", "at least large_segment_size"),
        ("garbage_collection_threshold:0.6", "not modelled"),
        ("backend:cudaMallocAsync", "only the native"),
        ("expandable_segment:True", "unknown allocator option"),
        ("roundup_power2_divisions:3", "power of two"),
        ("large_segment_size_mb:8", "above 10 MiB"),
    ],
)
def test_alloc_conf_errors_say_what_is_accepted(text, message):
    with pytest.raises(InputError, match=message):
        AllocatorConfig.from_alloc_conf(text)
