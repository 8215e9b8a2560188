"""A pure-Python model of PyTorch's CUDA caching allocator.

It predicts what ``torch.cuda.memory_allocated()``, ``max_memory_allocated()``,
``memory_reserved()`` and ``max_memory_reserved()`` report for a sequence of
allocations and frees, without a GPU.

What is modelled is ``DeviceCachingAllocator`` of
``c10/cuda/CUDACachingAllocator.cpp`` with ``max_split_size`` unlimited (or as
``max_split_size_mb`` sets it: :attr:`CachingAllocatorModel.max_split_size`), no
``roundup_power2_divisions`` and no garbage collection threshold (their
defaults), ``expandable_segments`` off or on, one device, any streams, no CUDA
graphs. By default:

* ``round_size``: a request becomes a multiple of 512 bytes (kMinBlockSize),
  at least 512.
* ``get_pool``: rounded sizes <= 1 MiB (kSmallSize) go to the small pool, the
  rest to the large pool; the pools never share blocks.
* ``get_free_block``: best fit, the smallest cached free block of the pool
  with ``block.size >= size`` made for the requesting stream, ties broken by
  the lower address (the pool is a ``std::set`` ordered by (stream, size,
  ptr)). A segment is made for one stream and its blocks serve that stream
  only (``malloc``'s ``stream``: an id, 0 the default stream).
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
  as in PyTorch. With ``max_split_size``, ``release_available_cached_blocks``
  first frees cached oversize segments (the smallest that holds the request,
  else the largest ones down) and retries before that.
* ``max_split_size`` (``max_split_size_mb``): a block of that size or more is
  never split, serves no smaller request and serves a larger one only where it
  is less than ``max_non_split_rounding`` (20 MiB) larger.
* Stats: ``increase_stat`` raises the peak to the current value,
  ``resetPeakStats`` sets every peak to its current value.
* ``NativeCachingAllocator::allocate``: a 0-byte request allocates nothing.

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
Note [Expandable Segments] in the same file), each pool has one segment whose
address space is reserved up front and mapped to physical memory a page at a
time: 2 MiB pages (kSmallBuffer) for the small pool, 20 MiB (kLargeBuffer) for
the large one. ``memory_reserved`` counts the mapped pages only.

* ``get_free_block``: best fit as above, but a free block at the mapped end of
  a segment counts as large as it could grow (its size plus the unmapped space
  after it), so a larger free block inside a segment is taken before it.
* ``try_allocate_expandable_block``: with no fitting block, the lowest address
  of a segment where free and unmapped blocks in a row make room
  (``find_expandable_block``; a segment is made for the pool on its first
  such request) has the pages it lacks mapped (``map_block``), and the mapped
  block merges with its free neighbours. A map that the device's memory
  cannot hold fails as a whole (``ExpandableSegment::map``).
* ``should_split``: any remainder of at least 512 bytes is split off, in the
  large pool too.
* ``release_cached_blocks``: every whole page of a free block is unmapped
  (``unmap_block``); a segment left with nothing mapped is released. Nothing
  is unmapped on ``free``.
* Stats: a mapped page counts in ``reserved_bytes`` and ``num_device_alloc``;
  ``segment.all.current`` counts no expandable segment (``map_block`` does not
  touch it), nor does :attr:`CachingAllocatorModel.num_segments`.

A block freed while another stream uses it (``record_stream``) is held
(:meth:`CachingAllocatorModel.hold`: out of the allocated counters, not yet
back in its pool) until freed; when that stream is done is for the caller to
say (:class:`memprof.simulate.SimulatedAllocator`, with its clocks). Not
modelled: CUDA graph private pools (the simulated device gives a capture a
stream of its own instead),
``roundup_power2_divisions``, garbage collection (``garbage_collection_threshold``,
which acts only under ``set_per_process_memory_fraction``), and the real device's own
limits (CUDA context, other processes, fragmentation of device memory):
``capacity`` is the memory the device can give (``cudaMalloc`` failing; with
expandable segments, ``cuMemCreate``). ``limit`` is
``torch.cuda.set_per_process_memory_fraction``'s: ``alloc_block`` fails where
``total_allocated_memory + get_allocation_size(size) > allowed_memory_maximum``,
before making or mapping anything, and malloc retries after releasing the cache
as for any failure. Addresses are synthetic (each new segment
above the previous ones; an expandable segment reserves
:data:`EXPANDABLE_ADDRESS_SPACE`), so among free blocks of equal size the model
may pick a different one than the device would.
"""

