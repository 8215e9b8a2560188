"""Arguments and results of ATen operators, walked without pytree.

A dispatch mode sees every operator of a simulated step, so the walk over its
arguments is on the hot path. ATen schemas nest at most one level (``Tensor[]``,
``Tensor?[]``, tuples of results), which a plain loop covers at a fraction of
``torch.utils._pytree``'s cost.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.nested._internal.nested_tensor import NestedTensor as _NESTED
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

__all__ = ["PYTORCH_NAMESPACES", "leaves", "tensors", "map_leaves", "decomposes"]

#: Operator namespaces PyTorch's own kernels live in; others are a library's or a script's.
PYTORCH_NAMESPACES = frozenset(("aten", "prims", "_c10d_functional", "c10d", "_dtensor", "profiler"))


def leaves(*objs: Any) -> Iterator[Any]:
    """Every value in ``objs``, dicts' values and lists' and tuples' items one level down."""
    for obj in objs:
        for item in obj.values() if isinstance(obj, dict) else (obj if isinstance(obj, (list, tuple)) else (obj,)):
            if isinstance(item, (list, tuple)):
                yield from item
            else:
                yield item


def tensors(*objs: Any) -> list[torch.Tensor]:
    """The tensors among :func:`leaves`."""
    return [t for t in leaves(*objs) if isinstance(t, torch.Tensor)]


def map_leaves(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every leaf (one level of lists, tuples and dicts)."""
    if isinstance(obj, dict):
        return {k: map_leaves(fn, v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_leaves(fn, v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_leaves(fn, v) for v in obj)
    return fn(obj)


def decomposes(types: tuple[type, ...]) -> bool:
    """Whether a dispatch mode should hand the call to a tensor subclass among ``types``
    (returning ``NotImplemented``) so that the operators it runs on its inner tensors come
    back to the mode one by one, as PyTorch's FakeTensorMode does for any subclass it does
    not know (``_check_for_subclass``): a DTensor's handler allocates local tensors the
    wrapped call never shows (loss_parallel's cross-entropy backward makes four of the
    logits' size), and its collectives run on them. A nested jagged tensor is not handed
    over: the simulation follows it as one (memprof.sdpa's jagged attention, its kernels'
    workspaces)."""
    return any(is_traceable_wrapper_subclass_type(t) and t is not _NESTED for t in types)
