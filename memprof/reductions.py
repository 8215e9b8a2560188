"""The staging memory of a CUDA reduction kernel, as PyTorch sizes it.

A reduction that leaves few outputs for many inputs (a bias's gradient: a sum
over batch x tokens rows; a mean over a channels-last image's height and
width) splits each output's inputs across thread blocks, which meet in a
staging buffer taken from the caching allocator for the kernel's duration
(``gpu_reduce_kernel`` in aten/src/ATen/native/cuda/Reduce.cuh): 132 MiB for
ViT-B/16's last MLP bias gradient at batch 128, 128 MiB for the mean of a
128 x 128 x 32 x 32 channels-last tensor, both measured on an H200 and both
what this module computes to the byte. Its size follows from the kernel's
launch configuration (``setReduceConfig``), which follows from the
TensorIterator's view of the operands (reduced dimensions first, then by
stride, adjacent dimensions coalesced) and the device's multiprocessors.

What is followed: sums, means, amax/amin and vector norms of floating-point
tensors. Not followed: Welford reductions (var, std), argmax/argmin and
integer sums, whose accumulators are other types. A reduction whose offsets
need 64 bits runs in pieces, as ``TensorIterator::with_32bit_indexing``
splits it, adding into an accumulation buffer where the output's type is
narrower than the accumulator. Checked against the H200 on 65 reductions
(sums over rows, channels-last means, full sums and norms past 32-bit
offsets, amax): benchmarks/results/reductions-h200.json.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .devices import GPU, Vendor

__all__ = ["REDUCTIONS", "Staging", "staging_bytes"]

_ops = torch.ops.aten
#: The reductions followed, and where their ``dim`` argument is (None: all dimensions).
REDUCTIONS = {
    _ops.sum.dim_IntList: 1, _ops.sum.default: None, _ops.mean.dim: 1, _ops.mean.default: None,
    _ops.amax.default: 1, _ops.amin.default: 1, _ops.linalg_vector_norm.default: 2,
}
_OWN_TYPE = {_ops.amax.default, _ops.amin.default}
_MAX_NUM_THREADS = 512  # Reduce.cuh's mnt_wrapper<T>, for every type followed here
_INT32_MAX = 2**31 - 1


def _max_threads_per_sm(capability: tuple[int, int]) -> int:
    """cudaDeviceProp::maxThreadsPerMultiProcessor (CUDA C++ Programming Guide, compute capabilities)."""
    if capability == (7, 5):
        return 1024
    if capability in ((8, 6), (8, 9)) or capability[0] == 12:
        return 1536
    return 2048


class Staging(NamedTuple):
    """What a reduction takes from the caching allocator besides its output: an accumulation
    buffer held through it (``accumulation`` bytes, 0 for none), and per piece of it, in turn,
    a staging buffer and its semaphores, each given back when the piece's kernel ends."""

    accumulation: int
    pieces: list[tuple[int, int]]


_NONE = Staging(0, [])


