"""Hooks that copies of a module share.

``copy.deepcopy(model)`` inside a tracked run (an EMA, a teacher, the best
weights so far, ``AveragedModel``) copies the module's hooks with it, and
the copy of a bound method is a copy of its object: memprof's tracker, which
holds what cannot be copied (generators, weak references), so the copy failed
("cannot pickle 'generator' object"). A :class:`Shared` hook is its own copy:
the copied module calls the same tracker, which ignores modules it does not
track. Pickled (``torch.save(model)``), it becomes a hook that does nothing.

Module hooks also run inside PyTorch's transforms, which they cannot follow:
torch.compile's Dynamo inlines them into the graph it traces, torch.func's
``vmap``/``grad`` hand them wrapped tensors without storages of their own,
and a CUDA graph's capture forbids what they do on the device (reading the
allocator, recording events: "operation not permitted when stream is
capturing"). :func:`transformed` says when: hooks then do nothing, and the
transformed call is attributed as a whole, from the calls around it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Shared", "transformed", "in_torch_func"]

_interpreters = torch._C._functorch.peek_interpreter_stack


def transformed() -> bool:
    """Whether the caller runs inside torch.compile's tracing, a torch.func transform or a CUDA
    graph's capture."""
    return (torch.compiler.is_compiling() or _interpreters() is not None
            or torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def in_torch_func() -> bool:
    """Whether the caller runs inside a torch.func transform (``vmap``, ``grad``), not in
    torch.compile's tracing (which traces through this check)."""
    return not torch.compiler.is_compiling() and _interpreters() is not None


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class Shared:
    """``fn`` as a module or tensor hook that copies of the module or tensor share."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "Shared":
        return self

    def __reduce__(self) -> tuple:
        return Shared, (_nothing,)
