"""Input combinations for scaled-dot-product attention's kernel choice.

One deterministic grid, shared by ``benchmarks/sdpa_choice.py`` (which asks
PyTorch on a GPU what it would pick) and ``tests/test_sdpa_cuda.py`` (which
checks memprof's rule against PyTorch's own ``can_use_*`` functions). Each case
varies what ``sdp_utils.cpp`` looks at: dtype, head dimensions, grouped
heads and ``enable_gqa``, masks (none, boolean or float, 2-D, 4-D, broadcast,
requiring grad), causal, dropout, sequence lengths, strides and storage
offsets, and whether the inputs require grad.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

__all__ = ["Case", "cases", "make"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    dim_qk: int
    dim_v: int
    mask: str  # none, bool2d, float2d, bool4d, float4d, float_b1, float_11, float_grad, bool_bhls
    causal: bool
    dropout: float
    gqa: bool
    grad: bool
    layout: str  # contiguous, bshd (transposed from batch, seq, heads, dim), offset (misaligned start), last_stride

    def to_dict(self) -> dict:
        return asdict(self)


def cases(n: int = 600, seed: int = 0) -> list[Case]:
    """``n`` distinct cases, the same for every call with the same seed."""
    rng = random.Random(seed)
    out: dict[Case, None] = {}
    heads = [(8, 8), (8, 2), (8, 1), (6, 4), (4, 4), (16, 4)]
    lens = [(128, 128), (256, 256), (127, 127), (1, 128), (128, 256), (64, 64), (200, 200), (2048, 2048)]
    dims = [(64, 64), (128, 128), (80, 80), (96, 96), (60, 60), (8, 8), (4, 4), (192, 128), (192, 192), (256, 256),
            (288, 288), (64, 128), (36, 36)]
    masks = ["none"] * 4 + ["bool2d", "float2d", "bool4d", "float4d", "float_b1", "float_11", "float_grad", "bool_bhls"]
    while len(out) < n:
        hq, hk = rng.choice(heads)
        lq, lk = rng.choice(lens)
        dq, dv = rng.choice(dims)
        mask = rng.choice(masks)
        causal = mask == "none" and rng.random() < 0.5
        case = Case(
            dtype=rng.choice(list(_DTYPES)),
            batch=rng.choice([1, 2, 4]),
            heads_q=hq,
            heads_kv=hk,
            len_q=lq,
            len_kv=lk,
            dim_qk=dq,
            dim_v=dv,
            mask=mask,
            causal=causal,
            dropout=rng.choice([0.0, 0.0, 0.0, 0.1, 0.0625]),
            gqa=hq != hk and rng.random() < 0.8,
            grad=rng.random() < 0.7,
            layout=rng.choice(["contiguous", "contiguous", "bshd", "offset", "last_stride"]),
        )
        out[case] = None
    return list(out)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str, layout: str, grad: bool) -> torch.Tensor:
    b, h, s, d = shape
    if layout == "bshd":  # as produced by view(B, S, H, D).transpose(1, 2)
        t = torch.zeros(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)
    elif layout == "offset":  # one element in: storage_offset 1
        t = torch.zeros(b * h * s * d + 1, dtype=dtype, device=device)[1:].view(b, h, s, d)
    elif layout == "last_stride":  # last dimension not contiguous
        t = torch.zeros(b, h, s, d, 2, dtype=dtype, device=device)[..., 0]
    else:
        t = torch.zeros(b, h, s, d, dtype=dtype, device=device)
    return t.requires_grad_(grad) if grad else t


def make(case: Case, device: str = "cuda"):
    """(query, key, value, attn_mask) for ``case`` on ``device``."""
    dtype = _DTYPES[case.dtype]
    q = _tensor((case.batch, case.heads_q, case.len_q, case.dim_qk), dtype, device, case.layout, case.grad)
    k = _tensor((case.batch, case.heads_kv, case.len_kv, case.dim_qk), dtype, device, case.layout, case.grad)
    v = _tensor((case.batch, case.heads_kv, case.len_kv, case.dim_v), dtype, device, case.layout, case.grad)
    b, hq, lq, lk = case.batch, case.heads_q, case.len_q, case.len_kv
    shapes = {
        "bool2d": ((lq, lk), torch.bool),
        "float2d": ((lq, lk), dtype),
        "bool4d": ((b, 1, lq, lk), torch.bool),
        "float4d": ((b, 1, lq, lk), dtype),
        "float_b1": ((b, 1, 1, lk), dtype),
        "float_11": ((1, 1, lq, lk), dtype),
        "float_grad": ((b, 1, lq, lk), dtype),
        "bool_bhls": ((b, hq, lq, lk), torch.bool),
    }
    mask = None
    if case.mask != "none":
        shape, mdtype = shapes[case.mask]
        mask = torch.ones(shape, dtype=mdtype, device=device)
        if case.mask == "float_grad":
            mask.requires_grad_(True)
    return q, k, v, mask
