"""The blocks CUDA's softmax and layer norm kernels and torchvision's deformable convolution
take for their run, which the meta kernels leave out.

From aten/src/ATen/native/cuda/SoftMax.cu:

* ``host_softmax`` (softmax and log-softmax forward) runs on ``input_.contiguous()``:
  a non-contiguous input (``logits[:, :-1].log_softmax(-1)``, a softmax over a
  dimension of a transposed tensor) is copied first;
* ``host_softmax_backward`` runs on ``grad_.contiguous()`` and ``output_.contiguous()``;
* ``softmax_backward_cuda_out`` first makes ``tmp = grad * output`` (the product's
  dtype, every element) and hands it over as the gradient.

From aten/src/ATen/native/cuda/layer_norm_kernel.cu: ``layer_norm_cuda`` and
``layer_norm_backward_cuda`` run on ``input.expect_contiguous()``: a LayerNorm over a
transposed input (wav2vec 2.0's feature encoder: a convolution's output transposed to put
channels last) is copied, in forward and again in backward (autograd saves the input as it
was given). The gradient reaches the backward contiguous already (derivatives.yaml's
``grad.contiguous()``, an operator of its own).

From torchvision/csrc/ops/cuda/deform_conv2d_kernel.cu: the deformable convolution works on
blocks of ``n`` images, the largest divisor of the batch up to ``kMaxParallelImgs`` (32).
Forward zero-fills ``out`` and ``out_buf`` (the output's size each) and ``columns`` (the
im2col matrix: in_channels x kh x kw rows of n x out_h x out_w), and returns ``out + bias``.
Backward (``backward_gradient_inputs``) takes ``columns`` and, block by block, copies the
output gradient's block (permuted: ``flatten(1)`` cannot view it) for its product; then
(``backward_gradient_parameters``) the output gradient permuted ``.contiguous()`` and
``columns`` again.

Each block is taken after the kernel's output and given back when it returns.
"""

from __future__ import annotations

import torch

__all__ = ["kernel_copies", "takes_copies"]

_ops = torch.ops.aten
_SOFTMAXES = {_ops._softmax.default, _ops._log_softmax.default, _ops._softmax_backward_data.default,
              _ops._log_softmax_backward_data.default}
_LAYER_NORMS = {_ops.native_layer_norm.default: 0, _ops.native_layer_norm_backward.default: 1}  # the input's place
_COPYING = _SOFTMAXES | set(_LAYER_NORMS)
#: torchvision's deformable convolution, by operator name: where its input is among the arguments.
_DEFORMABLE = {"deform_conv2d": 0, "_deform_conv2d_backward": 1}
_MAX_PARALLEL_IMGS = 32  # kMaxParallelImgs


def takes_copies(func) -> bool:
    """Whether the operator ``func`` takes blocks of its own for its run (:func:`kernel_copies`)."""
    return func in _COPYING or func.namespace == "torchvision" and func._opname in _DEFORMABLE


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kernel_copies(func, args: tuple) -> list[tuple[int, ...]]:
    """The bytes of the blocks the operator ``func`` (:func:`takes_copies`) takes for its run:
    one tuple of blocks alive at once per stage of the run, stages in turn."""
    if func in _LAYER_NORMS:
        x = args[_LAYER_NORMS[func]]
        return [() if x.is_contiguous() else (_bytes(x),)]
    if func in (_ops._softmax.default, _ops._log_softmax.default):
        x = args[0]
        return [() if x.is_contiguous() else (_bytes(x),)]
    if func not in _COPYING:
        return _deformable(func._opname, args)
    grad, output = args[0], args[1]
    blocks = []
    if func is _ops._softmax_backward_data.default:
        blocks.append(grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize)  # tmp, contiguous
    elif not grad.is_contiguous():
        blocks.append(_bytes(grad))
    if not output.is_contiguous():
        blocks.append(_bytes(output))
    return [tuple(blocks)]


def _deformable(name: str, args: tuple) -> list[tuple[int, ...]]:
    """torchvision's deformable convolution's blocks (module docstring)."""
    first = _DEFORMABLE[name]
    x, weight, offset = args[first], args[first + 1], args[first + 2]
    groups = args[first + 11]  # n_weight_grps, after the mask, the bias, the strides, pads and dilations
    batch, in_channels = x.shape[:2]
    out_channels, _, kh, kw = weight.shape
    out_h, out_w = offset.shape[2:]
    n = max(d for d in range(1, min(batch, _MAX_PARALLEL_IMGS) + 1) if batch % d == 0)
    size = x.element_size()
    output = batch * out_channels * out_h * out_w * size
    columns = in_channels * kh * kw * n * out_h * out_w * size
    if name == "deform_conv2d":
        return [(output, output, columns)]
    block = out_channels // groups * n * out_h * out_w * size if n > 1 else 0
    return [(columns, block), (output, columns)]
