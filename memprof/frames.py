"""The modules a training script holds, found through its running frames.

A loop's frames say what the script works with beyond the model it trains:
a model trained through its methods (``model.score(u, i)``), and the other
models it keeps on the device (a frozen VAE and text encoder, a teacher, a
reference model, an EMA copy, an EMA's shadow parameters), each under the name
the script gives it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
import weakref
from types import FrameType
from typing import Any

import torch
from torch import nn

__all__ = ["script_modules", "script_variables"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_MEMPROF_DIR = os.path.dirname(os.path.abspath(__file__))


def script_variables(frame: FrameType | None) -> list[tuple[str, Any]]:
    """The values the frames of the script's code hold, from ``frame`` outwards, each
    once, with the name it is held by there: their local variables (a script's top
    level: its globals), for a method its object's attributes (a trainer's
    ``self.model``), and one level into the other objects they hold (an EMA helper's
    ``ema.shadow_params``, a pipeline's ``pipe.vae``). PyTorch's and memprof's own
    frames are skipped."""
    found: dict[int, tuple[str, Any]] = {}  # by identity, for this call only: the values are held
    while frame is not None:
        code = frame.f_code.co_filename
        if not code.startswith(_TORCH_DIR) and not code.startswith(_MEMPROF_DIR):
            values = _locals(frame)
            owner = dict(values).get("self")
            if _plain(owner):
                values += list(vars(owner).items())
            for name, v in values:
                if type(v) in _PROXIES:  # Lightning's proxies of its trainer: what they stand for is held elsewhere
                    continue
                found.setdefault(id(v), (name, v))
                if _plain(v):
                    for attr, a in list(vars(v).items()):
                        if type(a) not in _PROXIES:
                            found.setdefault(id(a), (f"{name}.{attr}", a))
        frame = frame.f_back
    return list(found.values())


def script_modules(frame: FrameType | None) -> list[tuple[str, nn.Module]]:
    """The modules among :func:`script_variables`."""
    return [(n, v) for n, v in script_variables(frame) if isinstance(v, nn.Module)]


def _plain(v: Any) -> bool:
    """Whether ``v`` is an object of the script's whose attributes are worth a look: not a
    module, tensor, class, imported module or function, and with attributes of its own."""
    return (v is not None and not isinstance(v, _OPAQUE) and isinstance(getattr(v, "__dict__", None), dict))


# weakref.proxy objects pass isinstance checks for what they stand for, but cannot be weakly referenced.
_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
_OPAQUE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, functools.partial)


def _locals(frame: FrameType) -> list[tuple[str, object]]:
    """A frame's local variables, leaving nothing of them held.

    Before Python 3.13 (PEP 667) a function's ``frame.f_locals`` is a snapshot
    that the frame keeps until it is read again: every value in it would stay
    alive after the script deletes or rebinds its variable (a step's logits,
    a model deleted to free the GPU). Where nothing but the frame holds the
    snapshot (no ``locals()`` result kept by the script), it is emptied after
    reading; a function's code never reads it (its variables are the frame's
    fast locals), and ``locals()`` or a tracer fills it again from them."""
    snapshot = frame.f_locals
    items = list(snapshot.items())
    # The frame, this function's variable and getrefcount's argument.
    if sys.version_info < (3, 13) and frame.f_code.co_flags & inspect.CO_OPTIMIZED and sys.getrefcount(snapshot) == 3:
        snapshot.clear()
    return items
