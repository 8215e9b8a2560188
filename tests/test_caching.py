"""Tests of the caching-allocator model (memprof/caching.py).

Every expectation is derived by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (its default configuration, then expandable
segments); the comment next to each one names the rule.
"""

from __future__ import annotations

import random

import pytest

from memprof import caching
from memprof.caching import CachingAllocatorModel, SimulatedOOM, get_allocation_size, round_size

KiB = 1 << 10
MiB = 1 << 20


def layout(m: CachingAllocatorModel) -> list[tuple[str, int, list[tuple[int, str]]]]:
    """(segment type, segment size, [(block size, state)]) per segment, by address."""
    return [
        (s["segment_type"], s["total_size"], [(b["size"], b["state"][0]) for b in s["blocks"]])
        for s in m.snapshot()
    ]


# --------------------------------------------------------------- size rules


def test_round_size():
    # round_size: below kMinBlockSize -> 512; otherwise up to a multiple of 512.
    assert round_size(1) == 512
    assert round_size(511) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(MiB + 1) == MiB + 512


def test_get_allocation_size():
    # get_allocation_size: <= kSmallSize -> kSmallBuffer (2 MiB)
    assert get_allocation_size(512) == 2 * MiB
    assert get_allocation_size(MiB) == 2 * MiB
    # kSmallSize < size < kMinLargeAlloc -> kLargeBuffer (20 MiB)
    assert get_allocation_size(MiB + 512) == 20 * MiB
    assert get_allocation_size(10 * MiB - 512) == 20 * MiB
    # size >= kMinLargeAlloc -> rounded up to kRoundLarge (2 MiB)
    assert get_allocation_size(10 * MiB) == 10 * MiB
    assert get_allocation_size(11 * MiB) == 12 * MiB
    assert get_allocation_size(16 * MiB + 512) == 18 * MiB


# -------------------------------------------------------- malloc scenarios


def test_one_byte():
    m = CachingAllocatorModel()
    m.malloc(1)
    # round_size(1) = 512 (kMinBlockSize); small pool -> a 2 MiB (kSmallBuffer) segment,
    # split since the remainder 2 MiB - 512 >= 512; allocated counts the 512-byte block.
    assert m.allocated == 512
    assert m.reserved == 2 * MiB
    assert m.num_segments == 1
    assert (m.peak_allocated, m.peak_reserved) == (512, 2 * MiB)
    assert m.requested == 1
    assert layout(m) == [("small", 2 * MiB, [(512, "a"), (2 * MiB - 512, "i")])]


def test_two_1mib_share_one_small_segment():
    m = CachingAllocatorModel()
    m.malloc(MiB)
    # get_pool: 1 MiB <= kSmallSize is the small pool -> 2 MiB segment, remainder 1 MiB split off.
    assert (m.allocated, m.reserved) == (MiB, 2 * MiB)
    m.malloc(MiB)
    # get_free_block: the free 1 MiB remainder fits exactly; no new segment.
    assert (m.allocated, m.reserved) == (2 * MiB, 2 * MiB)
    assert m.num_segments == 1
    assert layout(m) == [("small", 2 * MiB, [(MiB, "a"), (MiB, "a")])]


def test_just_over_1mib_is_large_pool():
    m = CachingAllocatorModel()
    m.malloc(MiB + 1)
    # round_size -> 1 MiB + 512 > kSmallSize: large pool, < kMinLargeAlloc -> 20 MiB segment;
    # remainder 19 MiB - 512 > kSmallSize -> split, so allocated is the rounded request.
    assert (m.allocated, m.reserved) == (MiB + 512, 20 * MiB)
    assert layout(m) == [("large", 20 * MiB, [(MiB + 512, "a"), (19 * MiB - 512, "i")])]


def test_small_pool_splits_down_to_512_bytes():
    m = CachingAllocatorModel()
    m.malloc(MiB)
    m.malloc(MiB - 512)
    # should_split (small pool): remainder 512 >= kMinBlockSize -> split.
    assert layout(m) == [("small", 2 * MiB, [(MiB, "a"), (MiB - 512, "a"), (512, "i")])]
    m.malloc(100)
    # round_size(100) = 512 fits the 512-byte remainder exactly: still one segment.
    assert (m.allocated, m.reserved, m.num_segments) == (2 * MiB, 2 * MiB, 1)
    m.malloc(100)
    # nothing free in the small pool -> a second 2 MiB segment.
    assert (m.allocated, m.reserved, m.num_segments) == (2 * MiB + 512, 4 * MiB, 2)


