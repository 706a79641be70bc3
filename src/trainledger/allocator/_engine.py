"""A step-by-step model of PyTorch's ``DeviceCachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``).

``CachingAllocatorModel`` keeps the allocator's real data structures in plain Python: blocks in a doubly
linked list per segment, and per pool (small/large) and stream a list of free blocks sorted by
``(size, address)`` searched with ``bisect`` (the ``std::set`` ordered by ``BlockComparatorSize``). Each
method names the C++ function it follows. Addresses are the model's own: segments are laid out one
after another, so ties between equal-sized blocks break by allocation order.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from trainledger.allocator._config import AllocatorConfig
from trainledger.allocator._results import BlockInfo, FailedRequest, SegmentInfo
from trainledger.allocator._sizes import MIN_BLOCK_SIZE, SMALL_BUFFER, SMALL_SIZE, allocation_size, is_small, round_size
from trainledger.errors import InputError

_BASE_ADDRESS = 1 << 40
_ALIGN = 2 << 20  # segments start on 2 MiB boundaries, like cudaMalloc's large allocations
_UNBOUNDED_VIRTUAL_BYTES = 1 << 44  # an expandable segment's address space when no capacity is given


class _Pool:
    """One ``BlockPool`` restricted to one stream: free mapped blocks and unmapped ranges."""

    __slots__ = ("free", "small", "stream", "unmapped")

    def __init__(self, small: bool, stream: int) -> None:
        self.small = small
        self.stream = stream
        self.free: list[tuple[int, int]] = []  # (size, address), sorted: BlockComparatorSize
        self.unmapped: list[int] = []  # addresses, sorted: BlockComparatorAddress


class _Segment:
    __slots__ = ("base", "expandable", "page", "pool", "size")

    def __init__(self, base: int, size: int, pool: _Pool, expandable: bool, page: int) -> None:
        self.base = base
        self.size = size  # bytes cudaMalloc'd, or an expandable segment's whole address space
        self.pool = pool
        self.expandable = expandable
        self.page = page  # mapping granularity of an expandable segment


class _Block:
    __slots__ = ("addr", "allocated", "label", "mapped", "next", "prev", "requested", "segment", "size")

    def __init__(self, addr: int, size: int, segment: _Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.segment = segment
        self.mapped = mapped
        self.allocated = False
        self.requested = 0
        self.label = ""
        self.prev: _Block | None = None
        self.next: _Block | None = None


class AllocatorOutOfMemory(RuntimeError):
    """The model's ``torch.OutOfMemoryError``: no cached block fits and no new segment fits the capacity."""

    def __init__(self, failed: FailedRequest) -> None:
        super().__init__(
            f"out of memory: tried to reserve {failed.segment_bytes} bytes for a request of "
            f"{failed.requested_bytes}; {failed.allocated_bytes} allocated, {failed.reserved_bytes} reserved "
            f"of {failed.capacity_bytes}"
        )
        self.failed = failed


