"""Which kernel ``scaled_dot_product_attention`` runs on a CUDA GPU, by PyTorch's rules, and running it so.

A port of ``select_sdp_backend`` and the ``can_use_*_attention`` checks of
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (with the helpers of
``sdp_utils_cpp.h``), for torch 2.11 and later on NVIDIA GPUs. It reads only
what those functions read (shapes, strides, storage offsets, dtypes,
``requires_grad``, the mask, dropout, ``is_causal``, ``enable_gqa``, the
target's compute capability, the cuDNN version and the global SDPA switches),
so it runs on meta tensors for a GPU that is not there, and a CUDA test checks
it against PyTorch's own functions on a real GPU (tests/test_sdpa_cuda.py).

The kernel matters for memory: flash and cuDNN save the output and one
log-sum-exp per query row; memory-efficient attention also pads and expands
an explicit mask; the math fallback materialises the score matrix (and, with
grouped heads, copies of the keys and values), several times the rest of the
layer at long sequences.

cuDNN attention comes first on Hopper and Blackwell when the cuDNN runtime is
newer than 9.15 (``check_prefer_cudnn_attention``), which is the case for the
CUDA 13 wheels of torch 2.11 (cuDNN 9.19). A simulation on a machine without
a GPU cannot ask the runtime, so it assumes :data:`DEFAULT_CUDNN`, the cuDNN of
those wheels, unless a CUDA build of torch reports its own.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch

__all__ = ["DEFAULT_CUDNN", "Environment", "jagged_attention", "select_backend", "usable_backends"]

#: cuDNN runtime assumed when none can be asked: the one torch 2.11's CUDA 13 wheels ship (9.19.0).
DEFAULT_CUDNN = 91900
#: CUDA runtime assumed likewise (the wheels' 13.0).
DEFAULT_CUDA = (13, 0)

# at::SDPBackend's values, as torch._C._get_sdp_priority_order() returns them.
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_DEFAULT_ORDER = [1, 2, 0, 3, 4]
_HALF = (torch.float16, torch.bfloat16)


class Environment:
    """What the choice depends on besides the tensors: the GPU and the software on it."""

    def __init__(
        self,
        capability: tuple[int, int],
        cudnn: int | None = None,
        cuda: tuple[int, int] | None = None,
        torch_version: tuple[int, int] | None = None,
    ) -> None:
        self.capability = tuple(capability)
        self.cudnn = cudnn if cudnn is not None else _local_cudnn() or DEFAULT_CUDNN
        self.cuda = cuda if cuda is not None else _local_cuda() or DEFAULT_CUDA
        #: torch 2.14 changed the rules (its docs and libtorch_cuda's checks): memory-efficient attention
        #: takes grouped heads, every fused kernel takes one shared key/value head without enable_gqa,
        #: cuDNN needs dropout in steps of 1/16 and limits the head sizes it can differentiate.
        version = torch_version or tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        self.newer = version >= (2, 14)

    @classmethod
    def of(cls, gpu: Any) -> "Environment":
        """The environment of a catalogue GPU (``memprof.devices.GPU``) or of ``(major, minor)``."""
        capability = getattr(gpu, "compute_capability", gpu)
        return cls(capability)

    def sm(self, low: tuple[int, int], high: tuple[int, int]) -> bool:
        return low <= self.capability <= high

    def prefers_cudnn(self) -> bool:
        # check_prefer_cudnn_attention: cuDNN > 9.15 on sm90 / sm10x (CUDA < 13: sm90, sm100, sm103 only).
        if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") in ("1", "true", "True", "ON", "on", "yes"):
            return False
        major, minor = self.capability
        if self.cuda < (13, 0):
            return self.cudnn > 91500 and major in (9, 10) and minor in (0, 3)
        return self.cudnn > 91500 and major in (9, 10)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        """``scaled_dot_product_attention`` as its CUDA dispatch runs it (native/transformers/attention.cpp):
        the kernel :func:`select_backend` picks, with the mask conversion and padding around it."""
        backend = select_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, self)
        ops = torch.ops.aten
        if attn_mask is not None and attn_mask.dtype is torch.bool:
            # convert_boolean_attn_mask (and its cuDNN twin): an additive mask in the query's dtype.
            zero = torch.zeros((), dtype=query.dtype, device=attn_mask.device)
            attn_mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
        if backend == "cudnn":
            lse = _needs_logsumexp(query, key, value)
            if key.shape[-3] != query.shape[-3] and not _cudnn_gqa_on_meta():
                return _CudnnGroupedAttention.apply(query, key, value, lse)
            return ops._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, lse, dropout_p, is_causal, False, scale=scale
            )[0]
        if backend == "flash":
            size = query.shape[-1]
            if scale is None:
                scale = size ** -0.5  # the original head size's scale, before padding
            if size % 8:  # pad_last_dim<8>: the kernel takes head sizes in steps of 8
                pad = 8 - size % 8
                query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
            out = ops._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :size] if size % 8 else out
        if backend == "efficient":
            if attn_mask is not None:
                attn_mask = _preprocess_mask(attn_mask, query, key)
            lse = _needs_logsumexp(query, key, value)
            return ops._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, lse, dropout_p, is_causal, scale=scale
            )[0]
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def jagged_attention(env: Environment, attention, args: tuple, kwargs: dict):
    """``F.scaled_dot_product_attention`` of nested jagged tensors: PyTorch's own jagged path
    (``torch.nested._internal.sdpa``: flash, then memory-efficient, then math, each kernel on the
    packed values), with its two device questions answered for the target: the kernel, by the
    target's rules as for dense attention and PyTorch's jagged checks; autocast, CUDA's (its own
    asks the tensors' device, meta here, and raises)."""
    from torch.nested._internal import sdpa as jagged
    from torch.nn.attention import SDPBackend

    def select(q, k, v, mask, dropout, causal, gqa):
        params = jagged.SDPAParams(q, k, v, mask, dropout, causal, gqa)
        if (torch.backends.cuda.flash_sdp_enabled() and env.sm((8, 0), (12, 1)) and q.size(-1) <= 256
                and _dtype_ok(q, k, v, _HALF) and jagged._can_use_flash_sdpa_jagged(params)):
            return SDPBackend.FLASH_ATTENTION
        allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if env.capability[0] >= 8 else ())
        if (torch.backends.cuda.mem_efficient_sdp_enabled() and env.sm((5, 0), (12, 1))
                and _dtype_ok(q, k, v, allowed) and jagged._can_use_efficient_sdpa_jagged(params)):
            return SDPBackend.EFFICIENT_ATTENTION
        if torch.backends.cuda.math_sdp_enabled() and jagged._can_use_math_sdpa_jagged(params):
            return SDPBackend.MATH
        return SDPBackend.ERROR

    def autocast(q, k, v, mask):
        if not torch.is_autocast_enabled("cuda"):
            return q, k, v, mask
        dtype = torch.get_autocast_dtype("cuda")
        cast = lambda x: x if x is None or not x.dtype.is_floating_point or x.dtype in (dtype, torch.float64) else x.to(dtype)  # noqa: E731
        return cast(q), cast(k), cast(v), cast(mask)

    saved = jagged._select_sdp_backend, jagged._autocast
    jagged._select_sdp_backend, jagged._autocast = select, autocast
    try:
        return attention(*args, **kwargs)
    finally:
        jagged._select_sdp_backend, jagged._autocast = saved


