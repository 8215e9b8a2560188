"""CUDA autocast's op policy, for running it where CUDA is only simulated.

Autocast casts at the dispatcher level and only for CUDA tensors, so on the
meta tensors of a simulation it does nothing. memprof applies the same policy
one level up, on the torch functions a training step calls, with the op lists
of PyTorch's "Autocast Op Reference" (CUDA) and aten/src/ATen/autocast_mode.h.
Casts go through ``Tensor.to``, so autograd records them as autocast's do and
backward keeps the same dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["LOWER_PRECISION", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE", "TORCHVISION_FP32", "AutocastPolicy"]

# The lists of aten/src/ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE), named as
# the torch functions that reach them: Python operators (``__matmul__``,
# ``__pow__``) and the composites whose only work is a listed op
# (``nll_loss_nd`` is how F.nll_loss and cross-entropy reach ``nll_loss``; ``square`` is ``at::pow(self, 2)``,
# UnaryOps.cpp: a ReLU² MLP's square runs in float32 under autocast, measured on the H200).

#: Ops that run in the autocast dtype (fp16 or bf16).
LOWER_PRECISION = frozenset(
    """
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution
    prelu addmm addmv addr matmul __matmul__ __rmatmul__ einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell
    rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    """.split()
)

#: Ops that run in float32.
FP32 = frozenset(
    """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ __rpow__ square softplus
    layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss nll_loss2d nll_loss_nd hinge_embedding_loss kl_div l1_loss smooth_l1_loss
    huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
    _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
    upsample_bicubic2d _upsample_bicubic2d_aa
    """.split()
)

#: float32 ops with an optional ``dtype`` argument: autocast sets it to float32
#: unless the caller did (and only when the first argument is eligible).
FP32_SET_OPT_DTYPE = frozenset(
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum".split()
)

#: Ops that run in the widest floating dtype among their arguments.
PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
)


#: torchvision's ops with an autocast kernel of their own (torchvision/csrc/ops/autocast/): their
#: floating inputs cast to float32, the op run without autocast, the output cast back to the
#: input's dtype (nms returns indices).
TORCHVISION_FP32 = frozenset("roi_align ps_roi_align roi_pool ps_roi_pool deform_conv2d nms".split())


def _eligible(t: Any, device_type: str) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == device_type
        and t.is_floating_point()
        and t.dtype is not torch.float64
    )


class AutocastPolicy:
    """Apply CUDA autocast's policy to a torch function call on ``device_type`` tensors.

    Casts of parameters (leaf tensors that require grad) are cached, and
    held, until :meth:`clear` (when the outermost autocast region ends), as
    autocast does: a weight used twice is cast once, and under activation
    checkpointing, where no op saves the copies for backward, the cache alone
    keeps every block's low-precision weights alive until the forward ends.
    """

    def __init__(self, device_type: str = "meta") -> None:
        self.device_type = device_type
        self._cache = WeakTensorKeyDictionary()

    def clear(self) -> None:
        """Drop the cached casts (``torch.clear_autocast_cache()``)."""
        self._cache = WeakTensorKeyDictionary()

    def __call__(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """New ``(args, kwargs)`` for this call under CUDA autocast, or None to leave it alone."""
        if not torch.is_autocast_enabled("cuda") or name.endswith("_") and not name.endswith("__"):
            return None
        low = torch.get_autocast_dtype("cuda")
        if name in LOWER_PRECISION:
            return self._cast(low, args, kwargs)
        if name in FP32:
            return self._cast(torch.float32, args, kwargs)
        if name in FP32_SET_OPT_DTYPE:
            if kwargs.get("dtype") is None and args and _eligible(args[0], self.device_type):
                return args, {**kwargs, "dtype": torch.float32}
            return None
        if name in PROMOTE:
            floats = [t for t in _flat(args, kwargs) if _eligible(t, self.device_type)]
            if floats and any(t.dtype is torch.float32 for t in floats):
                return self._cast(torch.float32, args, kwargs)
            return self._cast(low, args, kwargs) if floats else None
        return None

    def torchvision(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Call torchvision's op ``func`` (one of :data:`TORCHVISION_FP32`) as its autocast kernel does."""
        dtype = args[0].dtype
        args, kwargs = self._cast(torch.float32, args, kwargs)
        with torch.autocast("cuda", enabled=False):
            out = func(*args, **kwargs)
        return out if func.__name__ == "nms" or not out.is_floating_point() else out.to(dtype)

    def _cast(self, dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(t: Any) -> Any:
            if not _eligible(t, self.device_type) or t.dtype is dtype:
                return t
            # autocast_mode.cpp's can_try_cache: a float32 leaf that requires grad, not a view. The cast is
            # cached with its history even where made under no_grad (PyTorch makes it with grad enabled):
            # a no_grad forward, then a training one, in one autocast region still reach the weight.
            if (t.is_leaf and t.requires_grad and t.dtype is torch.float32 and not t._is_view()
                    and torch.is_autocast_cache_enabled() and not torch.is_inference_mode_enabled()):
                hit = self._cache.get(t)
                if hit is not None:
                    cached, version = hit
                    if cached.dtype is dtype and version == t._version:
                        return cached
                with torch.enable_grad():
                    out = t.to(dtype)
                self._cache[t] = (out, t._version)
                return out
            return t.to(dtype)

        return tree_map(cast, args), tree_map(cast, kwargs)


def _flat(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def cross_entropy_loss(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """``torch._C._nn.cross_entropy_loss`` as aten/src/ATen/native/LossNLL.cpp composes it.

    It is a C++ composite, so on a GPU autocast meets the ops inside it:
    ``log_softmax`` is called with the input's own dtype (autocast leaves it),
    ``nll_loss`` is on the float32 list (autocast casts its input, and the
    float32 copy is what backward keeps). Called from Python with the
    simulated device's mode on, the same torch functions meet the same policy.
    ``reduction``: 0 none, 1 mean, 2 sum (at::Reduction).
    """
    class_dim = 0 if input.dim() == 1 else 1
    logp = torch.log_softmax(input, class_dim, dtype=input.dtype)
    if target.is_floating_point():  # class probabilities
        classes = input.shape[class_dim]
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / classes
        terms = logp * target
        if weight is not None:
            terms = terms * _along(weight, input, class_dim)
        loss = -terms.sum(class_dim)
        if reduction == 1:
            return loss.sum() / (input.numel() / classes)
        return loss.sum() if reduction == 2 else loss
    nll = torch._C._nn.nll_loss_nd(logp, target, weight, reduction, ignore_index)
    if label_smoothing <= 0:
        return nll
    ignored = target == ignore_index
    smooth = -(logp * _along(weight, input, class_dim)).sum(class_dim) if weight is not None else -logp.sum(class_dim)
    smooth = smooth.masked_fill(ignored, 0.0)
    if reduction == 1:
        if weight is not None:
            smooth = smooth.sum() / weight.gather(0, target.masked_select(~ignored).flatten()).sum()
        else:
            smooth = smooth.sum() / (~ignored).sum()
    elif reduction == 2:
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / input.shape[class_dim])


def _along(weight, input, class_dim):
    shape = [1] * input.dim()
    shape[class_dim] = weight.shape[0]
    return weight.view(shape)