def test_3mib_then_16_5mib_takes_the_unsplit_remainder():
    m = CachingAllocatorModel()
    m.malloc(3 * MiB)
    # large pool, 3 MiB < kMinLargeAlloc -> 20 MiB segment; remainder 17 MiB > 1 MiB -> split.
    assert (m.allocated, m.reserved) == (3 * MiB, 20 * MiB)
    h = m.malloc(16 * MiB + 512 * KiB)
    # get_free_block: the free 17 MiB block fits (best fit, before any cudaMalloc);
    # should_split (large pool): remainder 0.5 MiB is not > kSmallSize -> whole block
    # handed out, and allocated_bytes counts block->size = 17 MiB.
    assert m.size_of(h) == 17 * MiB
    assert (m.allocated, m.reserved) == (20 * MiB, 20 * MiB)
    assert m.num_segments == 1
    assert m.requested == 3 * MiB + 16 * MiB + 512 * KiB
    m.free(h)
    # free: allocated drops by the block's size (17 MiB).
    assert (m.allocated, m.reserved) == (3 * MiB, 20 * MiB)


def test_12mib_gets_a_segment_of_exactly_12mib():
    m = CachingAllocatorModel()
    m.malloc(12 * MiB)
    # get_allocation_size: 12 MiB >= kMinLargeAlloc -> rounded to 2 MiB = 12 MiB; nothing left.
    assert (m.allocated, m.reserved) == (12 * MiB, 12 * MiB)
    assert layout(m) == [("large", 12 * MiB, [(12 * MiB, "a")])]


def test_11mib_gets_a_12mib_segment_unsplit():
    m = CachingAllocatorModel()
    h = m.malloc(11 * MiB)
    # get_allocation_size: 11 MiB -> 12 MiB segment; remainder 1 MiB is not > kSmallSize,
    # so no split: allocated counts 12 MiB.
    assert (m.allocated, m.reserved) == (12 * MiB, 12 * MiB)
    assert m.size_of(h) == 12 * MiB
    assert layout(m) == [("large", 12 * MiB, [(12 * MiB, "a")])]


def test_10mib_boundary():
    m = CachingAllocatorModel()
    m.malloc(10 * MiB - 512)
    # < kMinLargeAlloc -> 20 MiB segment, remainder 10 MiB + 512 split off.
    assert (m.allocated, m.reserved) == (10 * MiB - 512, 20 * MiB)
    m2 = CachingAllocatorModel()
    m2.malloc(10 * MiB)
    # == kMinLargeAlloc -> its own 10 MiB segment.
    assert (m2.allocated, m2.reserved) == (10 * MiB, 10 * MiB)


def test_zero_bytes_cost_nothing():
    m = CachingAllocatorModel()
    h = m.malloc(0)
    # NativeCachingAllocator::allocate only calls malloc when size != 0.
    assert (m.allocated, m.reserved, m.num_segments) == (0, 0, 0)
    assert m.size_of(h) == 0 and m.address_of(h) is None
    m.free(h)
    with pytest.raises(KeyError):
        m.free(h)


def test_free_unknown_handle_and_negative_size():
    m = CachingAllocatorModel()
    with pytest.raises(KeyError):
        m.free(12345)
    h = m.malloc(10)
    m.free(h)
    with pytest.raises(KeyError):
        m.free(h)
    with pytest.raises(ValueError):
        m.malloc(-1)


# ------------------------------------------------------ reuse and merging


def test_free_and_best_fit_reuse():
    m = CachingAllocatorModel()
    x1 = m.malloc(4 * MiB)  # one 20 MiB segment: [x1 4][s1 2][x2 3][s2 2][free 9]
    m.malloc(2 * MiB)
    x2 = m.malloc(3 * MiB)
    m.malloc(2 * MiB)
    assert m.num_segments == 1
    a1, a2 = m.address_of(x1), m.address_of(x2)
    m.free(x1)
    m.free(x2)
    # free: neighbours of x1 and x2 are allocated -> no merge; free blocks 4, 3 and 9 MiB.
    assert layout(m) == [
        ("large", 20 * MiB, [(4 * MiB, "i"), (2 * MiB, "a"), (3 * MiB, "i"), (2 * MiB, "a"), (9 * MiB, "i")])
    ]
    assert m.allocated == 4 * MiB
    y = m.malloc(2 * MiB + 512 * KiB)
    # get_free_block: best fit is the 3 MiB block (smallest >= 2.5 MiB), at x2's address;
    # remainder 0.5 MiB not > kSmallSize -> unsplit, counts 3 MiB.
    assert m.address_of(y) == a2
    assert m.allocated == 7 * MiB
    z = m.malloc(MiB + 512 * KiB)
    # best fit is now the 4 MiB block at x1's address; remainder 2.5 MiB > 1 MiB -> split.
    assert m.address_of(z) == a1
    assert m.allocated == 8 * MiB + 512 * KiB
    assert m.reserved == 20 * MiB
    m.check_invariants()


def test_best_fit_ties_go_to_the_lower_address():
    m = CachingAllocatorModel()
    a = m.malloc(4 * MiB)  # [a 4][s 2][b 4][s 2][free 8]
    m.malloc(2 * MiB)
    b = m.malloc(4 * MiB)
    m.malloc(2 * MiB)
    aa, ab = m.address_of(a), m.address_of(b)
    m.free(b)
    m.free(a)
    # BlockComparatorSize orders (size, ptr): two free 4 MiB blocks -> the lower address.
    assert m.address_of(m.malloc(4 * MiB)) == aa
    assert m.address_of(m.malloc(4 * MiB)) == ab


