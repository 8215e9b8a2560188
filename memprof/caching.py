"""A pure-Python model of PyTorch's CUDA caching allocator.

It predicts what ``torch.cuda.memory_allocated()``, ``max_memory_allocated()``,
``memory_reserved()`` and ``max_memory_reserved()`` report for a sequence of
allocations and frees, without a GPU.

What is modelled is ``DeviceCachingAllocator`` of
``c10/cuda/CUDACachingAllocator.cpp`` in its default configuration
(``PYTORCH_CUDA_ALLOC_CONF`` unset: ``expandable_segments`` off,
``max_split_size`` unlimited, no ``roundup_power2_divisions``, no garbage
collection threshold), one device, one stream, no CUDA graphs:

* ``round_size``: a request becomes a multiple of 512 bytes (kMinBlockSize),
  at least 512.
* ``get_pool``: rounded sizes <= 1 MiB (kSmallSize) go to the small pool, the
  rest to the large pool; the pools never share blocks.
* ``get_free_block``: best fit, the smallest cached free block of the pool
  with ``block.size >= size``, ties broken by the lower address (the pool is a
  ``std::set`` ordered by (stream, size, ptr)).
* ``get_allocation_size``: with no fitting block a segment is cudaMalloc'ed:
  2 MiB (kSmallBuffer) for the small pool; 20 MiB (kLargeBuffer) for large
  requests < 10 MiB (kMinLargeAlloc); otherwise the request rounded up to a
  multiple of 2 MiB (kRoundLarge).
* ``should_split``: the found block is split when the remainder is >= 512
  bytes (small pool) or > 1 MiB (large pool); otherwise the whole block is
  handed out, and ``allocated_bytes`` (``memory_allocated``) grows by the whole
  block size (``alloc_found_block`` counts ``block->size``).
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free
  neighbours (prev, next) of the same segment and goes back to its pool; the
  statistic drops by the block's size before merging.
* ``release_cached_blocks`` (``empty_cache``): every free block that is a
  whole segment (no prev, no next) is cudaFree'd; split segments stay.
* ``malloc``: when a new segment does not fit (here: ``capacity``, the bytes
  the allocator may reserve), free the cached whole segments and retry once,
  then raise (:class:`SimulatedOOM`). The cache stays released after an OOM,
  as in PyTorch. ``release_available_cached_blocks`` does nothing unless
  ``max_split_size`` is configured, so it is not modelled.
* Stats: ``increase_stat`` raises the peak to the current value,
  ``resetPeakStats`` sets every peak to its current value.
* ``NativeCachingAllocator::allocate``: a 0-byte request allocates nothing.

Not modelled: other streams and ``record_stream`` (blocks are never held by
pending events), CUDA graph private pools, expandable segments,
``max_split_size_mb``, ``roundup_power2_divisions``, garbage collection, and
the real device's own limits (CUDA context, other processes, fragmentation of
device memory): ``capacity`` behaves like
``torch.cuda.set_per_process_memory_fraction``'s limit
(``total_allocated_memory + size > allowed_memory_maximum``). Addresses are
synthetic (each new segment above the previous ones), so among free blocks of
equal size the model may pick a different one than the device would.
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort

import torch

__all__ = [
    "CachingAllocatorModel",
    "SimulatedOOM",
    "round_size",
    "get_allocation_size",
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_LARGE_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
]

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2097152  # kRoundLarge: round up large allocations to 2 MiB

# Synthetic device addresses: segments are laid out from here upwards, each
# aligned like cudaMalloc's (at least 512 bytes; 2 MiB keeps them readable).
_BASE_ADDRESS = 0x7F0000000000
_SEGMENT_ALIGN = 2097152


def round_size(nbytes: int) -> int:
    """``DeviceCachingAllocator::round_size`` without roundup_power2_divisions."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int) -> int:
    """``DeviceCachingAllocator::get_allocation_size``: the segment to cudaMalloc
    for a rounded request that no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def _fmt(nbytes: int) -> str:
    """Sizes as PyTorch's OOM message writes them (format_size)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576:.2f} MiB"
    return f"{nbytes / 1073741824:.2f} GiB"


