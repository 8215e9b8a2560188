"""Arguments and results of ATen operators, walked without pytree.

A dispatch mode sees every operator of a simulated step, so the walk over its
arguments is on the hot path. ATen schemas nest at most one level (``Tensor[]``,
``Tensor?[]``, tuples of results), which a plain loop covers at a fraction of
``torch.utils._pytree``'s cost.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

__all__ = ["leaves", "tensors", "map_leaves"]


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