def test_merge_neighbours_then_reuse_the_larger_block():
    m = CachingAllocatorModel()
    a = m.malloc(4 * MiB)  # 20 MiB segment: [a 4][b 4][c 4][free 8]
    b = m.malloc(4 * MiB)
    c = m.malloc(4 * MiB)
    base = m.address_of(a)
    m.free(a)
    m.free(b)
    # try_merge_blocks: b merges with its free prev a -> one free 8 MiB block at the base.
    assert layout(m) == [("large", 20 * MiB, [(8 * MiB, "i"), (4 * MiB, "a"), (8 * MiB, "i")])]
    d = m.malloc(7 * MiB)
    # Two free 8 MiB blocks: best fit, tie -> lower address (the merged one);
    # remainder 1 MiB not > kSmallSize -> unsplit, allocated counts 8 MiB.
    assert m.address_of(d) == base
    assert (m.allocated, m.reserved, m.num_segments) == (12 * MiB, 20 * MiB, 1)
    m.free(c)
    # c merges with the free 8 MiB after it.
    assert layout(m) == [("large", 20 * MiB, [(8 * MiB, "a"), (12 * MiB, "i")])]
    e = m.malloc(11 * MiB)
    # The 12 MiB free block fits 11 MiB (no cudaMalloc); remainder 1 MiB -> unsplit.
    assert m.size_of(e) == 12 * MiB
    assert (m.allocated, m.reserved) == (20 * MiB, 20 * MiB)
    m.free(d)
    m.free(e)
    # Both sides merge back into one whole free segment.
    assert layout(m) == [("large", 20 * MiB, [(20 * MiB, "i")])]
    m.check_invariants()


def test_free_merges_prev_and_next_at_once():
    m = CachingAllocatorModel()
    hs = [m.malloc(256 * KiB) for _ in range(4)]  # small segment: 4 x 256 KiB, then 1 MiB free
    m.free(hs[0])
    m.free(hs[3])
    # free_block: hs[0] has no free neighbour; hs[3] merges with the free 1 MiB after it.
    assert layout(m) == [("small", 2 * MiB, [(256 * KiB, "i"), (256 * KiB, "a"), (256 * KiB, "a"), (1280 * KiB, "i")])]
    m.free(hs[2])
    assert layout(m) == [("small", 2 * MiB, [(256 * KiB, "i"), (256 * KiB, "a"), (1536 * KiB, "i")])]
    m.free(hs[1])
    # try_merge_blocks with prev and with next: the whole segment is one free block again.
    assert layout(m) == [("small", 2 * MiB, [(2 * MiB, "i")])]
    m.check_invariants()
    m.empty_cache()
    assert m.reserved == 0


def test_pools_are_separate():
    m = CachingAllocatorModel()
    h = m.malloc(3 * MiB)
    m.free(h)
    # The cached 20 MiB large block cannot serve a small request: get_pool -> small pool.
    m.malloc(1000)
    assert (m.reserved, m.num_segments) == (22 * MiB, 2)
    h = m.malloc(MiB)
    m.free(h)
    # ... nor can the small pool's free memory serve a large one.
    m.malloc(MiB + 512)
    assert (m.reserved, m.num_segments) == (22 * MiB, 2)  # reuses the cached 20 MiB segment


def test_blocks_serve_the_stream_they_were_allocated_on():
    """c10's pools order free blocks by (stream, size, address) and get_free_block takes only
    a block of the requesting stream: a side stream's cached segment is not the default's."""
    m = CachingAllocatorModel()
    h = m.malloc(4 * MiB, stream=1)  # a 20 MiB segment for stream 1
    m.free(h)
    m.malloc(4 * MiB)  # the default stream (0) cannot take it: a segment of its own
    assert (m.reserved, m.num_segments) == (40 * MiB, 2)
    side = m.malloc(16 * MiB, stream=1)  # stream 1 takes its cached segment again
    assert (m.reserved, m.num_segments) == (40 * MiB, 2)
    assert m.stream_of(side) == 1
    assert sorted((s["stream"], s["allocated_size"]) for s in m.snapshot()) == [(0, 4 * MiB), (1, 16 * MiB)]
    m.free(side)
    m.empty_cache()  # the whole free segment goes, whatever its stream
    assert (m.reserved, m.num_segments) == (20 * MiB, 1)
    m.check_invariants()


def test_expandable_segments_are_made_per_stream():
    m = CachingAllocatorModel(expandable_segments=True)
    h = m.malloc(4 * MiB, stream=2)  # one 20 MiB page of stream 2's large segment
    m.free(h)
    m.malloc(4 * MiB)
    assert m.reserved == 40 * MiB  # the default stream maps a page of a segment of its own
    m.malloc(30 * MiB, stream=2)  # stream 2's segment maps one page more after its free one
    assert m.reserved == 60 * MiB
    assert sorted((s["stream"], s["total_size"]) for s in m.snapshot()) == [(0, 20 * MiB), (2, 40 * MiB)]
    m.check_invariants()