from __future__ import annotations

import copy
import os
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
    "EXPANDABLE_ADDRESS_SPACE",
    "UNMODELLED",
    "allocator_settings",
    "expandable_segments_configured",
    "expandable_segments_setting",
    "max_split_settings",
    "unmodelled_settings",
]

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2097152  # kRoundLarge: round up large allocations to 2 MiB

# The address space an expandable segment reserves: PyTorch reserves 1 1/8 of the
# device's memory, pages it can map; any space larger than the largest GPU's
# answers the same (the unmapped tail is larger than any hole before it).
EXPANDABLE_ADDRESS_SPACE = 1 << 40

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


def allocator_settings(environ=None) -> tuple[str, str]:
    """The allocator settings PyTorch reads at CUDA's initialisation, and the variable they came from:
    ``PYTORCH_CUDA_ALLOC_CONF``, else the newer, device-neutral ``PYTORCH_ALLOC_CONF``
    (``CUDAAllocatorConfig::instance``); ``("", "")`` where neither is set."""
    environ = os.environ if environ is None else environ
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in environ:
            return environ[name], name
    return "", ""


def expandable_segments_configured(environ=None) -> bool:
    """Whether PyTorch's allocator would run with ``expandable_segments``, from the environment
    (:func:`allocator_settings`)."""
    return bool(expandable_segments_setting(*allocator_settings(environ)))


def expandable_segments_setting(settings: str, name: str = "allocator settings") -> bool | None:
    """``expandable_segments`` in an allocator settings string (``"max_split_size_mb:128,expandable_segments:True"``),
    None where it is not set. As ``AllocatorConfig::parseArgs`` (c10/core/AllocatorConfig.cpp) reads it: spaces
    are ignored, the last setting wins, and a value other than ``True`` or ``False`` raises ``RuntimeError``."""
    expandable = None
    for key, value in _items(settings):
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise RuntimeError(
                    f"{name}={settings!r}: expected a single True/False argument for expandable_segments, "
                    f"got {value!r} (PyTorch's own error at CUDA's initialisation); write expandable_segments:True")
            expandable = value == "True"
    return expandable


def max_split_settings(settings: str, name: str = "allocator settings") -> tuple[int | None, int | None]:
    """``max_split_size_mb`` and ``max_non_split_rounding_mb`` of an allocator settings string, in bytes
    (None where not set), as ``AcceleratorAllocatorConfig`` parses them: the last setting wins and a
    ``max_split_size_mb`` below 20 (kLargeBuffer) raises ``RuntimeError``."""
    split = rounding = None
    for key, value in _items(settings):
        if key == "max_split_size_mb":
            if int(value) < K_LARGE_BUFFER // 1048576:
                raise RuntimeError(f"{name}={settings!r}: CachingAllocator option max_split_size_mb too small, "
                                   f"must be >= {K_LARGE_BUFFER // 1048576} (PyTorch's own error at CUDA's initialisation)")
            split = int(value) * 1048576
        elif key == "max_non_split_rounding_mb":
            rounding = int(value) * 1048576
    return split, rounding


#: Settings that change what the device allocator reserves, which the model does not follow.
#: (``garbage_collection_threshold`` acts only where ``torch.cuda.set_per_process_memory_fraction``
#: set a limit: ``malloc`` calls ``garbage_collect_cached_blocks`` under ``set_fraction`` alone.)
UNMODELLED = ("roundup_power2_divisions", "garbage_collection_threshold")


def unmodelled_settings(settings: str) -> list[str]:
    """The settings in ``settings`` that change what PyTorch's device allocator reserves and that this model
    does not follow (:data:`UNMODELLED`, and a backend other than the native one), as written."""
    return [f"{key}:{value}" for key, value in _items(settings)
            if key in UNMODELLED or key == "backend" and value != "native"]


