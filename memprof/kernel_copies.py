"""The blocks CUDA's softmax and layer norm kernels take for their run, which PyTorch's meta
kernels leave out.

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

Each block is taken after the kernel's output and given back when it returns.
"""

from __future__ import annotations

import torch

__all__ = ["COPYING", "kernel_copies"]

_ops = torch.ops.aten
_SOFTMAXES = {_ops._softmax.default, _ops._log_softmax.default, _ops._softmax_backward_data.default,
              _ops._log_softmax_backward_data.default}
_LAYER_NORMS = {_ops.native_layer_norm.default: 0, _ops.native_layer_norm_backward.default: 1}  # the input's place
COPYING = _SOFTMAXES | set(_LAYER_NORMS)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kernel_copies(func, args: tuple) -> tuple[int, ...]:
    """The bytes of the blocks the operator ``func`` (of :data:`COPYING`) takes for its run, all alive at once."""
    if func in _LAYER_NORMS:
        x = args[_LAYER_NORMS[func]]
        return () if x.is_contiguous() else (_bytes(x),)
    if func in (_ops._softmax.default, _ops._log_softmax.default):
        x = args[0]
        return () if x.is_contiguous() else (_bytes(x),)
    grad, output = args[0], args[1]
    blocks = []
    if func is _ops._softmax_backward_data.default:
        blocks.append(grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize)  # tmp, contiguous
    elif not grad.is_contiguous():
        blocks.append(_bytes(grad))
    if not output.is_contiguous():
        blocks.append(_bytes(output))
    return tuple(blocks)