def _math(query, key, value, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool):
    """The math fallback (a composite of matmuls and a softmax), with its dropout as on CUDA.

    Its ``at::dropout`` is CUDA's fused kernel there (Dropout.cpp's
    is_fused_kernel_acceptable), which keeps a one-byte mask; on meta tensors
    the composite keeps a mask in the scores' dtype instead, four times as
    large in fp32: +96 MiB a layer for a T5-small encoder at 16 x 512 (3 x 32
    MiB), measured against an H200. The composite's own ``dropout_mask``
    argument (there for testing fused kernels) gives the fused kernel's saved
    tensors: a one-byte mask (its ``logical_not``) and the dropped scores. The
    mask passed in is a broadcast ``True``, one byte of storage; the values
    are the simulation's placeholders either way."""
    mask = None
    if dropout_p > 0.0:
        lead = query.shape[:-2] if enable_gqa else torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
        mask = torch.ones((), dtype=torch.bool, device=query.device).expand(*lead, query.shape[-2], key.shape[-2])
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, mask, scale=scale, enable_gqa=enable_gqa
    )[0]


# PyTorch warns (once) that a dropout mask is for testing: the mask is _math's, not the
# user's. A warning from C++ reaches Python where the user's outermost call returns, past
# any catch_warnings around the call here, hence a filter for that message alone.
warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing purposes")


