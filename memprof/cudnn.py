"""The memory layout cuDNN's convolutions work in, and the copies it takes to get there.

On a GPU a convolution runs in the layout ``cudnn_conv_suggest_memory_format``
picks (aten/src/ATen/native/ConvUtils.h): channels-last where the input or the
weight is (4-D, not double), else contiguous. Its output and gradients are
made in that layout, and an input, weight or incoming gradient in the other
layout is copied into it for the kernel's run (``.contiguous(format)`` in
``_convolution``, ``cudnn_convolution`` and their backward). PyTorch's meta
kernel for a convolution on meta tensors knows no cuDNN and answers in the
contiguous layout, so a channels-last network's activations lost their
layout in the simulation, and with it what depends on it (a channels-last
mean's reduction staging, measured on the H200 at 128 MiB, needs it).
The layouts are checked on the H200 (benchmarks/results/conv-layout-h200.jsonl);
the copies follow from the source and are not measured apart.

The workspace. With ``torch.backends.cudnn.benchmark`` off PyTorch runs the
first plan of cuDNN's heuristics and takes that plan's workspace from its
caching allocator for the call (aten/src/ATen/native/cudnn/Conv_v8.cpp,
``run_conv_plan``); only cuDNN knows a plan's workspace. Measured on the H200
(cuDNN 9.19; benchmarks/conv_workspace.py, results/conv-workspace-h200.jsonl:
the convolutions of 15 corpus scripts and a grid, 979 calls), the plans follow
one physical rule: cuDNN's tensor-core engines (16-bit, or fp32 as TF32) work
channels-last, and a convolution in the contiguous layout has its input, weight
and output transposed into the workspace, the input's channels padded to a
multiple of 8 in 16-bit. A 1 x 1 convolution of stride 1 runs as a matrix
product on the contiguous layout, a channels-last one needs no transposition,
and fp32 with channels not a multiple of 4 runs engines without tensor cores:
none of these takes a workspace. The backward runs two cuDNN calls, the
input's gradient then the weight's, each with a workspace of its own, and each
copies an operand not in the call's layout first (``.contiguous(layout)``).
What the rule leaves out, measured: the weight gradient's split-K buffer
(0-18 MiB mostly; 1.3 GiB once, a 3 x 3 convolution to 32 channels), engines
that write the output in place (the rule's transposed output then over by its
size), and most tiny-channel first layers, whose engines vary (fp32 stems of 7 x 7 or more
transpose their operands as above, unpadded).
"""

from __future__ import annotations

import torch

__all__ = ["CONVOLUTIONS", "channels_last_like", "cudnn_layout", "cudnn_workspace", "tf32_allowed"]

_ops = torch.ops.aten
CONVOLUTIONS = {_ops.convolution.default, _ops.convolution_backward.default}


def channels_last_like(t: torch.Tensor) -> bool:
    """``TensorImpl::is_strides_like_channels_last`` for a 4-D tensor (c10's
    is_channels_last_strides_2d_s4), ``is_strides_like_channels_last_3d`` for a 5-D one
    (is_channels_last_strides_3d_s5): ambiguous cases (size-1 dimensions) as C++ decides them."""
    if t.dim() not in (4, 5):
        return False
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in ((1, 3, 2, 0) if t.dim() == 4 else (1, 4, 3, 2, 0)):
        if sizes[d] == 0 or strides[d] < low:
            return False
        if d == 0 and low == strides[1]:
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def cudnn_layout(func, args: tuple, out) -> tuple[object, tuple[int, ...], list[tuple[int, ...]]]:
    """``out`` remade in the layouts a GPU gives it, the bytes of the operand copies held for
    the whole call (a forward's), and the blocks of each cuDNN call in turn: its copies and
    its workspace (:func:`cudnn_workspace`).

    As measured on the H200 for fp32 and bf16, ordinary and depthwise (16 cases): the output
    is channels-last where the input or the weight is; the input's gradient takes the input's
    layout, the weight's gradient the weight's (contiguous for a depthwise convolution, which
    runs PyTorch's own kernel)."""
    forward = func is _ops.convolution.default
    x, w = (args[0], args[1]) if forward else (args[1], args[2])
    stride, padding, transposed, groups = (args[3], args[4], args[6], args[8]) if forward else (
        args[4], args[5], args[7], args[9])
    # cudnn_conv_suggest_memory_format: ChannelsLast for a 4-D weight, ChannelsLast3d for a 5-D one
    channels_last = w.dim() in (4, 5) and torch.float64 not in (x.dtype, w.dtype) and (
        channels_last_like(x) or channels_last_like(w))
    depthwise = groups > 1 and groups == x.shape[1] and w.shape[1] == 1
    y = out if forward else args[0]
    workspace = cudnn_workspace(x, w, y, stride, padding, transposed, groups, channels_last)

    def copies(*operands: torch.Tensor) -> tuple[int, ...]:
        # cuDNN runs on its layout and copies what is not in it (_convolution, cudnn_convolution
        # and their backward: .contiguous(backend_memory_format)); a depthwise convolution
        # channels-last takes its operands as they are.
        if channels_last and depthwise:
            return ()
        off = (lambda t: not channels_last_like(t)) if channels_last else (lambda t: not t.is_contiguous())
        return tuple(t.numel() * t.element_size() for t in operands if t.numel() > 1 and off(t))

    if forward:
        return (_relaid(out, True) if channels_last else out), copies(x, w), [(workspace,)]
    grad_input, grad_weight, grad_bias = out
    if channels_last:
        out = (_relaid(grad_input, channels_last_like(x)),
               _relaid(grad_weight, channels_last_like(w) and not depthwise), grad_bias)
    mask = args[10]
    calls = [(*copies(y, w), workspace)] if mask[0] else []
    if mask[1]:
        calls.append((*copies(y, x), workspace))
    return out, (), calls


