"""memprof.cudnn: convolution layouts on the simulated GPU, against the H200's.

benchmarks/results/conv-layout-h200.jsonl: for fp32 and bf16, ordinary and
depthwise 3 x 3 convolutions, every pair of input and weight layouts, the
layouts of the output and of both gradients that PyTorch 2.11 gave on an H200.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from memprof.cudnn import channels_last_like
from memprof.devices import get_gpu
from memprof.simulate import SimulatedAllocator
from memprof.virtual_cuda import VirtualCUDA

MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "conv-layout-h200.jsonl"
H200 = get_gpu("h200")


def _cl(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def test_layouts_agree_with_the_h200():
    rows = [json.loads(line) for line in MEASURED.read_text().splitlines()]
    assert len(rows) == 16
    with VirtualCUDA(H200, allocator=SimulatedAllocator(H200)):
        for r in rows:
            dtype = getattr(torch, r["dtype"].split(".")[1])
            conv = nn.Conv2d(64, 64, 3, padding=1, groups=r["groups"]).cuda().to(dtype)
            if r["weight"] == "channels_last":
                conv = conv.to(memory_format=torch.channels_last)
            x = torch.randn(8, 64, 32, 32, device="cuda", dtype=dtype)
            if r["input"] == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(True)
            y = conv(x)
            y.backward(torch.ones_like(y))
            got = {"out_cl": _cl(y), "grad_input_cl": _cl(x.grad), "grad_weight_cl": _cl(conv.weight.grad)}
            assert got == {k: r[k] for k in got}, r


def test_an_input_in_the_other_layout_is_copied_for_the_kernel():
    """cuDNN works channels-last when the weight is, and copies a contiguous input into that
    layout for the kernel's run: 8 x 64 x 32 x 32 fp32, 2 MiB, over the output's 2 MiB."""
    with VirtualCUDA(H200, allocator=SimulatedAllocator(H200)):
        conv = nn.Conv2d(64, 64, 3, padding=1, bias=False).cuda().to(memory_format=torch.channels_last)
        for layout, copy in ((torch.contiguous_format, 2 << 20), (torch.channels_last, 0)):
            x = torch.randn(8, 64, 32, 32, device="cuda").contiguous(memory_format=layout)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.no_grad():
                y = conv(x)
            assert torch.cuda.max_memory_allocated() - before == y.untyped_storage().nbytes() + copy


@pytest.mark.parametrize("shape, strides, expected", [
    ((8, 64, 32, 32), (65536, 1, 2048, 64), True),   # channels-last
    ((8, 64, 32, 32), (65536, 1024, 32, 1), False),  # contiguous
    ((128, 64, 1, 1), (64, 1, 64, 64), True),        # a 1 x 1 weight made channels-last: C++ says so
    ((8, 1, 1, 1), (1, 1, 1, 1), False),             # N111: ambiguous, contiguous by default
    ((8, 64, 32), (2048, 1, 64), False),             # not 4-D
])
def test_channels_last_like_follows_c10(shape, strides, expected):
    t = torch.empty_strided(shape, strides, device="meta")
    assert channels_last_like(t) is expected