# ------------------------------------------------------------ empty_cache


def test_empty_cache_releases_only_fully_free_segments():
    m = CachingAllocatorModel()
    b = m.malloc(12 * MiB)  # segment 1: 12 MiB, stays in use
    c = m.malloc(30 * MiB)  # segment 2: 30 MiB, will be partially free
    a = m.malloc(3 * MiB)  # segment 3: 20 MiB (3 used + 17 free), will be fully free
    d = m.malloc(100)  # segment 4: small 2 MiB, will be fully free
    m.free(a)
    m.free(d)
    m.free(c)
    c1 = m.malloc(25 * MiB)  # best fit: only the free 30 MiB block fits -> split [25 a][5 free]
    assert m.num_segments == 4
    assert (m.allocated, m.reserved) == (37 * MiB, 64 * MiB)
    peaks = (m.peak_allocated, m.peak_reserved)
    m.empty_cache()
    # release_cached_blocks: only blocks with no prev and no next (whole segments) are
    # cudaFree'd: segments 3 and 4. Segment 2 is split (in use), segment 1 allocated.
    assert (m.allocated, m.reserved, m.num_segments) == (37 * MiB, 42 * MiB, 2)
    assert (m.peak_allocated, m.peak_reserved) == peaks  # peaks are not touched
    assert [s["total_size"] for s in m.snapshot()] == [12 * MiB, 30 * MiB]
    m.free(c1)
    m.empty_cache()
    assert (m.reserved, m.num_segments) == (12 * MiB, 1)
    m.free(b)
    m.empty_cache()
    assert (m.allocated, m.reserved, m.num_segments) == (0, 0, 0)
    assert m.num_device_alloc == 4 and m.num_device_free == 4
    m.check_invariants()


# --------------------------------------------------------------- capacity


def test_capacity_releases_cache_then_retries():
    m = CachingAllocatorModel(capacity=40 * MiB)
    a = m.malloc(12 * MiB)  # 12 MiB segment
    m.malloc(20 * MiB)  # 20 MiB segment, no free remainder
    m.free(a)  # 12 MiB cached, whole segment
    assert m.reserved == 32 * MiB
    m.malloc(14 * MiB)
    # No free block >= 14 MiB; a 14 MiB segment would reach 46 MiB > 40 MiB:
    # malloc frees the cached whole segments (release_cached_blocks) and retries.
    assert (m.allocated, m.reserved, m.num_segments) == (34 * MiB, 34 * MiB, 2)
    assert m.peak_reserved == 34 * MiB
    assert m.num_alloc_retries == 1 and m.num_ooms == 0
    m.check_invariants()


def test_capacity_oom_after_release():
    m = CachingAllocatorModel(capacity=40 * MiB)
    a = m.malloc(12 * MiB)
    m.malloc(20 * MiB)
    m.free(a)
    assert (m.allocated, m.reserved) == (20 * MiB, 32 * MiB)
    with pytest.raises(SimulatedOOM) as exc:
        m.malloc(30 * MiB)
    # 32 + 30 > 40 -> release the cached 12 MiB -> 20 + 30 > 40 still -> out of memory.
    # The release is not undone: reserved stays at 20 MiB after the error.
    e = exc.value
    assert (e.requested, e.alloc_size, e.reserved, e.allocated) == (30 * MiB, 30 * MiB, 20 * MiB, 20 * MiB)
    msg = str(e)
    assert str(30 * MiB) in msg and str(20 * MiB) in msg and "reserved" in msg and "allocated" in msg
    assert (m.allocated, m.reserved, m.num_segments) == (20 * MiB, 20 * MiB, 1)
    assert m.num_ooms == 1
    m.check_invariants()
    # A request that fits after the error still works.
    m.malloc(20 * MiB)
    assert m.reserved == 40 * MiB


def test_capacity_oom_without_anything_to_release():
    m = CachingAllocatorModel(capacity=MiB)
    # The smallest segment (kSmallBuffer, 2 MiB) exceeds a 1 MiB capacity.
    with pytest.raises(SimulatedOOM):
        m.malloc(1)
    assert (m.allocated, m.reserved) == (0, 0)
    m = CachingAllocatorModel(capacity=30 * MiB)
    m.malloc(30 * MiB)
    with pytest.raises(SimulatedOOM):
        m.malloc(3 * MiB)  # 20 MiB segment > 0 left, nothing cached
    assert (m.allocated, m.reserved) == (30 * MiB, 30 * MiB)


def test_capacity_reuse_needs_no_new_segment():
    m = CachingAllocatorModel(capacity=20 * MiB)
    h = m.malloc(3 * MiB)
    m.malloc(16 * MiB)  # fits the 17 MiB free block: no cudaMalloc, no capacity check
    m.free(h)
    m.malloc(2 * MiB)
    assert m.reserved == 20 * MiB and m.num_ooms == 0


