"""Ask PyTorch on a GPU which attention kernel it picks, and what the kernel allocates.

    python3 benchmarks/sdpa_choice.py --out benchmarks/results

Writes ``sdpa-choice-<gpu>.json``: the software and hardware facts the choice
depends on (torch, CUDA, cuDNN, compute capability, the backends' priority
order), for every case of ``benchmarks/sdpa_cases.py`` PyTorch's own answers
(``can_use_flash_attention``, ``can_use_efficient_attention``,
``can_use_cudnn_attention``, ``_fused_sdp_choice``) next to memprof's
(``memprof.sdpa.select_backend``), and for a few attention shapes the
operators a forward and backward run and the memory they take.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_cases import cases, make  # noqa: E402

_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable", -1: "error"}


def torch_answers(case) -> dict:
    q, k, v, mask = make(case)
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, case.dropout, case.causal, case.gqa)
    choice = torch._fused_sdp_choice(q, k, v, mask, case.dropout, case.causal, scale=None, enable_gqa=case.gqa)
    return {
        "flash": bool(torch.backends.cuda.can_use_flash_attention(params)),
        "efficient": bool(torch.backends.cuda.can_use_efficient_attention(params)),
        "cudnn": bool(torch.backends.cuda.can_use_cudnn_attention(params)),
        "choice": _NAMES.get(int(choice), str(choice)),
    }


def memprof_answers(case, gpu) -> dict | None:
    try:
        from memprof.sdpa import select_backend, usable_backends
    except ImportError:
        return None
    q, k, v, mask = make(case, "meta")
    usable = usable_backends(q, k, v, mask, case.dropout, case.causal, case.gqa, gpu)
    return {**usable, "choice": select_backend(q, k, v, mask, case.dropout, case.causal, case.gqa, gpu)}


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        shapes = [[list(t.shape), str(t.dtype)] for t in flat if isinstance(t, torch.Tensor)]
        self.ops.append([str(func), shapes])
        return out


def trace(b, hq, hk, l, d, dtype, causal, mask, gqa) -> dict:
    q = torch.randn(b, hq, l, d, dtype=dtype, device="cuda", requires_grad=True)
    k = torch.randn(b, hk, l, d, dtype=dtype, device="cuda", requires_grad=True)
    v = torch.randn(b, hk, l, d, dtype=dtype, device="cuda", requires_grad=True)
    m = torch.ones(b, 1, l, l, dtype=torch.bool, device="cuda") if mask else None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    log = _OpLog()
    with log:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)
    fwd_peak = torch.cuda.max_memory_allocated() - base
    after_fwd = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    with log:
        out.sum().backward()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    return {
        "shape": dict(batch=b, heads_q=hq, heads_kv=hk, length=l, dim=d, dtype=str(dtype), causal=causal,
                      mask=mask, gqa=gqa),
        "forward_peak": fwd_peak, "after_forward": after_fwd, "backward_peak": bwd_peak, "ops": log.ops,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--cases", type=int, default=600)
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    try:
        from memprof.devices import detect_gpu

        gpu = detect_gpu()
    except ImportError:
        gpu = None
    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": props.name,
        "capability": [props.major, props.minor],
        "priority_order": [int(b) for b in torch._C._get_sdp_priority_order()],
        "flash_enabled": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient_enabled": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
        "math_enabled": torch.backends.cuda.math_sdp_enabled(),
        "fp16_bf16_reduction_math": torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(),
        "props": {k: str(getattr(props, k)) for k in dir(props) if not k.startswith("_")},
    }
    rows = []
    agree = 0
    for case in cases(args.cases):
        row = {"case": case.to_dict(), "torch": torch_answers(case)}
        mine = memprof_answers(case, gpu) if gpu is not None else None
        if mine is not None:
            row["memprof"] = mine
            agree += mine == row["torch"]
        rows.append(row)
    traces = [
        trace(4, 16, 4, 2048, 64, dt, causal, mask, True)
        for dt in (torch.float32, torch.bfloat16)
        for causal, mask in ((True, False), (False, True))
    ] + [
        trace(4, 16, 16, 2048, 64, dt, causal, mask, False)
        for dt in (torch.float32, torch.bfloat16, torch.float16)
        for causal, mask in ((True, False), (False, True))
    ] + [  # cuDNN attention's backward across sizes: what it takes beyond its outputs
        trace(b, h, kv, l, d, torch.bfloat16, True, False, kv != h)
        for b, h, l, d in ((1, 16, 2048, 64), (4, 16, 4096, 64), (4, 32, 2048, 128), (8, 12, 1024, 64), (2, 16, 2048, 128))
        for kv in (h, h // 4)
    ]
    result = {"facts": facts, "cases": rows, "agree": agree, "traces": traces}
    name = props.name.replace(" ", "-").lower()
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / f"sdpa-choice-{name}.json"
    path.write_text(json.dumps(result, indent=1))
    choices = {}
    for r in rows:
        choices[r["torch"]["choice"]] = choices.get(r["torch"]["choice"], 0) + 1
    print(json.dumps(facts, indent=1)[:3000])
    print("choices:", choices, "memprof agrees:", agree, "of", len(rows))
    print("wrote", path)


if __name__ == "__main__":
    main()