class SimulatedOOM(torch.OutOfMemoryError):
    """The model's ``torch.OutOfMemoryError``: a new segment did not fit in
    ``capacity`` even after the cached segments were released.

    A subclass of PyTorch's own error, with the opening words of its message
    ("CUDA out of memory. Tried to allocate ..."), so that a script's
    ``except torch.cuda.OutOfMemoryError`` (or a library's test of the
    message, e.g. to retry with a smaller batch) sees it as on the GPU."""

    def __init__(self, requested: int, alloc_size: int, reserved: int, allocated: int, capacity: int) -> None:
        self.requested = requested
        self.alloc_size = alloc_size
        self.reserved = reserved
        self.allocated = allocated
        self.capacity = capacity
        super().__init__(
            f"CUDA out of memory. Tried to allocate {_fmt(requested)} (simulated: requested {requested} bytes, "
            f"a {_fmt(alloc_size)} segment); capacity {_fmt(capacity)}, reserved {reserved} bytes ({_fmt(reserved)}), "
            f"allocated {allocated} bytes ({_fmt(allocated)}), "
            f"reserved but unallocated {_fmt(reserved - allocated)}"
        )

    def __reduce__(self):  # picklable (e.g. across processes) with its numbers
        return type(self), (self.requested, self.alloc_size, self.reserved, self.allocated, self.capacity)


class _Block:
    """A block of a segment: ``Block`` of the C++ source (ptr, size, prev, next,
    allocated), plus which pool and segment it belongs to."""

    __slots__ = ("addr", "size", "requested", "small", "allocated", "prev", "next", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: int) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.small = small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment  # base address of its segment

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"_Block(0x{self.addr:x}, {self.size}, {'small' if self.small else 'large'}, {state})"


