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

__all__ = ["LOWER_PRECISION", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE", "AutocastPolicy"]

#: Ops that run in the autocast dtype (fp16 or bf16).
LOWER_PRECISION = frozenset(
    """
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution
    prelu addmm addmv addr matmul __matmul__ __rmatmul__ einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    scaled_dot_product_attention _scaled_dot_product_attention
    """.split()
)

#: Ops that run in float32.
FP32 = frozenset(
    """
    __pow__ __rdiv__ __rpow__ __rtruediv__ acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt
    sinh tan pow softplus layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
    smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
    cross_entropy norm normalize
    """.split()
)

#: float32 ops with an optional ``dtype`` argument: autocast sets it to float32
#: unless the caller did (and only when the first argument is eligible).
FP32_SET_OPT_DTYPE = frozenset("prod softmax log_softmax cumprod cumsum sum softmin".split())

#: Ops that run in the widest floating dtype among their arguments.
PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot grid_sampler grid_sample index_put scatter_add tensordot cat stack vdot".split()
)


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

    def _cast(self, dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(t: Any) -> Any:
            if not _eligible(t, self.device_type) or t.dtype is dtype:
                return t
            if t.is_leaf and t.requires_grad and torch.is_autocast_cache_enabled():
                hit = self._cache.get(t)
                if hit is not None:
                    cached, version = hit
                    if cached.dtype is dtype and version == t._version:
                        return cached
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
