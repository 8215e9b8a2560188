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
"""

from __future__ import annotations

import torch

__all__ = ["CONVOLUTIONS", "channels_last_like", "cudnn_layout"]

_ops = torch.ops.aten
CONVOLUTIONS = {_ops.convolution.default, _ops.convolution_backward.default}


def channels_last_like(t: torch.Tensor) -> bool:
    """``TensorImpl::is_strides_like_channels_last`` for a 4-D tensor (c10's
    is_channels_last_strides_2d_s4): ambiguous cases (size-1 dimensions) as C++ decides them."""
    if t.dim() != 4:
        return False
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < low:
            return False
        if d == 0 and low == strides[1]:
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def cudnn_layout(func, args: tuple, out) -> tuple[object, list[int]]:
    """``out`` remade in the layouts a GPU gives it, and the bytes of the copies the call takes
    for its kernel's run (operands in the other layout than cuDNN's).

    As measured on the H200 for fp32 and bf16, ordinary and depthwise (16 cases): the output
    is channels-last where the input or the weight is; the input's gradient takes the input's
    layout, the weight's gradient the weight's (contiguous for a depthwise convolution, which
    runs PyTorch's own kernel)."""
    forward = func is _ops.convolution.default
    x, w = (args[0], args[1]) if forward else (args[1], args[2])
    groups = args[8] if forward else args[9]
    if w.dim() != 4 or torch.float64 in (x.dtype, w.dtype):
        return out, []
    x_cl, w_cl = channels_last_like(x), channels_last_like(w)
    if not (x_cl or w_cl):
        return out, []
    depthwise = groups > 1 and groups == x.shape[1] and w.shape[1] == 1
    # cuDNN works channels-last here and copies what is not (_convolution, cudnn_convolution
    # and their backward: .contiguous(backend_memory_format)).
    operands = (x, w) if forward else (args[0], x, w)
    copies = [] if depthwise else [t.untyped_storage().nbytes() for t in operands
                                   if not channels_last_like(t) and t.numel() > 1]
    if forward:
        return _relaid(out, True), copies
    grad_input, grad_weight, grad_bias = out
    return (_relaid(grad_input, x_cl), _relaid(grad_weight, w_cl and not depthwise), grad_bias), copies


def _relaid(t: torch.Tensor | None, channels_last: bool) -> torch.Tensor | None:
    if t is None or t.dim() != 4 or channels_last_like(t) == channels_last:
        return t
    return torch.empty_like(t, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
