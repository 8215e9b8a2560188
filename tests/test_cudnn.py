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


def test_a_3d_convolution_in_channels_last_3d_runs_in_it():
    """cudnn_conv_suggest_memory_format picks ChannelsLast3d for a 5-D weight when the input or the
    weight is channels_last_3d (a video model's ``model.to(memory_format=torch.channels_last_3d)``):
    the output is in that layout and nothing is copied, as for a 2-D convolution (it was run as a
    contiguous one: each call copied its operands). 2 x 64 x 8 x 28 x 28 bf16: 3,136 KiB in, 7,056 out."""
    with VirtualCUDA(H200, allocator=SimulatedAllocator(H200)):
        conv = nn.Conv3d(64, 144, (1, 3, 3), padding=(0, 1, 1), bias=False).cuda().to(
            dtype=torch.bfloat16, memory_format=torch.channels_last_3d)
        x = torch.randn(2, 64, 8, 28, 28, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last_3d)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            y = conv(x)
        assert y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous()
        assert torch.cuda.max_memory_allocated() - before == y.untyped_storage().nbytes() == 2 * 144 * 8 * 28 * 28 * 2


@pytest.mark.parametrize("shape, strides, expected", [
    ((8, 64, 32, 32), (65536, 1, 2048, 64), True),   # channels-last
    ((8, 64, 32, 32), (65536, 1024, 32, 1), False),  # contiguous
    ((128, 64, 1, 1), (64, 1, 64, 64), True),        # a 1 x 1 weight made channels-last: C++ says so
    ((8, 1, 1, 1), (1, 1, 1, 1), False),             # N111: ambiguous, contiguous by default
    ((8, 64, 32), (2048, 1, 64), False),             # neither 4-D nor 5-D
    ((2, 64, 4, 8, 8), (16384, 1, 4096, 512, 64), True),  # channels_last_3d
    ((2, 64, 4, 8, 8), (16384, 256, 64, 8, 1), False),    # contiguous 5-D
])
def test_channels_last_like_follows_c10(shape, strides, expected):
    t = torch.empty_strided(shape, strides, device="meta")
    assert channels_last_like(t) is expected


WORKSPACES = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "conv-workspace-h200.jsonl"


def _measured_calls() -> list[dict]:
    return [r for r in map(json.loads, WORKSPACES.read_text().splitlines()) if not r["benchmark"]]


def _simulated_peaks(rows: list[dict]) -> list[int]:
    """Each measured call run on the simulated H200 with its operands' shapes, strides and dtypes:
    the most the call's own requests (outputs, copies, workspaces, as the allocator's history
    counts them) held at once."""
    peaks = []
    allocator = SimulatedAllocator(H200)
    with VirtualCUDA(H200, allocator=allocator):
        for r in rows:
            args = [torch.empty_strided(a["shape"], a["stride"], dtype=getattr(torch, a["dtype"]), device="cuda")
                    if isinstance(a, dict) else a for a in r["args"]]
            allocator.events = []
            out = getattr(torch.ops.aten, r["op"]).default(*args)
            sizes, live, peak = {}, 0, 0
            for event in allocator.events:
                if event[0] == "m":
                    sizes[event[1]] = event[2]
                    live += sizes[event[1]]
                    peak = max(peak, live)
                elif event[0] == "f":
                    live -= sizes.pop(event[1])
            allocator.events = None
            peaks.append(peak)
            del out, args
    return peaks


@pytest.mark.parametrize("entry, op, x_shape, w_shape, dtype, measured_peak", [
    # output 24.5 MiB + workspace 49.07 MiB (input 24.5, weight 0.07, output 24.5)
    ("grid", "convolution", [64, 64, 56, 56], [64, 64, 3, 3], "bfloat16", 77_144_211),
    # 4 x 4, stride 2: output 64 MiB + workspace 194 MiB
    ("grid", "convolution", [256, 128, 32, 32], [256, 128, 4, 4], "float32", 270_532_755),
    # PPO's first convolution over 2048 Atari frames: output 200 MiB + workspace 420.56 MiB
    ("ppo-agent", "convolution", [2048, 4, 84, 84], [64, 4, 8, 8], "float32", 650_706_960),
    # a spectral-norm DCGAN's discriminator, backward: input gradient 32 MiB, then each call's
    # workspace (176 MiB; the weight gradient's 16 MiB is alive with the second)
    ("dcgan-specnorm", "convolution_backward", [128, 1024, 8, 8], [2048, 1024, 4, 4], "float32", 352_321_683),
    # latent diffusion's UNet under fp16 autocast, backward: each call's workspace 114.58 MiB
    ("latent-diffusion", "convolution_backward", [16, 672, 64, 64], [224, 672, 3, 3], "float16", 210_939_920),
    # ResNet's fp32 stem, 7 x 7 over 3 channels (not a multiple of 4): output 196 MiB + workspace
    # 232.79 MiB, its input, weight and output transposed unpadded
    ("grid", "convolution", [64, 3, 224, 224], [64, 3, 7, 7], "float32", 449_614_608),
])
def test_a_contiguous_convolution_takes_cudnns_transposition_workspace(entry, op, x_shape, w_shape, dtype,
                                                                       measured_peak):
    """cuDNN's tensor-core engines run channels-last: a convolution in the contiguous layout has
    its input, weight and output transposed into the workspace, which the H200 measured (the
    call's peak: its output and the workspace; a backward's input gradient then the weight's
    call). Within 1 %: cuDNN aligns the workspace's parts and adds a few bytes of its own. (Where
    the weight gradient's call takes a split-K buffer besides, the simulation is below by it:
    DCGAN's 4 x 4 discriminator 8 MiB, module docstring of memprof.cudnn.)"""
    x_at = 0 if op == "convolution" else 1
    row = next(r for r in _measured_calls() if r["entry"] == entry and r["op"] == op
               and r["args"][x_at]["shape"] == x_shape and r["args"][x_at + 1]["shape"] == w_shape
               and r["args"][x_at]["dtype"] == dtype and r["args"][x_at]["stride"][-1] == 1)
    assert row["peak"] == measured_peak
    (simulated,) = _simulated_peaks([row])
    assert simulated == pytest.approx(measured_peak, rel=0.01)


def test_a_non_contiguous_gradient_is_copied_for_each_cudnn_call():
    """The CTC model's first convolution (fp32, one input channel: no tensor-core engine, no
    workspace) gets a transposed gradient from the layer norm after it: the input gradient's call
    is not asked for, the weight's copies the gradient (188,219,392 B) and the transposed input
    (23,527,424 B) for its run. Measured on the H200, within the bias gradient's reduction's
    few bytes (2,176 B measured, 2,048 simulated)."""
    row = next(r for r in _measured_calls() if r["entry"] == "ctc-speech" and r["op"] == "convolution_backward"
               and r["args"][1]["shape"] == [32, 1, 128, 1436])
    assert row["args"][10][0] is False and row["peak"] == 211_747_968
    (simulated,) = _simulated_peaks([row])
    assert simulated == pytest.approx(211_747_968, abs=1024)


def test_the_convolutions_of_the_corpus_and_the_grid():
    """All 979 measured calls (heuristics mode): the call's peak within 8 MiB for at least 78 %
    of them (34 % with no workspace simulated) and the median error under 1 MiB (18 MiB)."""
    rows = _measured_calls()
    errors = sorted(abs(s - r["peak"]) for s, r in zip(_simulated_peaks(rows), rows))
    assert len(rows) == 979
    assert sum(e < 8 << 20 for e in errors) >= 0.78 * len(rows)
    assert errors[len(errors) // 2] < 1 << 20