def _local_cudnn() -> int | None:
    # The version from the library itself: torch.backends.cudnn.version() also checks every
    # visible GPU's capability, which initialises CUDA in this process, and a simulation
    # must leave it uninitialised (its plans run in forked processes: memprof.parallel).
    if not torch.version.cuda:
        return None
    try:
        return torch._C._cudnn.getVersionInt()
    except Exception:  # a CUDA build without a usable cuDNN
        return None


def _local_cuda() -> tuple[int, int] | None:
    if not torch.version.cuda:
        return None
    major, minor = torch.version.cuda.split(".")[:2]
    return int(major), int(minor)


def _requires_grad(q, k, v) -> bool:
    # input_requires_grad: any input requires grad and grad mode is on.
    return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()


def _dtype_ok(q, k, v, allowed) -> bool:
    return q.dtype == k.dtype == v.dtype and q.dtype in allowed


def _shapes_4d(q, k, v) -> bool:
    return q.dim() == k.dim() == v.dim() == 4


def _nonzero_lengths(q, k) -> bool:
    return q.shape[-2] != 0 and k.shape[-2] != 0


def _last_stride_one(q, k, v, mask, ignore_singleton: bool) -> bool:
    ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton:
        ok = ok or q.shape[-1] == 1
    return ok and (mask is None or mask.stride(-1) == 1)


def _batch_and_heads(q, k, v, gqa: bool, supports_gqa: bool, env: Environment, same_heads: bool = True) -> bool:
    # check_batch_size_and_num_heads_dense
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    grouped = hk == hv and hk != 0 and hq % hk == 0  # check_grouped_query_attention
    if gqa and supports_gqa:
        return grouped
    if env.newer and hk == hv == 1 and hq > 0:  # one shared key/value head
        return True
    if env.newer and not same_heads:
        return grouped
    return hq == hk == hv


def _mask_shape_cudnn(q, k, mask) -> bool:
    # check_attn_mask_shape
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask.shape[-2] not in (lq, 1) or mask.shape[-1] not in (lk, 1):
        return False
    if mask.dim() == 2:
        return True
    if mask.dim() == 4:
        return mask.shape[0] in (1, b) and mask.shape[1] in (1, h)
    return False