class CachingAllocatorModel:
    """Counters of PyTorch's CUDA caching allocator, replayed in Python.

    ``malloc(nbytes)`` returns a handle for ``free(handle)``. The counters are
    plain attributes: ``allocated``, ``reserved``, ``peak_allocated``,
    ``peak_reserved`` (``memory_allocated``, ``memory_reserved`` and their
    ``max_`` variants), ``requested`` / ``peak_requested`` (bytes asked for,
    before rounding), ``num_device_alloc`` / ``num_device_free`` (cudaMalloc /
    cudaFree calls), ``num_alloc_retries`` and ``num_ooms``; ``num_segments``
    is a property.

    Each event costs O(log n) comparisons (plus a C-level list shift) in the
    number n of free blocks of a pool.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        # Free blocks of each pool, sorted by (size, address): BlockPool::blocks.
        self._free_small: list[tuple[int, int]] = []
        self._free_large: list[tuple[int, int]] = []
        # Every block by its address (free or allocated).
        self._blocks: dict[int, _Block] = {}
        # Free blocks that are a whole segment: what release_cached_blocks frees.
        self._whole_free: dict[int, _Block] = {}
        # Segment base address -> segment size.
        self._segments: dict[int, int] = {}
        # handle -> allocated block (None for 0-byte allocations).
        self._handles: dict[int, _Block | None] = {}
        self._next_handle = 1
        self._next_address = _BASE_ADDRESS

    def __deepcopy__(self, memo: dict) -> "CachingAllocatorModel":
        # The blocks of a segment form a linked list (thousands long in a
        # small-pool segment): copied link by link, copy.deepcopy would recurse
        # once per block and overflow Python's stack. Copy the blocks, then link.
        new = object.__new__(type(self))
        memo[id(self)] = new
        blocks = {a: copy.copy(b) for a, b in self._blocks.items()}
        for b in blocks.values():
            b.prev = b.prev and blocks[b.prev.addr]
            b.next = b.next and blocks[b.next.addr]
        new.__dict__.update(self.__dict__)
        new._blocks = blocks
        new._whole_free = {s: blocks[b.addr] for s, b in self._whole_free.items()}
        new._handles = {h: b and blocks[b.addr] for h, b in self._handles.items()}
        new._free_small, new._free_large = list(self._free_small), list(self._free_large)
        new._segments = dict(self._segments)
        return new

    # ------------------------------------------------------------------ API

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    @property
    def num_live(self) -> int:
        """Live handles (including 0-byte ones)."""
        return len(self._handles)

    @property
    def cached(self) -> int:
        """Reserved but not allocated bytes."""
        return self.reserved - self.allocated

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`.

        Raises :class:`SimulatedOOM` when ``capacity`` is set and a needed new
        segment does not fit even after releasing the cached segments."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        handle = self._next_handle
        self._next_handle = handle + 1
        if nbytes == 0:
            # NativeCachingAllocator::allocate: `if (size != 0) malloc(...)`.
            self._handles[handle] = None
            return handle

        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE  # get_pool
        pool = self._free_small if small else self._free_large

        # get_free_block: lower_bound on (size, nullptr) -> best fit, lowest address.
        i = bisect_left(pool, (size,))
        if i < len(pool):
            addr = pool.pop(i)[1]
            block = self._blocks[addr]
            if block.prev is None and block.next is None:
                del self._whole_free[addr]
        else:
            block = self._alloc_segment(nbytes, size, small)

        # should_split + alloc_found_block
        remaining = block.size - size
        split = remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE
        if split:
            rest = _Block(block.addr + size, remaining, small, block.segment)
            rest.prev = block
            rest.next = block.next
            if rest.next is not None:
                rest.next.prev = rest
            block.next = rest
            block.size = size
            self._blocks[rest.addr] = rest
            insort(pool, (remaining, rest.addr))

        block.allocated = True
        block.requested = nbytes
        self._handles[handle] = block

        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self.requested += nbytes
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return handle

    def free(self, handle: int) -> None:
        """Free an allocation made by :meth:`malloc`."""
        try:
            block = self._handles.pop(handle)
        except KeyError:
            raise KeyError(f"unknown or already freed handle {handle!r}") from None
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size  # before merging: decrease_stat(allocated_bytes, block->size)
        self.requested -= block.requested
        block.requested = 0
        pool = self._free_small if block.small else self._free_large
        blocks = self._blocks

        # free_block: try_merge_blocks with prev, then next.
        prev = block.prev
        if prev is not None and not prev.allocated:
            del pool[bisect_left(pool, (prev.size, prev.addr))]
            del blocks[block.addr]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
            blocks[block.addr] = block
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            del pool[bisect_left(pool, (nxt.size, nxt.addr))]
            del blocks[nxt.addr]
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block

        insort(pool, (block.size, block.addr))
        if block.prev is None and block.next is None:
            self._whole_free[block.addr] = block

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached free segment."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: peaks = current values."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_requested = self.requested

    def size_of(self, handle: int) -> int:
        """Bytes the allocation counts in ``allocated`` (0 for 0-byte ones)."""
        block = self._handles[handle]
        return 0 if block is None else block.size

    def address_of(self, handle: int) -> int | None:
        """Synthetic device address of an allocation (None for 0-byte ones)."""
        block = self._handles[handle]
        return None if block is None else block.addr

    def stats(self) -> dict[str, int]:
        return {
            "allocated": self.allocated,
            "reserved": self.reserved,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "requested": self.requested,
            "peak_requested": self.peak_requested,
            "segments": self.num_segments,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }

    def layout(self) -> tuple:
        """The allocator's state up to handle names: live blocks (address,
        size) in the order they were allocated, segments and free blocks. Two
        equal layouts answer the same sequence of mallocs and frees (the i-th
        oldest live block freed where it was the i-th oldest) the same way."""
        live = tuple((b.addr, b.size) for b in self._handles.values() if b is not None)
        return live, tuple(sorted(self._segments.items())), tuple(self._free_small), tuple(self._free_large)

    def snapshot(self) -> list[dict]:
        """Segments sorted by address, in the shape of
        ``torch.cuda.memory_snapshot()['segments']`` (fewer keys): address,
        total_size, segment_type ('small'/'large'), allocated_size,
        requested_size, blocks (address, size, requested_size, state
        'active_allocated' or 'inactive')."""
        out = []
        for base in sorted(self._segments):
            block = self._blocks[base]
            seg_blocks = []
            allocated = requested = 0
            while block is not None:
                seg_blocks.append(
                    {
                        "address": block.addr,
                        "size": block.size,
                        "requested_size": block.requested,
                        "state": "active_allocated" if block.allocated else "inactive",
                    }
                )
                if block.allocated:
                    allocated += block.size
                    requested += block.requested
                block = block.next
            out.append(
                {
                    "address": base,
                    "total_size": self._segments[base],
                    "segment_type": "small" if self._blocks[base].small else "large",
                    "allocated_size": allocated,
                    "requested_size": requested,
                    "blocks": seg_blocks,
                }
            )
        return out

    def check_invariants(self) -> None:
        """Assert the model's internal consistency (for tests; O(blocks))."""
        seg_total = 0
        alloc_total = 0
        free_small: list[tuple[int, int]] = []
        free_large: list[tuple[int, int]] = []
        seen = 0
        for base, seg_size in self._segments.items():
            seg_total += seg_size
            head = self._blocks.get(base)
            assert head is not None and head.prev is None, f"segment 0x{base:x} has no head block"
            addr = base
            block: _Block | None = head
            prev = None
            while block is not None:
                seen += 1
                assert block.addr == addr, f"gap or overlap at 0x{addr:x}"
                assert block.segment == base and block.small == head.small
                assert block.prev is prev
                assert self._blocks.get(block.addr) is block
                assert block.size > 0 and block.size % K_MIN_BLOCK_SIZE == 0
                if block.allocated:
                    alloc_total += block.size
                else:
                    assert prev is None or prev.allocated, "two adjacent free blocks"
                    (free_small if block.small else free_large).append((block.size, block.addr))
                    whole = block.prev is None and block.next is None
                    assert (self._whole_free.get(block.addr) is block) == whole
                addr += block.size
                prev = block
                block = block.next
            assert addr == base + seg_size, f"segment 0x{base:x} blocks do not tile it"
        assert seen == len(self._blocks), "blocks outside any segment"
        assert seg_total == self.reserved, (seg_total, self.reserved)
        assert alloc_total == self.allocated, (alloc_total, self.allocated)
        assert self._free_small == sorted(free_small), "small pool out of sync"
        assert self._free_large == sorted(free_large), "large pool out of sync"
        assert len(self._whole_free) == sum(1 for b in self._whole_free.values() if not b.allocated)
        live = sum(b.size for b in self._handles.values() if b is not None)
        assert live == self.allocated
        assert self.allocated <= self.reserved
        assert self.peak_allocated >= self.allocated and self.peak_reserved >= self.reserved
        if self.capacity is not None:
            assert self.reserved <= self.capacity

    # ------------------------------------------------------------ internals

    def _alloc_segment(self, nbytes: int, size: int, small: bool) -> _Block:
        """``alloc_block``, with malloc's retry after ``release_cached_blocks``."""
        alloc_size = get_allocation_size(size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            # release_available_cached_blocks is a no-op without max_split_size;
            # release_cached_blocks frees every whole cached segment, then retry.
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            if self.reserved + alloc_size > self.capacity:
                self.num_ooms += 1
                raise SimulatedOOM(nbytes, alloc_size, self.reserved, self.allocated, self.capacity)
        base = self._next_address
        self._next_address = base + -(-alloc_size // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
        block = _Block(base, alloc_size, small, base)
        self._blocks[base] = block
        self._segments[base] = alloc_size
        self.reserved += alloc_size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self.num_device_alloc += 1
        return block

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: cudaFree every free block with no prev
        and no next (a whole segment); split segments are kept."""
        for addr, block in self._whole_free.items():
            pool = self._free_small if block.small else self._free_large
            del pool[bisect_left(pool, (block.size, addr))]
            del self._blocks[addr]
            del self._segments[addr]
            self.reserved -= block.size
            self.num_device_free += 1
        self._whole_free.clear()