class CachingAllocatorModel:
    """PyTorch's CUDA caching allocator for one device, replayed in Python.

    Arguments:
        config: allocator options (``PYTORCH_ALLOC_CONF``); PyTorch's defaults when omitted.
        capacity_bytes: bytes the allocator may reserve from the device; ``None``: unlimited. When a new
            segment would exceed it, the allocator frees cached segments and retries, as PyTorch does,
            before raising ``AllocatorOutOfMemory``.

    Example:
        >>> m = CachingAllocatorModel()
        >>> a = m.malloc(5 << 20)  # 5 MiB: a 20 MiB segment, split
        >>> b = m.malloc(12 << 20)  # best fit: the 15 MiB remainder, split again
        >>> c = m.malloc(16 << 20)  # no cached block is large enough: a 16 MiB segment of its own
        >>> m.reserved_bytes >> 20, m.allocated_bytes >> 20, m.largest_free_block_bytes() >> 20
        (36, 33, 3)
        >>> m.free(c); m.empty_cache() >> 20, m.reserved_bytes >> 20
        (16, 20)
    """

    def __init__(self, config: AllocatorConfig | None = None, *, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise InputError(f"capacity {capacity_bytes} bytes must be positive")
        self.config = config if config is not None else AllocatorConfig()
        self.capacity_bytes = capacity_bytes
        self._split_limit = self.config.max_split_size_bytes
        self._non_split_rounding = self.config.non_split_rounding_bytes
        self._expandable = self.config.expandable_segments
        self._pools: dict[tuple[bool, int], _Pool] = {}
        self._blocks: dict[int, _Block] = {}  # every block, allocated, free or unmapped, by address
        self._segments: dict[int, _Segment] = {}
        self._next_address = _BASE_ADDRESS
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.requested_bytes = 0
        self.max_reserved_bytes = 0
        self.max_allocated_bytes = 0
        self.num_cache_flushes = 0

    # --- public operations ----------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0, label: str = "") -> int:
        """Allocate ``nbytes`` on ``stream`` (``DeviceCachingAllocator::malloc``); returns the block's address."""
        if nbytes <= 0:
            raise ValueError(f"malloc of {nbytes} bytes: PyTorch allocates nothing for empty storages")
        size = round_size(nbytes, self.config.roundup_divisions_for(nbytes))
        pool = self._pool(is_small(size), stream)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size)
        if block is None:
            self.num_cache_flushes += 1
            self._release_cached_blocks()
            block = self._alloc_block(pool, size)
        if block is None:
            assert self.capacity_bytes is not None
            raise AllocatorOutOfMemory(
                FailedRequest(
                    requested_bytes=nbytes,
                    rounded_bytes=size,
                    segment_bytes=self._segment_bytes(pool, size),
                    pool="small" if pool.small else "large",
                    stream=stream,
                    allocated_bytes=self.allocated_bytes,
                    reserved_bytes=self.reserved_bytes,
                    capacity_bytes=self.capacity_bytes,
                )
            )
        return self._alloc_found_block(block, size, nbytes, label).addr

    def free(self, address: int) -> None:
        """Return a block to its pool, merging it with free neighbours (``free`` → ``free_block``)."""
        block = self._blocks.get(address)
        if block is None or not block.allocated:
            raise ValueError(f"no allocation at address {address:#x}")
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.requested, block.label = 0, ""
        for neighbour in (block.prev, block.next):
            self._try_merge_blocks(block, neighbour)
        insort(block.segment.pool.free, (block.size, block.addr))

    def empty_cache(self) -> int:
        """``torch.cuda.empty_cache()`` (``release_cached_blocks``): free every cached segment that holds no
        allocation (with expandable segments: unmap every whole free page); returns the bytes released."""
        before = self.reserved_bytes
        self._release_cached_blocks()
        return before - self.reserved_bytes

    # --- queries ----------------------------------------------------------------------------------------

    def largest_free_block_bytes(self) -> int:
        """The largest cached free block (``cacheInfo``), 0 if none."""
        return max((pool.free[-1][0] for pool in self._pools.values() if pool.free), default=0)

    def releasable_bytes(self) -> int:
        """What ``empty_cache()`` would release now, without releasing it."""
        total = 0
        for pool in self._pools.values():
            for size, addr in pool.free:
                block = self._blocks[addr]
                if block.segment.expandable:
                    total += self._whole_pages(block)[1]
                elif block.prev is None and block.next is None:
                    total += size
        return total

    def segments(self) -> tuple[SegmentInfo, ...]:
        """The segments, in address order, as ``torch.cuda.memory_snapshot()`` lists them (one per
        contiguous mapped range of an expandable segment)."""
        out: list[SegmentInfo] = []
        for base in sorted(self._segments):
            seg = self._segments[base]
            run: list[BlockInfo] = []
            block: _Block | None = self._blocks[base]
            while block is not None:
                if block.mapped:
                    run.append(BlockInfo(block.addr, block.size, block.allocated, block.requested, block.label))
                if run and (not block.mapped or block.next is None):
                    out.append(self._segment_info(seg, run))
                    run = []
                block = block.next
        return tuple(out)

    # --- DeviceCachingAllocator's private steps ---------------------------------------------------------

    def _pool(self, small: bool, stream: int) -> _Pool:
        key = (small, stream)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(small, stream)
        return pool

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """Best fit: the smallest cached block of at least ``size`` (``get_free_block``)."""
        free = pool.free
        i = bisect_left(free, (size, 0))
        if i == len(free):
            return None
        block = self._blocks[free[i][1]]
        if self._expandable:
            # A block that can grow into unmapped space counts as that large: prefer blocks that cannot.
            while i + 1 < len(free):
                nxt = self._blocks[free[i + 1][1]]
                if _expandable_size(nxt) >= _expandable_size(block):
                    break
                i, block = i + 1, nxt
        limit = self._split_limit
        if limit is not None:
            if size < limit <= block.size:
                return None  # an oversize block is never handed to a request below max_split_size
            if size >= limit and block.size >= size + self._non_split_rounding:
                return None  # an oversize request takes an oversize block only within the rounding slack
        del free[i]
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.segment.pool.small or self._expandable:
            return remaining >= MIN_BLOCK_SIZE
        limit = self._split_limit
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    def _alloc_found_block(self, block: _Block, size: int, nbytes: int, label: str) -> _Block:
        if self._should_split(block, size):
            rest = block
            block = _Block(rest.addr, size, rest.segment)
            block.prev, block.next = rest.prev, rest
            if block.prev is not None:
                block.prev.next = block
            rest.prev = block
            rest.addr += size
            rest.size -= size
            self._blocks[block.addr] = block
            self._blocks[rest.addr] = rest
            insort(rest.segment.pool.free, (rest.size, rest.addr))
        block.allocated = True
        block.requested = nbytes
        block.label = label
        self.allocated_bytes += block.size
        self.requested_bytes += nbytes
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        return block

    def _try_merge_blocks(self, dst: _Block, src: _Block | None) -> int:
        """Absorb a free neighbour into ``dst`` (``try_merge_blocks``); returns the bytes absorbed."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        pool = dst.segment.pool
        if src.mapped:
            _remove(pool.free, (src.size, src.addr))
        else:
            _remove(pool.unmapped, src.addr)
        if src is dst.prev:
            del self._blocks[dst.addr]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            del self._blocks[src.addr]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        self._blocks[dst.addr] = dst
        return src.size

    def _segment_bytes(self, pool: _Pool, size: int) -> int:
        if self._expandable:
            page = SMALL_BUFFER if pool.small else self.config.large_segment_size_bytes
            return -(-size // page) * page
        return allocation_size(size, self.config.large_segment_size_bytes)

    def _fits_capacity(self, nbytes: int) -> bool:
        return self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)

    def _new_segment(self, pool: _Pool, size: int, expandable: bool, page: int) -> _Segment:
        base = self._next_address
        self._next_address = -(-(base + size) // _ALIGN) * _ALIGN
        seg = self._segments[base] = _Segment(base, size, pool, expandable, page)
        return seg

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """A new segment for the request: ``cudaMalloc`` or, expandable, mapping more pages (``alloc_block``)."""
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        nbytes = allocation_size(size, self.config.large_segment_size_bytes)
        if not self._fits_capacity(nbytes):
            return None
        seg = self._new_segment(pool, nbytes, expandable=False, page=nbytes)
        block = self._blocks[seg.base] = _Block(seg.base, nbytes, seg)
        self._reserve(nbytes)
        return block

    def _release_block(self, block: _Block) -> int:
        """``cudaFree`` a cached segment that holds one free block (``release_block``)."""
        assert block.prev is None and block.next is None and not block.segment.expandable, "segment is split"
        _remove(block.segment.pool.free, (block.size, block.addr))
        del self._blocks[block.addr]
        del self._segments[block.addr]
        self.reserved_bytes -= block.size
        return block.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """With ``max_split_size``: free the smallest oversize cached block that covers the request, else
        the largest ones until their total does (``release_available_cached_blocks``)."""
        limit = self._split_limit
        if limit is None:
            return False
        key = max(size, limit)
        free = pool.free
        i = bisect_left(free, (key, 0))
        if i < len(free) and not self._blocks[free[i][1]].segment.expandable:
            self._release_block(self._blocks[free[i][1]])
            return True
        released, j = 0, i - 1
        while released < key and j >= 0 and free[j][0] >= limit:
            block = self._blocks[free[j][1]]
            j -= 1
            if not block.segment.expandable:
                released += self._release_block(block)
        return released >= key

    def _release_cached_blocks(self) -> None:
        """Free every cached segment that is one free block; unmap free pages of expandable segments
        (``release_cached_blocks`` → ``release_blocks``, large pool first, then small)."""
        for small in (False, True):
            for key in sorted(k for k in self._pools if k[0] == small):
                pool = self._pools[key]
                to_unmap = []
                for _, addr in list(pool.free):
                    block = self._blocks[addr]
                    if block.segment.expandable:
                        to_unmap.append(block)
                    elif block.prev is None and block.next is None:
                        self._release_block(block)
                for block in to_unmap:
                    self._unmap_block(block)
                    if block.prev is None and block.next is None and not block.mapped:
                        self._release_expandable_segment(block)

    # --- expandable segments ----------------------------------------------------------------------------

    def _virtual_bytes(self, page: int) -> int:
        # PyTorch reserves address space for 1 1/8 of the device's memory in each expandable segment.
        if self.capacity_bytes is None:
            return -(-_UNBOUNDED_VIRTUAL_BYTES // page) * page
        return -(-(self.capacity_bytes + self.capacity_bytes // 8) // page) * page

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """The lowest address where free and unmapped blocks together hold ``size``, in a new segment if
        none does (``find_expandable_block``)."""
        for addr in pool.unmapped:
            candidate = self._blocks[addr]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            room, block = 0, candidate
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return candidate
        page = SMALL_BUFFER if pool.small else self.config.large_segment_size_bytes
        nbytes = self._virtual_bytes(page)
        seg = self._new_segment(pool, nbytes, expandable=True, page=page)
        block = self._blocks[seg.base] = _Block(seg.base, nbytes, seg, mapped=False)
        insort(pool.unmapped, block.addr)
        return block

    def _map_block(self, block: _Block, size: int) -> bool:
        """Map whole pages covering the first ``size`` bytes of an unmapped block (``map_block``)."""
        seg = block.segment
        nbytes = -(-size // seg.page) * seg.page
        if not self._fits_capacity(nbytes):
            return False
        pool = seg.pool
        _remove(pool.unmapped, block.addr)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.addr + nbytes, block.size - nbytes, seg, mapped=False)
            rest.prev, rest.next = block, block.next
            if rest.next is not None:
                rest.next.prev = rest
            block.next = rest
            block.size = nbytes
            self._blocks[rest.addr] = rest
            insort(pool.unmapped, rest.addr)
        self._try_merge_blocks(block, block.prev)
        self._try_merge_blocks(block, block.next)
        insort(pool.free, (block.size, block.addr))
        self._reserve(nbytes)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next  # unmapped: a free neighbour would have merged
            if nxt is None or nxt.mapped or not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # it absorbed the previous candidate
        _remove(pool.free, (candidate.size, candidate.addr))
        return candidate

    def _whole_pages(self, block: _Block) -> tuple[int, int]:
        """Address and bytes of the whole pages inside a free block of an expandable segment."""
        seg = block.segment
        start = block.addr - seg.base
        first = -(-start // seg.page)
        last = (start + block.size) // seg.page
        if first >= last:
            return block.addr, 0
        return seg.base + first * seg.page, (last - first) * seg.page

    def _unmap_block(self, block: _Block) -> None:
        """Give back the whole free pages of a free block; the partial pages at its ends stay mapped as
        free blocks (``unmap_block``)."""
        lo, nbytes = self._whole_pages(block)
        if nbytes == 0:
            return
        seg, pool = block.segment, block.segment.pool
        _remove(pool.free, (block.size, block.addr))
        del self._blocks[block.addr]
        hi = lo + nbytes
        if lo > block.addr:  # prev? -> before -> block
            before = _Block(block.addr, lo - block.addr, seg)
            before.prev, before.next = block.prev, block
            if before.prev is not None:
                before.prev.next = before
            block.prev = before
            self._blocks[before.addr] = before
            insort(pool.free, (before.size, before.addr))
        if hi < block.addr + block.size:  # block -> after -> next?
            after = _Block(hi, block.addr + block.size - hi, seg)
            after.prev, after.next = block, block.next
            if after.next is not None:
                after.next.prev = after
            block.next = after
            self._blocks[after.addr] = after
            insort(pool.free, (after.size, after.addr))
        block.addr, block.size, block.mapped = lo, nbytes, False
        self._blocks[lo] = block
        self._try_merge_blocks(block, block.prev)
        self._try_merge_blocks(block, block.next)
        insort(pool.unmapped, block.addr)
        self.reserved_bytes -= nbytes

    def _release_expandable_segment(self, block: _Block) -> None:
        _remove(block.segment.pool.unmapped, block.addr)
        del self._blocks[block.addr]
        del self._segments[block.segment.base]

    @staticmethod
    def _segment_info(seg: _Segment, blocks: list[BlockInfo]) -> SegmentInfo:
        return SegmentInfo(
            address=blocks[0].address,
            size_bytes=sum(b.size_bytes for b in blocks),
            pool="small" if seg.pool.small else "large",
            stream=seg.pool.stream,
            expandable=seg.expandable,
            blocks=tuple(blocks),
        )


def _expandable_size(block: _Block) -> int:
    """A free block's size plus the unmapped space right after it, which it could grow into."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _remove(items: list, key: object) -> None:
    i = bisect_left(items, key)
    assert i < len(items) and items[i] == key, ("not in pool", key)
    del items[i]