def staging_bytes(func, args: tuple, out: torch.Tensor, gpu: GPU) -> Staging:
    """The blocks ``func(*args)`` takes for its run (see :class:`Staging`)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() == 0 or x.numel() == 0:
        return _NONE
    if gpu.multiprocessors is None or gpu.vendor is not Vendor.NVIDIA:  # warps of 32, CUDA's heuristics
        return _NONE
    where = REDUCTIONS[func]
    dims = args[where] if where is not None and len(args) > where else None
    if isinstance(dims, int):
        dims = [dims]
    reduced = {d % x.dim() for d in dims} if dims else set(range(x.dim()))
    # The output as TensorIterator sees it: the input's shape, stride 0 where reduced.
    out_strides = list(out.stride()) if out.dim() == x.dim() else _keepdim_strides(out, x.dim(), reduced)
    size = x.element_size()
    shape = list(x.shape)
    strides = [[0 if d in reduced else out_strides[d] * out.element_size() for d in range(x.dim())],
               [s * size for s in x.stride()]]
    shape, strides = _coalesce(*_reorder(shape, strides))
    # The accumulator: amax and amin keep the input's type (ReduceMaxValuesKernel.cu), the others
    # a float (a double for doubles).
    arg_size = size if func in _OWN_TYPE else (8 if x.dtype is torch.float64 else 4)
    pieces = list(_pieces(shape, strides, x.storage_offset() * size))
    staged = [c for piece in pieces if (c := _config(*piece, size, arg_size, gpu))]
    accumulation = 0
    if len(pieces) > 1 and arg_size != out.element_size():
        # The pieces add into an accumulator of the outputs' extent (gpu_reduce_kernel's
        # AccumulationBuffer), since they cannot in a narrower output.
        extent = max([out.element_size()] + [n * st for n, st in zip(shape, strides[0])]) // out.element_size()
        accumulation = extent * arg_size
    return Staging(accumulation, staged)


def _keepdim_strides(out: torch.Tensor, ndim: int, reduced: set[int]) -> list[int]:
    kept = iter(out.stride())
    return [0 if d in reduced else next(kept) for d in range(ndim)]


def _reorder(shape: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """TensorIterator::reorder_dimensions for a reduction: fastest dimension first, reduced ones first."""
    n = len(shape)
    perm = list(range(n))[::-1]  # TensorIterator keeps dimensions fastest-first

    def should_swap(d0: int, d1: int) -> int:
        for k, st in enumerate(strides):
            s0, s1 = st[d0], st[d1]
            if k == 0 and (s0 == 0) != (s1 == 0):  # the output: reduced dimensions to the front
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    for i in range(1, n):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    return [shape[p] for p in perm], [[st[p] for p in perm] for st in strides]


def _coalesce(shape: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """TensorIterator::coalesce_dimensions: adjacent dimensions that step as one become one."""
    shape, strides = list(shape), [list(st) for st in strides]
    prev = 0
    for dim in range(1, len(shape)):
        s0, s1 = shape[prev], shape[dim]
        if s0 == 1 or s1 == 1 or all(s0 * st[prev] == st[dim] for st in strides):
            if s0 == 1:
                for st in strides:
                    st[prev] = st[dim]
            shape[prev] *= s1
        else:
            prev += 1
            if prev != dim:
                for st in strides:
                    st[prev] = st[dim]
                shape[prev] = s1
    return shape[: prev + 1], [st[: prev + 1] for st in strides]


def _pieces(shape: list[int], strides: list[list[int]], offset: int):
    """TensorIterator::with_32bit_indexing: halve the dimension of largest extent until each piece's
    offsets fit in 32 bits. Yields (shape, strides, the input's byte offset)."""
    numel = 1
    for s in shape:
        numel *= s
    fits = numel <= _INT32_MAX and all(1 + sum((n - 1) * s for n, s in zip(shape, st)) <= _INT32_MAX
                                       for st in strides)
    if fits:
        yield shape, strides, offset
        return
    extents = [(max((n - 1) * abs(st[d]) for st in strides), d) for d, n in enumerate(shape) if n]
    dim = max(extents)[1]  # get_dim_to_split: ties go to the outermost, which it scans first
    half = shape[dim] // 2
    first = [*shape[:dim], half, *shape[dim + 1:]]
    second = [*shape[:dim], shape[dim] - half, *shape[dim + 1:]]
    yield from _pieces(first, strides, offset)
    yield from _pieces(second, strides, offset + half * strides[1][dim])


def _last_pow2(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _config(shape: list[int], strides: list[list[int]], offset: int, size: int, arg_size: int,
            gpu: GPU) -> tuple[int, int] | None:
    """setReduceConfig and gpu_reduce_kernel's allocations: (staging buffer, semaphores), or None."""
    out_st, in_st = strides
    reduce_dims = sum(1 for s in out_st if s == 0)
    numel = 1
    for n in shape:
        numel *= n
    num_outputs = 1
    for n, s in zip(shape, out_st):
        if s:
            num_outputs *= n
    inputs_per_output = numel // num_outputs
    ndim = len(shape)
    on_fastest = reduce_dims == ndim or in_st[0] < in_st[reduce_dims]
    if on_fastest:
        dim0, dim1, fastest = inputs_per_output, num_outputs, in_st[0]
    else:
        dim0, dim1, fastest = num_outputs, inputs_per_output, in_st[reduce_dims]
    vec = 1
    if fastest == size:
        if on_fastest and dim0 >= 128 and reduce_dims == 1:
            dim0 //= 4  # vectorize along the input (input_vec_size 4)
        elif not on_fastest:
            vec = _output_vec_size(shape, in_st, reduce_dims, offset, size)
            dim0 //= vec
    max_threads = _MAX_NUM_THREADS // vec
    dim0_pow2 = min(_last_pow2(dim0), max_threads)
    dim1_pow2 = min(_last_pow2(dim1), max_threads)
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height
    step_input = step_output = 1
    if on_fastest:
        step_input *= width
    else:
        step_output *= width
    if _div_up(inputs_per_output, step_input) < min(height * 16, 256):
        return None  # each warp its own outputs: no reduction across blocks
    step_input *= height
    values_per_thread = _div_up(inputs_per_output, step_input)
    target_grid = gpu.multiprocessors * (_max_threads_per_sm(gpu.compute_capability) // threads)
    grid = _div_up(num_outputs // vec, step_output)
    if values_per_thread < 256 or grid > target_grid:
        return None
    ctas = max(min(_div_up(target_grid, grid), _div_up(values_per_thread, 16)), _div_up(values_per_thread, 256))
    if ctas <= 1:
        return None
    staging = arg_size * num_outputs * ctas * (1 if on_fastest else width * vec)
    return staging, 4 * grid


def _output_vec_size(shape: list[int], in_st: list[int], reduce_dims: int, offset: int, size: int) -> int:
    """get_output_vec_size: 4 unless the input's base, the outputs' extent or its other strides break it."""
    vec = 4
    for n in (offset // size, shape[reduce_dims], *(s // size for j, s in enumerate(in_st) if j != reduce_dims)):
        while vec > 1 and n % vec:
            vec //= 2
    return vec