def _items(settings: str) -> list[tuple[str, str]]:
    """``key:value`` items of a settings string, spaces left out (a bracketed list stays one value)."""
    items, depth, item = [], 0, ""
    for ch in settings.replace(" ", ""):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    return [tuple(i.partition(":")[::2]) for i in items if i]


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
    allocated, mapped), plus which pool and segment it belongs to and whether
    that segment is expandable."""

    __slots__ = ("addr", "size", "requested", "small", "allocated", "prev", "next", "segment", "mapped",
                 "expandable", "stream", "held")

    def __init__(self, addr: int, size: int, small: bool, segment: int, stream: int = 0) -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.small = small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment  # base address of its segment
        self.mapped = True  # backed by physical pages: False only for an expandable segment's unmapped space
        self.expandable = False
        self.stream = stream  # the stream its segment was made for: its blocks serve that stream only
        self.held = False  # freed, but not back in its pool until another stream is done with it (hold)

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"_Block(0x{self.addr:x}, {self.size}, {'small' if self.small else 'large'}, {state})"


class CachingAllocatorModel:
    """Counters of PyTorch's CUDA caching allocator, replayed in Python.

    ``malloc(nbytes)`` returns a handle for ``free(handle)``. The counters are
    plain attributes: ``allocated``, ``reserved``, ``peak_allocated``,
    ``peak_reserved`` (``memory_allocated``, ``memory_reserved`` and their
    ``max_`` variants), ``requested`` / ``peak_requested`` (bytes asked for,
    before rounding), ``num_device_alloc`` / ``num_device_free`` (cudaMalloc /
    cudaFree calls, or pages mapped / unmapped), ``num_alloc_retries`` and
    ``num_ooms``; ``num_segments`` is a property. ``expandable_segments`` may be
    switched at any time, as ``torch.cuda.memory._set_allocator_settings``
    does: blocks of segments made before keep their kind.

    Each event costs O(log n) comparisons (plus a C-level list shift) in the
    number n of free blocks of a pool.
    """

    def __init__(self, capacity: int | None = None, expandable_segments: bool = False) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        #: ``torch.cuda.set_per_process_memory_fraction``'s ``allowed_memory_maximum`` (bytes), or None.
        self.limit: int | None = None
        self.expandable_segments = expandable_segments
        #: ``max_split_size_mb`` in bytes (None: unlimited, PyTorch's default): blocks of this size or more are
        #: not split, serve no smaller request and serve a larger one only within ``max_non_split_rounding``.
        self.max_split_size: int | None = None
        #: ``max_non_split_rounding_mb`` in bytes (kLargeBuffer by default).
        self.max_non_split_rounding: int = K_LARGE_BUFFER
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
        # Free mapped blocks of each pool, sorted by (stream, size, address): BlockPool::blocks.
        self._free_small: list[tuple[int, int, int]] = []
        self._free_large: list[tuple[int, int, int]] = []
        # Unmapped blocks of each pool's expandable segments, by address: BlockPool::unmapped.
        self._unmapped_small: list[int] = []
        self._unmapped_large: list[int] = []
        # Every block by its address (free, allocated or unmapped).
        self._blocks: dict[int, _Block] = {}
        # Free blocks that are a whole segment: what release_cached_blocks frees.
        self._whole_free: dict[int, _Block] = {}
        # Segment base address -> segment size (cudaMalloc'ed segments).
        self._segments: dict[int, int] = {}
        # Expandable segment base address -> its address space.
        self._expandable: dict[int, int] = {}
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
        new._unmapped_small, new._unmapped_large = list(self._unmapped_small), list(self._unmapped_large)
        new._segments = dict(self._segments)
        new._expandable = dict(self._expandable)
        return new

    # ------------------------------------------------------------------ API

    @property
    def num_segments(self) -> int:
        """cudaMalloc'ed segments (``segment.all.current``), expandable ones not counted."""
        return len(self._segments)

    @property
    def num_live(self) -> int:
        """Live handles (including 0-byte ones)."""
        return len(self._handles)

    @property
    def cached(self) -> int:
        """Reserved but not allocated bytes."""
        return self.reserved - self.allocated

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` for ``stream`` (an id: 0 the default stream); returns a handle for :meth:`free`.

        Raises :class:`SimulatedOOM` when ``capacity`` is set and a needed new
        segment (or page) does not fit even after releasing the cached ones."""
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
        i = bisect_left(pool, (stream, size))
        if i < len(pool) and pool[i][0] == stream:
            block = self._blocks[pool[i][2]]
            if block.expandable:
                block = self._expandable_fit(pool, i, size)
            elif self.max_split_size is not None and self._oversize_refused(block.size, size):
                block = None
            else:
                del pool[i]
                if block.prev is None and block.next is None:
                    del self._whole_free[block.addr]
        else:
            block = None
        if block is None:
            block = self._alloc_block(nbytes, size, small, stream)

        # should_split + alloc_found_block
        remaining = block.size - size
        split = (remaining >= K_MIN_BLOCK_SIZE if small or self.expandable_segments
                 else remaining > K_SMALL_SIZE and (self.max_split_size is None or size < self.max_split_size))
        if split:
            rest = _Block(block.addr + size, remaining, small, block.segment, block.stream)
            rest.expandable = block.expandable  # and its stream: a block never changes stream
            rest.prev = block
            rest.next = block.next
            if rest.next is not None:
                rest.next.prev = rest
            block.next = rest
            block.size = size
            self._blocks[rest.addr] = rest
            insort(pool, _key(rest))

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

    def hold(self, handle: int) -> None:
        """``free`` of a block another stream used (``record_stream``): the allocated counters drop now,
        as c10's ``free`` drops them before ``insert_events``, but the block goes back to its pool only
        at :meth:`free` of the same handle (``process_events``, once that stream is done with it)."""
        block = self._handles[handle]
        if block is not None and not block.held:
            block.held = True
            self.allocated -= block.size
            self.requested -= block.requested

    def free(self, handle: int) -> None:
        """Free an allocation made by :meth:`malloc` (or held: :meth:`hold`)."""
        try:
            block = self._handles.pop(handle)
        except KeyError:
            raise KeyError(f"unknown or already freed handle {handle!r}") from None
        if block is None:
            return
        block.allocated = False
        if block.held:  # counted out at hold()
            block.held = False
        else:
            self.allocated -= block.size  # before merging: decrease_stat(allocated_bytes, block->size)
            self.requested -= block.requested
        block.requested = 0
        pool = self._free_small if block.small else self._free_large
        blocks = self._blocks

        # free_block: try_merge_blocks with prev, then next (free and mapped alike).
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            del pool[bisect_left(pool, _key(prev))]
            del blocks[block.addr]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
            blocks[block.addr] = block
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            del pool[bisect_left(pool, _key(nxt))]
            del blocks[nxt.addr]
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block

        insort(pool, _key(block))
        if block.prev is None and block.next is None and not block.expandable:
            self._whole_free[block.addr] = block

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached free segment and unmap every free page."""
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

    def stream_of(self, handle: int) -> int | None:
        """The stream the allocation was made for (None for 0-byte ones)."""
        block = self._handles[handle]
        return None if block is None else block.stream

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
        size) in the order they were allocated, segments, free and unmapped
        blocks and the setting. Two equal layouts answer the same sequence of
        mallocs and frees (the i-th oldest live block freed where it was the
        i-th oldest) the same way."""
        live = tuple((b.addr, b.size) for b in self._handles.values() if b is not None)
        return (live, tuple(sorted(self._segments.items())), tuple(self._free_small), tuple(self._free_large),
                tuple(sorted(self._expandable.items())), tuple(self._unmapped_small), tuple(self._unmapped_large),
                self.expandable_segments, self.max_split_size, self.max_non_split_rounding)

    def snapshot(self) -> list[dict]:
        """Segments sorted by address, in the shape of
        ``torch.cuda.memory_snapshot()['segments']`` (fewer keys): address,
        total_size, segment_type ('small'/'large'), is_expandable,
        allocated_size, requested_size, blocks (address, size, requested_size,
        state 'active_allocated' or 'inactive'). As PyTorch's, an expandable
        segment shows as one segment per run of mapped blocks."""
        out = []
        for base in sorted([*self._segments, *self._expandable]):
            block = self._blocks[base]
            while block is not None:
                if not block.mapped:
                    block = block.next
                    continue
                head, seg_blocks, allocated, requested = block, [], 0, 0
                while block is not None and block.mapped:
                    state = ("active_pending_free" if block.held else "active_allocated" if block.allocated
                             else "inactive")
                    seg_blocks.append({"address": block.addr, "size": block.size, "requested_size": block.requested,
                                       "state": state})
                    if block.allocated and not block.held:
                        allocated += block.size
                        requested += block.requested
                    block = block.next
                out.append({
                    "address": head.addr,
                    "total_size": sum(b["size"] for b in seg_blocks),
                    "segment_type": "small" if head.small else "large",
                    "is_expandable": head.expandable,
                    "stream": head.stream,
                    "allocated_size": allocated,
                    "requested_size": requested,
                    "blocks": seg_blocks,
                })
        return out

    def check_invariants(self) -> None:
        """Assert the model's internal consistency (for tests; O(blocks))."""
        mapped_total = 0
        alloc_total = 0
        free_small: list[tuple[int, int, int]] = []
        free_large: list[tuple[int, int, int]] = []
        unmapped_small: list[int] = []
        unmapped_large: list[int] = []
        seen = 0
        assert not set(self._segments) & set(self._expandable)
        for base, seg_size in [*self._segments.items(), *self._expandable.items()]:
            expandable = base in self._expandable
            page = (K_SMALL_BUFFER if self._blocks[base].small else K_LARGE_BUFFER) if expandable else 1
            head = self._blocks.get(base)
            assert head is not None and head.prev is None, f"segment 0x{base:x} has no head block"
            addr = base
            block: _Block | None = head
            prev = None
            while block is not None:
                seen += 1
                assert block.addr == addr, f"gap or overlap at 0x{addr:x}"
                assert block.segment == base and block.small == head.small and block.expandable == expandable
                assert block.stream == head.stream
                assert block.prev is prev
                assert self._blocks.get(block.addr) is block
                assert block.size > 0 and block.size % K_MIN_BLOCK_SIZE == 0
                if block.allocated:
                    assert block.mapped
                    alloc_total += 0 if block.held else block.size
                elif block.mapped:
                    assert prev is None or prev.allocated or not prev.mapped, "two adjacent free blocks"
                    (free_small if block.small else free_large).append(_key(block))
                    whole = block.prev is None and block.next is None
                    assert (self._whole_free.get(block.addr) is block) == (whole and not expandable)
                else:
                    assert expandable and (prev is None or prev.mapped), "two adjacent unmapped blocks"
                    assert (block.addr - base) % page == 0 and block.size % page == 0, "unmapped block off the pages"
                    (unmapped_small if block.small else unmapped_large).append(block.addr)
                if block.mapped:
                    mapped_total += block.size
                addr += block.size
                prev = block
                block = block.next
            assert addr == base + seg_size, f"segment 0x{base:x} blocks do not tile it"
        assert seen == len(self._blocks), "blocks outside any segment"
        assert mapped_total == self.reserved, (mapped_total, self.reserved)
        assert alloc_total == self.allocated, (alloc_total, self.allocated)
        assert self._free_small == sorted(free_small), "small pool out of sync"
        assert self._free_large == sorted(free_large), "large pool out of sync"
        assert self._unmapped_small == sorted(unmapped_small) and self._unmapped_large == sorted(unmapped_large)
        assert len(self._whole_free) == sum(1 for b in self._whole_free.values() if not b.allocated)
        live = sum(b.size for b in self._handles.values() if b is not None and not b.held)
        assert live == self.allocated
        assert self.allocated <= self.reserved
        assert self.peak_allocated >= self.allocated and self.peak_reserved >= self.reserved
        if self.capacity is not None:
            assert self.reserved <= self.capacity

    # ------------------------------------------------------------ internals

    def _oversize_refused(self, block_size: int, size: int) -> bool:
        """``get_free_block``'s checks with ``max_split_size``: an oversize block serves no smaller request,
        and a larger request only within ``max_non_split_rounding`` of its size."""
        limit = self.max_split_size
        if limit is None:
            return False
        if size < limit:
            return block_size >= limit
        return block_size >= size + self.max_non_split_rounding

    def _expandable_fit(self, pool: list[tuple[int, int, int]], i: int, size: int = 0) -> _Block | None:
        """``get_free_block`` where the best fit, ``pool[i]``, is a block of an expandable segment."""
        blocks = self._blocks
        block = blocks[pool[i][2]]
        if self.expandable_segments:
            # A block at the mapped end of a segment counts as the size it can grow to.
            while block.expandable and i + 1 < len(pool) and pool[i + 1][0] == block.stream:
                nxt = blocks[pool[i + 1][2]]
                if _growable(nxt) >= _growable(block):
                    break
                i, block = i + 1, nxt
        else:  # switched off since: only cudaMalloc'ed blocks are handed out
            while block.expandable:
                i += 1
                if i == len(pool) or pool[i][0] != block.stream:
                    return None
                block = blocks[pool[i][2]]
        if self._oversize_refused(block.size, size):
            return None
        del pool[i]
        if block.prev is None and block.next is None and not block.expandable:
            del self._whole_free[block.addr]
        return block

    def _alloc_block(self, nbytes: int, size: int, small: bool, stream: int) -> _Block:
        """``alloc_block``, with malloc's retry after ``release_cached_blocks``."""
        block = self._try_alloc(size, small, stream)
        if block is None and self._release_available_cached_blocks(size, small, stream):
            block = self._try_alloc(size, small, stream)
        if block is None:
            # release_cached_blocks frees every whole cached segment and free page, then retry.
            self._release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._try_alloc(size, small, stream)
            if block is None:
                self.num_ooms += 1
                bound = min(b for b in (self.capacity, self.limit) if b is not None)
                raise SimulatedOOM(nbytes, get_allocation_size(size), self.reserved, self.allocated, bound)
        return block

    def _release_available_cached_blocks(self, size: int, small: bool, stream: int) -> bool:
        """``release_available_cached_blocks`` (a no-op without ``max_split_size``): cudaFree the smallest
        cached oversize block of ``stream`` that holds ``size`` (at least ``max_split_size``), else the
        largest ones down until as much is freed; whether enough was."""
        limit = self.max_split_size
        if limit is None:
            return False
        pool = self._free_small if small else self._free_large
        want = max(size, limit)
        i = bisect_left(pool, (stream, want))
        if i < len(pool) and pool[i][0] == stream and not self._blocks[pool[i][2]].expandable:
            return self._release_block(pool, i)
        released = 0
        i -= 1
        while released < want and i >= 0 and pool[i][0] == stream and pool[i][1] >= limit:
            if not self._blocks[pool[i][2]].expandable:
                released += pool[i][1]
                self._release_block(pool, i)
            i -= 1
        return released >= want

    def _release_block(self, pool: list[tuple[int, int, int]], i: int) -> bool:
        """``release_block`` of the free block ``pool[i]``, a whole segment (an oversize block is never split)."""
        block = self._blocks[pool[i][2]]
        if block.prev is not None or block.next is not None:
            return False
        del pool[i]
        self._whole_free.pop(block.addr, None)
        self._free_segment(block)
        return True

    def _free_segment(self, block: _Block) -> None:
        """cudaFree of a whole free segment, out of its pool already."""
        del self._blocks[block.addr]
        del self._segments[block.addr]
        self.reserved -= block.size
        self.num_device_free += 1

    def _try_alloc(self, size: int, small: bool, stream: int) -> _Block | None:
        """A new segment (cudaMalloc), or with expandable segments the pages a block lacks; None where the
        device's memory cannot hold it, or the process's memory fraction does not allow it."""
        alloc_size = get_allocation_size(size)
        if self.limit is not None and self.reserved + alloc_size > self.limit:
            return None  # alloc_block's set_fraction check, before any segment is made or mapped
        if self.expandable_segments:
            return self._try_allocate_expandable_block(size, small, stream)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        base = self._new_address(alloc_size)
        block = _Block(base, alloc_size, small, base, stream)
        self._blocks[base] = block
        self._segments[base] = alloc_size
        self._reserve(alloc_size)
        return block

    def _new_address(self, nbytes: int) -> int:
        base = self._next_address
        self._next_address = base + -(-nbytes // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
        return base

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self.num_device_alloc += 1

    def _try_allocate_expandable_block(self, size: int, small: bool, stream: int) -> _Block | None:
        """``try_allocate_expandable_block``: map what the lowest room for ``size`` lacks."""
        candidate = self._find_expandable_block(size, small, stream)
        # candidate, then: unmapped -> ..., or free -> unmapped -> ...
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next  # unmapped: mapping it merges candidate into it
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool = self._free_small if small else self._free_large
        del pool[bisect_left(pool, _key(candidate))]
        return candidate

    def _find_expandable_block(self, size: int, small: bool, stream: int) -> _Block:
        """``find_expandable_block``: the lowest address of a segment of ``stream`` where free and
        unmapped blocks in a row hold ``size``; a new segment where none does."""
        unmapped = self._unmapped_small if small else self._unmapped_large
        for addr in unmapped:
            start = self._blocks[addr]
            if start.stream != stream:
                continue
            if start.prev is not None and not start.prev.allocated:
                start = start.prev  # a free block just before the unmapped space
            room, b = 0, start
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return start
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        space = -(-EXPANDABLE_ADDRESS_SPACE // page) * page
        base = self._new_address(space)
        block = _Block(base, space, small, base, stream)
        block.mapped, block.expandable = False, True
        self._blocks[base] = block
        self._expandable[base] = space
        insort(unmapped, base)
        return block

    def _map_block(self, block: _Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes of the unmapped ``block`` with pages (whole pages,
        all or none), then merge it with its free neighbours."""
        page = K_SMALL_BUFFER if block.small else K_LARGE_BUFFER
        mapped = -(-size // page) * page
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate runs out: ExpandableSegment::map releases what it made
        unmapped = self._unmapped_small if block.small else self._unmapped_large
        del unmapped[bisect_left(unmapped, block.addr)]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.small, block.segment, block.stream)
            rest.mapped, rest.expandable = False, True
            self._splice(rest, block, block.next)
            insort(unmapped, rest.addr)
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        insort(self._free_small if block.small else self._free_large, _key(block))
        self._reserve(mapped)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: give back the whole pages inside the free ``block``; what is left of it
        at either end stays a free block."""
        page = K_SMALL_BUFFER if block.small else K_LARGE_BUFFER
        start, end = block.addr - block.segment, block.addr - block.segment + block.size
        first, last = -(-start // page) * page, end // page * page
        if first >= last:
            return
        pool = self._free_small if block.small else self._free_large
        del pool[bisect_left(pool, _key(block))]
        del self._blocks[block.addr]
        for lo, hi, before in ((start, first, True), (last, end, False)):
            if hi > lo:  # prev? -> before -> block, or block -> after -> next?
                free = _Block(block.segment + lo, hi - lo, block.small, block.segment, block.stream)
                free.expandable = True
                if before:
                    self._splice(free, block.prev, block)
                else:
                    self._splice(free, block, block.next)
                insort(pool, _key(free))
        block.addr, block.size, block.mapped = block.segment + first, last - first, False
        self._blocks[block.addr] = block
        self._merge(block, block.prev)
        self._merge(block, block.next)
        insort(self._unmapped_small if block.small else self._unmapped_large, block.addr)
        self.reserved -= last - first
        self.num_device_free += 1

    def _splice(self, block: _Block, before: _Block | None, after: _Block | None) -> None:
        """``Block::splice``: put ``block`` between its neighbours ``before`` and ``after``."""
        block.prev, block.next = before, after
        if before is not None:
            before.next = block
        if after is not None:
            after.prev = block
        self._blocks[block.addr] = block

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``dst`` takes in its neighbour ``src`` where both are free and both
        mapped or both unmapped."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool = self._free_small if src.small else self._free_large
            del pool[bisect_left(pool, _key(src))]
        else:
            unmapped = self._unmapped_small if src.small else self._unmapped_large
            del unmapped[bisect_left(unmapped, src.addr)]
        del self._blocks[src.addr]
        if dst.prev is src:
            del self._blocks[dst.addr]
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            self._blocks[dst.addr] = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: cudaFree every free block with no prev
        and no next (a whole segment; split segments are kept), unmap the
        whole pages of every free block of an expandable segment and release
        a segment left with nothing mapped."""
        for block in self._whole_free.values():
            pool = self._free_small if block.small else self._free_large
            del pool[bisect_left(pool, _key(block))]
            self._free_segment(block)
        self._whole_free.clear()
        if not self._expandable:
            return
        blocks = self._blocks
        for pool in (self._free_large, self._free_small):
            for block in [blocks[k[2]] for k in pool if blocks[k[2]].expandable]:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:  # release_expandable_segment
                    unmapped = self._unmapped_small if block.small else self._unmapped_large
                    del unmapped[bisect_left(unmapped, block.addr)]
                    del blocks[block.addr]
                    del self._expandable[block.addr]


def _key(block: _Block) -> tuple[int, int, int]:
    """A free block's place in its pool: c10's ``BlockComparatorSize`` orders by stream, size, address."""
    return block.stream, block.size, block.addr


def _growable(block: _Block) -> int:
    """The size a free block of an expandable segment can grow to: its own and the unmapped space
    right after it (``get_free_block``'s ``expandable_size``)."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