def _gemm_alignment(q, env: Environment) -> int:
    # minimum_gemm_alignment
    half = q.dtype in _HALF
    major = env.capability[0]
    use_tc = major >= 8 or (major >= 7 and half)
    align = 4 if major >= 8 else 1
    if use_tc:
        align = max(align, 128 // (16 if half else 32))
    return align


def _flash(q, k, v, mask, dropout, causal, gqa, env: Environment) -> bool:
    if not torch.backends.cuda.flash_sdp_enabled() or not _shapes_4d(q, k, v) or mask is not None:
        return False
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    if not env.sm((8, 0), (12, 1)):
        return False
    if _requires_grad(q, k, v) and (env.sm((8, 6), (8, 9)) or env.sm((12, 0), (12, 1))):
        if not (d <= 192 or (dropout == 0.0 and d > 224)):
            return False
    if causal and q.shape[-2] != k.shape[-2]:
        return False
    if not _dtype_ok(q, k, v, _HALF if env.capability[0] >= 8 else (torch.float16,)):
        return False
    return (
        _batch_and_heads(q, k, v, gqa, True, env)
        and _nonzero_lengths(q, k)
        and _last_stride_one(q, k, v, mask, ignore_singleton=True)
    )


def _efficient(q, k, v, mask, dropout, causal, gqa, env: Environment) -> bool:
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or not env.sm((5, 0), (12, 1)) or not _shapes_4d(q, k, v):
        return False
    dq, dv = q.shape[-1], v.shape[-1]
    align = _gemm_alignment(q, env)
    if not (dq == k.shape[-1] and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if env.newer and env.capability[0] >= 8:
        # check_data_ptr_alignment_mem_efficient: base pointers are 256-byte aligned, so the storage offset decides.
        step = align * q.element_size()
        if any(t.numel() and (t.storage_offset() * t.element_size()) % step for t in (q, k, v)):
            return False
    if not (
        _nonzero_lengths(q, k)
        and _last_stride_one(q, k, v, mask, ignore_singleton=False)
        and _batch_and_heads(q, k, v, gqa, env.newer, env)
    ):
        return False
    allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if env.capability[0] >= 8 else ())
    return _dtype_ok(q, k, v, allowed)


def _cudnn(q, k, v, mask, dropout, causal, gqa, env: Environment) -> bool:
    if env.cudnn < 90000:
        return False
    if dropout > 0.0 and 91100 < env.cudnn < 91400:
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled() or not _shapes_4d(q, k, v):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not _dtype_ok(q, k, v, _HALF if env.capability[0] >= 8 else (torch.float16,)):
        return False
    if not _mask_shape_cudnn(q, k, mask) or not env.sm((8, 0), (12, 1)):
        return False
    if env.newer and dropout * 16.0 != math.floor(dropout * 16.0):
        return False
    if not (
        _nonzero_lengths(q, k)
        and _last_stride_one(q, k, v, mask, ignore_singleton=True)
        and _batch_and_heads(q, k, v, gqa, True, env, same_heads=False)
    ):
        return False
    return _cudnn_shapes(q, k, v, dropout, env) and _cudnn_d256_backward(q, k, v, env)


def _sm90_or_10x(env: Environment) -> bool:
    major, minor = env.capability
    return (major == 9 and minor == 0) or major == 10


def _cudnn_shapes(q, k, v, dropout, env: Environment) -> bool:
    # check_cudnn_tensor_shapes
    b, h = q.shape[0], q.shape[1]
    if b > 65535 or h > 65535:
        return False
    s_q, s_k, d_qk, d_v = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if env.cudnn < 8903 or (env.cudnn < 8906 and dropout != 0.0):
        return False
    limit = 128
    if env.newer:
        unsupported_sm107 = env.capability == (10, 7) and env.cudnn <= 92500
        if _sm90_or_10x(env) and not unsupported_sm107 and env.cudnn > 92200:
            limit = 256
        elif _sm90_or_10x(env) and env.cudnn >= 91100 and d_qk == 192 and d_v == 128:
            limit = 192
    else:
        if env.cudnn >= 91000 and env.capability == (9, 0):  # Hopper: head sizes up to 256 from cuDNN 9.10
            limit = 256
        if env.cudnn >= 91100 and env.capability[0] == 10 and d_qk == 192 and d_v == 128:
            limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if env.cudnn < 8906 and s_k % 64:
        return False
    if env.cudnn < 90000 and (s_q < 64 or (dropout != 0.0 and (s_q % 64 or s_k % 64))):
        return False
    if s_k == 1 or (dropout != 0.0 and s_q == 1):
        return False
    return True


def _cudnn_d256_backward(q, k, v, env: Environment) -> bool:
    # check_cudnn_d256_bprop_head_dim (torch 2.14)
    if not env.newer or not _requires_grad(q, k, v):
        return True
    unsupported_sm107 = env.capability == (10, 7) and env.cudnn <= 92500
    if env.cudnn > 92200 and _sm90_or_10x(env) and not unsupported_sm107:
        d_qk, d_v = q.shape[3], v.shape[3]
        return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return True


_CHECKS = {"flash": _flash, "efficient": _efficient, "cudnn": _cudnn}


def usable_backends(q, k, v, mask, dropout: float, causal: bool, gqa: bool, gpu: Any) -> dict[str, bool]:
    """``torch.backends.cuda.can_use_{flash,efficient,cudnn}_attention`` for these inputs on ``gpu``."""
    env = gpu if isinstance(gpu, Environment) else Environment.of(gpu)
    return {name: check(q, k, v, mask, dropout, causal, gqa, env) for name, check in _CHECKS.items()}


def select_backend(q, k, v, mask, dropout: float, causal: bool, gqa: bool, gpu: Any) -> str:
    """The kernel ``select_sdp_backend`` picks: ``flash``, ``efficient``, ``cudnn`` or ``math``."""
    env = gpu if isinstance(gpu, Environment) else Environment.of(gpu)
    order = list(torch._C._get_sdp_priority_order())
    if order == _DEFAULT_ORDER and env.prefers_cudnn():
        # priority_order(): the first CUDA call puts cuDNN first on these GPUs.
        order = [3, 1, 2, 0, 4]
    for backend in order:
        name = _BACKEND_NAMES[backend]
        if name == "math":
            if torch.backends.cuda.math_sdp_enabled():
                return "math"
        elif name in _CHECKS and _CHECKS[name](q, k, v, mask, dropout, causal, gqa, env):
            return name
    raise RuntimeError(
        "no attention kernel is enabled for these inputs (torch.backends.cuda SDPA switches or sdpa_kernel): "
        "PyTorch would fail with 'No available kernel' on the GPU too"
    )


_cudnn_gqa: list[bool] = []


def _cudnn_gqa_on_meta() -> bool:
    """Whether this torch's meta kernels run cuDNN attention with grouped heads, forward and backward
    (torch 2.13 does; 2.11's backward cannot), asked once with tiny tensors.

    Asked under the simulation's device, as the attention would run, but
    apart from the caller's autograd context, which may be the first
    attention of a checkpointed block or of a ``no_grad`` region: the probe's
    saved tensors would otherwise join the block's (and break its
    recomputation's count), and its backward would fail for the context's
    sake, not the kernel's."""
    if not _cudnn_gqa:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            try:
                q = torch.empty(1, 4, 8, 8, dtype=torch.bfloat16, device="meta", requires_grad=True)
                kv = torch.empty(1, 2, 8, 8, dtype=torch.bfloat16, device="meta", requires_grad=True)
                out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kv, kv, None, True, 0.0, True, False)[0]
                torch.autograd.grad(out.sum(), (q, kv))
                _cudnn_gqa.append(True)
            except Exception:
                _cudnn_gqa.append(False)
    return _cudnn_gqa[0]