# ------------------------------------------------------------------ peaks


def test_peaks_and_reset_peak():
    m = CachingAllocatorModel()
    a = m.malloc(12 * MiB)
    b = m.malloc(12 * MiB)
    m.free(a)
    # increase_stat raises the peak; decrease_stat leaves it.
    assert (m.allocated, m.peak_allocated) == (12 * MiB, 24 * MiB)
    assert (m.reserved, m.peak_reserved) == (24 * MiB, 24 * MiB)
    m.empty_cache()
    assert (m.reserved, m.peak_reserved) == (12 * MiB, 24 * MiB)
    m.reset_peak()
    # resetPeakStats: peak = current.
    assert (m.peak_allocated, m.peak_reserved) == (12 * MiB, 12 * MiB)
    m.free(b)
    m.malloc(MiB)  # small segment
    assert (m.allocated, m.peak_allocated) == (MiB, 12 * MiB)
    assert (m.reserved, m.peak_reserved) == (14 * MiB, 14 * MiB)
    m.reset_peak()
    assert (m.peak_allocated, m.peak_reserved) == (MiB, 14 * MiB)
    assert m.stats()["peak_allocated"] == MiB


# ------------------------------------------------- reference and invariants


class _RefAllocator:
    """A deliberately naive re-statement of the rules: segments as lists of
    [addr, size, allocated] blocks, best fit by scanning every block."""

    def __init__(self, capacity=None):
        self.capacity = capacity
        self.segments = {}  # base -> {"small": bool, "blocks": [[addr, size, alloc]]}
        self.handles = {}
        self.next_handle = 1
        self.next_addr = caching._BASE_ADDRESS
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, n):
        h = self.next_handle
        self.next_handle += 1
        if n == 0:
            self.handles[h] = None
            return h
        size = max(512, -(-n // 512) * 512)
        small = size <= MiB
        best = None
        for base, seg in self.segments.items():
            if seg["small"] != small:
                continue
            for blk in seg["blocks"]:
                if not blk[2] and blk[1] >= size and (best is None or (blk[1], blk[0]) < (best[1][1], best[1][0])):
                    best = (base, blk)
        if best is None:
            seg_size = 2 * MiB if small else (20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB)
            if self.capacity is not None and self.reserved + seg_size > self.capacity:
                for base in [b for b, s in self.segments.items() if len(s["blocks"]) == 1 and not s["blocks"][0][2]]:
                    self.reserved -= self.segments.pop(base)["blocks"][0][1]
                if self.reserved + seg_size > self.capacity:
                    raise SimulatedOOM(n, seg_size, self.reserved, self.allocated, self.capacity)
            base = self.next_addr
            self.next_addr += -(-seg_size // (2 * MiB)) * 2 * MiB
            blk = [base, seg_size, False]
            self.segments[base] = {"small": small, "blocks": [blk]}
            self.reserved += seg_size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            best = (base, blk)
        base, blk = best
        blocks = self.segments[base]["blocks"]
        rem = blk[1] - size
        if (rem >= 512) if small else (rem > MiB):
            blocks.insert(blocks.index(blk) + 1, [blk[0] + size, rem, False])
            blk[1] = size
        blk[2] = True
        self.allocated += blk[1]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.handles[h] = (base, blk[0])
        return h

    def free(self, h):
        loc = self.handles.pop(h)
        if loc is None:
            return
        base, addr = loc
        blocks = self.segments[base]["blocks"]
        i = next(k for k, b in enumerate(blocks) if b[0] == addr)
        blocks[i][2] = False
        self.allocated -= blocks[i][1]
        if i + 1 < len(blocks) and not blocks[i + 1][2]:
            blocks[i][1] += blocks.pop(i + 1)[1]
        if i > 0 and not blocks[i - 1][2]:
            blocks[i - 1][1] += blocks.pop(i)[1]

    def empty_cache(self):
        for base in [b for b, s in self.segments.items() if len(s["blocks"]) == 1 and not s["blocks"][0][2]]:
            self.reserved -= self.segments.pop(base)["blocks"][0][1]

    def reset_peak(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def layout(self):
        return [
            ("small" if self.segments[b]["small"] else "large", sum(x[1] for x in self.segments[b]["blocks"]),
             [(x[1], "a" if x[2] else "i") for x in self.segments[b]["blocks"]])
            for b in sorted(self.segments)
        ]


def _random_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.55:  # small pool
        return rng.randint(1, MiB)
    if r < 0.85:  # 1-10 MiB: packed into 20 MiB segments
        return rng.randint(MiB + 1, 10 * MiB)
    return rng.randint(10 * MiB, 80 * MiB)  # own segments


def _check_structure(m: CachingAllocatorModel) -> None:
    """The invariants the brief names, checked from the public snapshot."""
    snap = m.snapshot()
    assert m.allocated <= m.reserved
    assert m.reserved == sum(s["total_size"] for s in snap)
    assert m.num_segments == len(snap)
    assert m.allocated == sum(s["allocated_size"] for s in snap)
    for s in snap:
        addr = s["address"]
        prev_free = False
        for b in s["blocks"]:
            assert b["address"] == addr  # blocks tile the segment: no gap, no overlap
            addr += b["size"]
            free = b["state"] == "inactive"
            assert not (free and prev_free)  # no two adjacent free blocks
            prev_free = free
        assert addr == s["address"] + s["total_size"]


@pytest.mark.parametrize("seed,capacity", [(0, None), (1, None), (2, 600 * MiB)])
def test_random_events_keep_invariants_and_match_reference(seed, capacity):
    rng = random.Random(seed)
    m = CachingAllocatorModel(capacity=capacity)
    ref = _RefAllocator(capacity=capacity)
    live: list[tuple[int, int]] = []
    ooms = 0
    for step in range(10_000):
        r = rng.random()
        if r < 0.002:
            m.empty_cache()
            ref.empty_cache()
        elif r < 0.004:
            m.reset_peak()
            ref.reset_peak()
        elif live and (len(live) > 250 or r < 0.45):
            h, rh = live.pop(rng.randrange(len(live)))
            m.free(h)
            ref.free(rh)
        else:
            n = _random_size(rng)
            try:
                h = m.malloc(n)
            except SimulatedOOM:
                ooms += 1
                with pytest.raises(SimulatedOOM):
                    ref.malloc(n)
            else:
                live.append((h, ref.malloc(n)))
        got = (m.allocated, m.reserved, m.peak_allocated, m.peak_reserved)
        assert got == (ref.allocated, ref.reserved, ref.peak_allocated, ref.peak_reserved), step
        _check_structure(m)
        if step % 50 == 0:
            m.check_invariants()
            assert layout(m) == ref.layout(), step
    if capacity is not None:
        assert ooms > 0  # the capacity path was exercised
        assert m.num_ooms == ooms
    for h, rh in live:
        m.free(h)
        ref.free(rh)
    assert m.allocated == 0
    m.check_invariants()
    m.empty_cache()
    # Everything is free: every segment is whole again and released.
    assert (m.reserved, m.num_segments) == (0, 0)


def test_deepcopy_of_a_segment_split_into_thousands_of_blocks():
    """A 2 MiB small-pool segment cut into 4096 blocks of 512 bytes is one
    linked list; the copy is independent and replays the same from there."""
    import copy

    m = CachingAllocatorModel()
    handles = [m.malloc(512) for _ in range(4096)]
    for h in handles[::2]:
        m.free(h)
    assert m.num_segments == 1
    c = copy.deepcopy(m)
    assert c.layout() == m.layout() and c.stats() == m.stats()
    c.check_invariants()
    before = c.layout()
    for h in handles[1::2]:
        m.free(h)
    m.malloc(2 * 2**20)
    assert c.layout() == before  # the original's frees left the copy alone
    for h in handles[1::2]:
        c.free(h)
    c.malloc(2 * 2**20)
    assert c.layout() == m.layout() and c.stats() == m.stats()
    # the small segment, now one free block, and a 20 MiB large segment (kLargeBuffer)
    assert c.reserved == m.reserved == (2 + 20) * 2**20
    c.check_invariants()


# ------------------------------------------------------- expandable segments
# Expectations from Note [Expandable Segments] and try_allocate_expandable_block,
# map_block, unmap_block, get_free_block of c10/cuda/CUDACachingAllocator.cpp:
# 2 MiB pages in the small pool, 20 MiB pages in the large one.


def blocks_of(m: CachingAllocatorModel) -> list[list[tuple[int, str]]]:
    """(block size, state) per mapped run of each expandable segment, by address."""
    return [[(b["size"], b["state"][0]) for b in s["blocks"]] for s in m.snapshot() if s["is_expandable"]]


def test_expandable_small_request_maps_one_small_page():
    m = CachingAllocatorModel(expandable_segments=True)
    m.malloc(1)
    # round_size 512; the small pool's segment maps one 2 MiB page, the rest split off (>= 512).
    assert (m.allocated, m.reserved, m.num_device_alloc) == (512, 2 * MiB, 1)
    # map_block leaves segment.all.current alone: no cudaMalloc'ed segment.
    assert m.num_segments == 0
    assert blocks_of(m) == [[(512, "a"), (2 * MiB - 512, "i")]]
    m.check_invariants()


def test_expandable_segment_grows_by_large_pages_and_splits_any_remainder():
    m = CachingAllocatorModel(expandable_segments=True)
    m.malloc(30 * MiB)  # two 20 MiB pages mapped; the 10 MiB left is split off
    assert (m.allocated, m.reserved) == (30 * MiB, 40 * MiB)
    m.malloc(5 * MiB)  # best fit: the 10 MiB free block; remainder 5 MiB >= 512 is split too
    assert (m.allocated, m.reserved) == (35 * MiB, 40 * MiB)
    # 8 MiB: no free block fits; the free 5 MiB block before the unmapped space is extended by
    # one more page (3 MiB lacking -> 20 MiB mapped) and merges with it: 25 MiB, 17 MiB left.
    m.malloc(8 * MiB)
    assert (m.allocated, m.reserved, m.num_device_alloc) == (43 * MiB, 60 * MiB, 2)
    assert blocks_of(m) == [[(30 * MiB, "a"), (5 * MiB, "a"), (8 * MiB, "a"), (17 * MiB, "i")]]
    m.check_invariants()


def test_expandable_best_fit_passes_over_the_growable_end():
    m = CachingAllocatorModel(expandable_segments=True)
    a = m.malloc(12 * MiB)
    m.malloc(4 * MiB)
    m.free(a)  # free 12 MiB at the start, 4 MiB allocated, free 4 MiB at the mapped end
    assert blocks_of(m) == [[(12 * MiB, "i"), (4 * MiB, "a"), (4 * MiB, "i")]]
    h = m.malloc(3 * MiB)
    # The 4 MiB end block counts as 4 MiB plus the unmapped space after it, more than the
    # 12 MiB block, so the 12 MiB block is taken (the default allocator would take the 4 MiB one).
    assert m.address_of(h) == m.snapshot()[0]["address"]
    assert blocks_of(m) == [[(3 * MiB, "a"), (9 * MiB, "i"), (4 * MiB, "a"), (4 * MiB, "i")]]
    m.check_invariants()


def test_expandable_free_keeps_pages_and_empty_cache_unmaps_whole_ones():
    m = CachingAllocatorModel(expandable_segments=True)
    a = m.malloc(30 * MiB)
    m.malloc(5 * MiB)
    m.free(a)
    assert (m.allocated, m.reserved) == (5 * MiB, 40 * MiB)  # free does not unmap
    m.empty_cache()
    # unmap_block: the free [0, 30) MiB holds one whole page, [0, 20); [20, 30) stays mapped and
    # free. The free [35, 40) MiB holds no whole page.
    assert (m.reserved, m.num_device_free) == (20 * MiB, 1)
    assert blocks_of(m) == [[(10 * MiB, "i"), (5 * MiB, "a"), (5 * MiB, "i")]]
    # 25 MiB: the lowest room is the unmapped hole at the start with the free 10 MiB after it:
    # one page mapped there, merged with the 10 MiB block.
    h = m.malloc(25 * MiB)
    assert m.address_of(h) == min(m._expandable)
    assert (m.allocated, m.reserved) == (30 * MiB, 40 * MiB)
    assert blocks_of(m) == [[(25 * MiB, "a"), (5 * MiB, "i"), (5 * MiB, "a"), (5 * MiB, "i")]]
    m.check_invariants()


def test_expandable_segment_left_unmapped_is_released():
    m = CachingAllocatorModel(expandable_segments=True)
    first = m.address_of(m.malloc(30 * MiB))
    m.free(1)
    m.empty_cache()
    # Both pages unmapped; the block then has no neighbour: release_expandable_segment.
    assert (m.reserved, m.num_device_free, m.snapshot(), m._expandable) == (0, 1, [], {})
    assert m.address_of(m.malloc(MiB + 512)) != first  # a new segment, for the large pool
    assert m.reserved == 20 * MiB
    m.check_invariants()


def test_expandable_out_of_memory_unmaps_free_pages_then_raises():
    m = CachingAllocatorModel(capacity=60 * MiB, expandable_segments=True)
    a = m.malloc(30 * MiB)
    m.malloc(25 * MiB)  # 40 MiB mapped, then one more page: 60 MiB
    m.free(a)
    assert (m.allocated, m.reserved) == (25 * MiB, 60 * MiB)
    # 36 MiB: no free block fits; the free 5 MiB at the end needs 31 MiB more, two pages: 100 MiB
    # > 60. release_cached_blocks unmaps [0, 20) of the free 30 MiB; the retry finds the hole at
    # the start too small (20 + 10 MiB) and the end still two pages short: out of memory.
    with pytest.raises(SimulatedOOM):
        m.malloc(36 * MiB)
    assert (m.reserved, m.num_alloc_retries, m.num_ooms) == (40 * MiB, 1, 1)
    m.check_invariants()
    m.malloc(28 * MiB)  # the hole and the free 10 MiB after it: 30 MiB, one page mapped
    assert (m.allocated, m.reserved) == (53 * MiB, 60 * MiB)
    m.check_invariants()


def test_expandable_switched_off_hands_out_cudamalloc_blocks_only():
    m = CachingAllocatorModel(expandable_segments=True)
    m.malloc(5 * MiB)
    m.expandable_segments = False
    # The free 15 MiB of the expandable segment is passed over; a 20 MiB cudaMalloc'ed segment is made.
    m.malloc(4 * MiB)
    assert (m.reserved, m.num_segments) == (40 * MiB, 1)
    assert layout(m)[1] == ("large", 20 * MiB, [(4 * MiB, "a"), (16 * MiB, "i")])
    m.check_invariants()


@pytest.mark.parametrize("seed,capacity", [(3, None), (4, 400 * MiB)])
def test_expandable_random_events_keep_invariants(seed, capacity):
    import copy

    rng = random.Random(seed)
    m = CachingAllocatorModel(capacity=capacity, expandable_segments=True)
    live: list[int] = []
    ooms = 0
    for step in range(5_000):
        r = rng.random()
        if r < 0.004:
            m.empty_cache()
        elif live and (len(live) > 150 or r < 0.45):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(m.malloc(_random_size(rng)))
            except SimulatedOOM:
                ooms += 1
        assert m.reserved % (2 * MiB) == 0 and m.allocated <= m.reserved
        if step % 25 == 0:
            m.check_invariants()
        if step == 2_500:
            c = copy.deepcopy(m)
            c.check_invariants()
            assert c.layout() == m.layout()
    assert m.num_segments == 0  # only expandable segments were made
    if capacity is not None:
        assert ooms > 0 and m.num_ooms == ooms
    for h in live:
        m.free(h)
    m.empty_cache()
    assert (m.allocated, m.reserved, m._expandable) == (0, 0, {})
    m.check_invariants()


@pytest.mark.parametrize("environ,expected", [
    ({}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}, False),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    # The CUDA-specific name is read first; the other only where it is unset.
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}, False),
])
def test_expandable_segments_setting_is_read_as_pytorch_reads_it(environ, expected):
    assert caching.expandable_segments_configured(environ) is expected


def test_expandable_segments_setting_other_than_true_or_false_is_pytorchs_error():
    with pytest.raises(RuntimeError, match="expected a single True/False argument for expandable_segments, got 'true'"):
        caching.expandable_segments_configured({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true"})


@pytest.mark.parametrize("settings,unmodelled", [
    ("expandable_segments:True", []),
    ("backend:native,expandable_segments:True,pinned_use_cuda_host_register:True", []),
    ("max_split_size_mb:128, garbage_collection_threshold:0.6", ["garbage_collection_threshold:0.6"]),
    ("max_split_size_mb:128,max_non_split_rounding_mb:64", []),
    ("roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:False",
     ["roundup_power2_divisions:[256:1,512:2,>:8]"]),
    ("backend:cudaMallocAsync", ["backend:cudaMallocAsync"]),
])
def test_settings_the_model_does_not_follow_are_named(settings, unmodelled):
    assert caching.unmodelled_settings(settings) == unmodelled


def test_max_split_size_is_read_as_pytorch_reads_it():
    assert caching.max_split_settings("max_split_size_mb:128, garbage_collection_threshold:0.8") == (128 * MiB, None)
    assert caching.max_split_settings("max_split_size_mb:512,max_non_split_rounding_mb:64") == (512 * MiB, 64 * MiB)
    assert caching.max_split_settings("expandable_segments:True") == (None, None)
    with pytest.raises(RuntimeError, match="max_split_size_mb too small, must be >= 20"):
        caching.max_split_settings("max_split_size_mb:10")


def test_an_oversize_block_serves_no_smaller_request_and_is_not_split():
    """With max_split_size (128 MiB), a cached 200 MiB block is not split for an 8 MiB request (a
    20 MiB segment is made instead), serves a 190 MiB one whole (within kLargeBuffer), not a 150 MiB one."""
    m = CachingAllocatorModel()
    m.max_split_size = 128 * MiB
    h = m.malloc(200 * MiB)
    m.free(h)
    small = m.malloc(8 * MiB)
    assert m.reserved == 220 * MiB and m.size_of(small) == 8 * MiB
    m.free(small)
    h = m.malloc(190 * MiB)
    assert m.size_of(h) == 200 * MiB and m.reserved == 220 * MiB  # the whole block, not split
    m.free(h)
    h = m.malloc(150 * MiB)  # 200 >= 150 + 20: refused, a segment of its own
    assert m.reserved == 370 * MiB and m.size_of(h) == 150 * MiB
    m.check_invariants()
    unlimited = CachingAllocatorModel()
    unlimited.free(unlimited.malloc(200 * MiB))
    unlimited.malloc(8 * MiB)
    assert unlimited.reserved == 200 * MiB  # split as before


def test_release_available_cached_blocks_frees_an_oversize_block_before_the_whole_cache():
    m = CachingAllocatorModel(capacity=350 * MiB)
    m.max_split_size = 128 * MiB
    m.malloc(30 * MiB)
    cached = m.malloc(30 * MiB)
    big = m.malloc(200 * MiB)
    m.free(cached)
    m.free(big)
    m.malloc(150 * MiB)  # the 200 MiB block is refused (>= 150 + 20); 260 + 150 > 350: it is freed, not the 30 MiB one
    assert m.reserved == 210 * MiB and m.num_alloc_retries == 0 and m.num_device_free == 1
    m.check_invariants()