def cudnn_workspace(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, stride, padding, transposed: bool,
                    groups: int, channels_last: bool) -> int:
    """The workspace of one cuDNN call of a convolution with input ``x``, weight ``w`` and output
    ``y`` (or their gradients), by the rule measured on the H200 (module docstring)."""
    tensor_cores = x.dtype in (torch.float16, torch.bfloat16) or (
        x.dtype == torch.float32 and tf32_allowed(conv=True))
    depthwise = groups > 1 and groups == x.shape[1] and w.shape[1] == 1
    pointwise = all(k == 1 for k in w.shape[2:]) and all(s == 1 for s in stride) and not any(padding)
    if channels_last or depthwise or pointwise or not tensor_cores or not torch.backends.cudnn.enabled:
        return 0
    source, result = (y, x) if transposed else (x, y)  # a transposed convolution is another's backward
    channels = w.shape[1]  # the source's channels per group
    multiple = 4 if x.dtype == torch.float32 else 8
    if x.dtype == torch.float32 and channels % multiple:
        # Without tensor-core alignment most engines take no workspace, but a 2-D stem of 7 x 7 or
        # more (ResNet's 7 x 7 over 3 channels) runs one that transposes input, weight and output
        # unpadded, for the forward and the weight's gradient alike: measured on the H200 for 64
        # and 256 images of 224 px (232.79 and 931.04 MiB); 4 x 4 and 3-D stems take none.
        if w.dim() == 4 and min(w.shape[2:]) >= 7 and groups == 1 and not transposed:
            return (x.numel() + w.numel() + y.numel()) * x.element_size()
        return 0
    padded = -(-channels // multiple) * multiple
    size = x.element_size()
    return (source.numel() // channels * padded + w.numel() // channels * padded + result.numel()) * size


def _relaid(t: torch.Tensor | None, channels_last: bool) -> torch.Tensor | None:
    if t is None or t.dim() not in (4, 5) or channels_last_like(t) == channels_last:
        return t
    layout = (torch.channels_last if t.dim() == 4 else torch.channels_last_3d) if channels_last else torch.contiguous_format
    return torch.empty_like(t, memory_format=layout)


def tf32_allowed(conv: bool) -> bool:
    """Whether PyTorch runs float32 convolutions (cuDNN) or matrix products (cuBLAS) on TF32 tensor
    cores now. Read through ``fp32_precision`` where torch has it ("none" defers to the level above:
    cudnn.conv to cudnn to torch.backends): once a script used that API (PyTorch's documented one),
    the older ``allow_tf32`` raises ("mix of the legacy and new APIs"), which stopped the simulation."""
    backends = torch.backends
    if not hasattr(backends, "fp32_precision"):  # before the fp32_precision API
        return backends.cudnn.allow_tf32 if conv else backends.cuda.matmul.allow_tf32
    levels = (backends.cudnn.conv, backends.cudnn, backends) if conv else (backends.cuda.matmul, backends)
    precision = next((level.fp32_precision for level in levels if level.fp32_precision != "none"), "ieee")
    return precision == "tf32"
