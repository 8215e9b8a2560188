"""Operators on meta tensors, run once per signature.

A simulated step runs every operator's meta kernel, and most of those are
Python references (``torch._refs``, ``torch._prims``) that cost tens of
microseconds each. A model repeats itself: the twelve blocks of GPT-2 run the
same operators on the same shapes, and the advisor runs the same step for
many plans. A meta kernel's result depends only on its inputs' metadata and
its other arguments, so for an operator that makes fresh outputs (no view, no
in-place write, no output shape read from values) the outputs' shapes,
strides and dtypes, and the kernel's arithmetic and bytes, are kept by
signature and the next call with the same signature makes empty outputs of
that layout directly.

An in-place operator (``add_``, the optimizers' ``_foreach_lerp_``) writes
into its inputs and returns them: once its signature has run, the next call
returns the written inputs and the kept cost without running the kernel
(a meta kernel only checks shapes, and the same metadata passes the same
checks).

What is not kept: views and operators that change their input's metadata
(``resize_``, ``t_``: PyTorch tags them ``inplace_view``), ``out=`` variants
(they may resize ``out``), operators that touch the host's tensors (a data
pipeline computes real values), operators whose output shape depends on
values, and any output that does not own a whole, fresh storage.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .aten_args import leaves, map_leaves

__all__ = ["KernelCache", "PLAIN_TENSORS", "Signature"]

#: A call's cache key: the operator, then its arguments' metadata.
Signature = tuple

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNCACHEABLE = object()
#: Tensors that are their own storage's owners (a subclass may wrap others, as a DTensor does).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_META = torch.device("meta")


def _cacheable_op(func) -> bool | tuple[int, ...]:
    """True where ``func`` always makes fresh outputs from its inputs' metadata
    alone; for an operator that only writes into positional inputs and returns
    them, the positions it returns; else False."""
    if getattr(func, "is_view", False):
        return False
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return False
    schema = func._schema
    aliased = [a for a in schema.arguments if a.alias_info is not None]
    if not aliased:
        return bool(schema.returns) and all(r.alias_info is None for r in schema.returns)
    if torch.Tag.inplace_view in tags or "resize" in schema.name:  # changes its input's metadata
        return False
    if any(not a.alias_info.is_write or a.kwarg_only for a in aliased):
        return False  # a view, or out=
    written = {a.name: i for i, a in enumerate(schema.arguments) if a.alias_info is not None}
    sets = {frozenset(a.alias_info.before_set): written[a.name] for a in aliased}
    positions = tuple(sets.get(frozenset(r.alias_info.before_set)) if r.alias_info else None for r in schema.returns)
    return False if None in positions else positions


def _arg_key(a: Any):
    if isinstance(a, torch.Tensor):
        if a.device != _META or type(a) not in PLAIN_TENSORS or a.layout is not torch.strided:
            # The host's own tensor (its values matter), a subclass (a DTensor: a cached
            # result would come back as a plain tensor), or a sparse one (no strides).
            return _UNCACHEABLE
        return (a.dtype, tuple(a.shape), a.stride())
    if isinstance(a, (list, tuple)):
        keys = tuple(_arg_key(x) for x in a)
        return _UNCACHEABLE if any(k is _UNCACHEABLE for k in keys) else (type(a), keys)
    if isinstance(a, _PLAIN):
        return (type(a), a)  # 1 and 1.0 and True are different arguments
    return _UNCACHEABLE


class KernelCache:
    """Outputs' layouts (and the kernel's cost) of meta operators, by :data:`Signature`.

    ``run(func, args, kwargs, cost)`` returns the operator's result and the
    value of ``cost(func, args, kwargs, out)``, computed once per signature.
    """

    def __init__(self) -> None:
        self._ops: dict[Any, bool | tuple[int, ...]] = {}
        self._entries: dict[Signature, Any] = {}
        self.hits = self.misses = 0

    def signature(self, func, args: tuple, kwargs: dict) -> Signature | None:
        cacheable = self._ops.get(func)
        if cacheable is None:
            cacheable = self._ops[func] = _cacheable_op(func)
        if cacheable is False:
            return None
        # A factory's dtype may come from the default dtype.
        key = [func, torch.get_default_dtype()]
        for a in leaves(args):
            k = _arg_key(a)
            if k is _UNCACHEABLE:
                return None
            key.append(k)
        for name, a in kwargs.items():
            k = _arg_key(a)
            if k is _UNCACHEABLE:
                return None
            key.append((name, k))
        return tuple(key)

    def run(self, func, args: tuple, kwargs: dict, cost: Callable[..., Any]) -> tuple[Any, Any]:
        key = self.signature(func, args, kwargs)
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry is not _UNCACHEABLE:
            self.hits += 1
            layout, value = entry
            if isinstance(layout, _Written):
                out = tuple(args[i] for i in layout.positions)
                return (out[0] if len(out) == 1 else out or None), value
            return map_leaves(_rebuild, layout), value
        self.misses += 1
        out = func(*args, **kwargs)
        value = cost(func, args, kwargs, out)
        positions = self._ops[func]
        if key is not None and entry is None and isinstance(positions, tuple):  # in place
            self._entries[key] = (_Written(positions), value) if len(args) > max(positions, default=-1) else _UNCACHEABLE
        elif key is not None and entry is None:
            # Some operators alias an input without saying so in their schema (aten._unsafe_view).
            inputs = {t.untyped_storage()._cdata for t in leaves(args, kwargs) if isinstance(t, torch.Tensor)}
            layout = _layout(out, inputs)
            self._entries[key] = _UNCACHEABLE if layout is None else (layout, value)
        return out, value


class _Written:
    """An in-place operator's result: the inputs at ``positions``."""

    __slots__ = ("positions",)

    def __init__(self, positions: tuple[int, ...]) -> None:
        self.positions = positions


class _Fresh:
    """An output tensor's layout: one that owns its storage exactly."""

    __slots__ = ("shape", "stride", "dtype")

    def __init__(self, shape: tuple, stride: tuple, dtype: torch.dtype) -> None:
        self.shape, self.stride, self.dtype = shape, stride, dtype


def _layout(out: Any, inputs: set):
    """``out`` with each tensor replaced by its :class:`_Fresh` layout, or None
    when an output cannot be rebuilt from its layout alone (``inputs``: the
    inputs' storages)."""
    seen = set(inputs)
    ok = True

    def one(t: Any):
        nonlocal ok
        if isinstance(t, torch.Tensor):
            if (t.device != _META or type(t) not in PLAIN_TENSORS or t.layout is not torch.strided
                    or t.storage_offset() != 0 or t.requires_grad):
                ok = False
                return None
            storage = t.untyped_storage()
            fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
            # Two outputs sharing a storage, or a storage larger than the layout, cannot be rebuilt.
            if storage.nbytes() != fresh.untyped_storage().nbytes() or storage._cdata in seen:
                ok = False
            seen.add(storage._cdata)
            return _Fresh(tuple(t.shape), t.stride(), t.dtype)
        if not isinstance(t, (int, float, bool, type(None))):
            ok = False
        return t

    layout = map_leaves(one, out)
    return layout if ok else None


def _rebuild(x: Any) -> Any:
    if isinstance(x, _Fresh):
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=_META)
    return x