def _same(x):
    return x


class _CudnnGroupedAttention(torch.autograd.Function):
    """cuDNN attention with fewer key/value heads, where this torch's meta kernels cannot run it.

    Forward keeps what the kernel keeps (the output and a float32 log-sum-exp per
    query row); backward makes the query's gradient and the keys' and values' at
    the query's heads, then sums each group of heads, as the GPU was measured to
    (benchmarks/results/sdpa-choice-nvidia-h200.json, backward peaks).
    """

    @staticmethod
    def forward(ctx, q, k, v, lse):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        stats = q.new_empty(*q.shape[:-1], 1, dtype=torch.float32) if lse else None
        ctx.save_for_backward(q, k, v, out, *(() if stats is None else (stats,)))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        groups = q.shape[-3] // k.shape[-3]
        full = (*q.shape[:-1], k.shape[-1]), (*q.shape[:-1], v.shape[-1])
        dk, dv = (q.new_empty(shape).unflatten(-3, (k.shape[-3], groups)).sum(-3) for shape in full)
        return torch.empty_like(q), dk, dv, None


def _needs_logsumexp(q, k, v) -> bool:
    # should_compute_logsumexp: the backward needs it
    return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Memory-efficient attention's mask, as attention.cpp's preprocess_mask makes it: where its
    strides are not multiples of 8 elements (or its last is not 1), padded in its last dimension
    (pad_bias: to the next multiple of 8, then sliced back); then expanded to 4-D, a view. A mask
    broadcast over the heads stays one copy for all of them."""
    if not (mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])):
        last = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
