"""Trainer integrations, installed as ``memprof.callbacks``.

Each integration is imported when first used, so ``import memprof.callbacks``
does not import its trainer library: ``MemprofCallback`` (Lightning) needs
``pip install lightning`` or ``pip install "memprof[lightning]"``;
``MemprofTrainerCallback`` (Hugging Face ``Trainer``) needs
``pip install transformers`` or ``pip install "memprof[hf]"``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hf import MemprofTrainerCallback
    from .lightning import MemprofCallback

__all__ = ["MemprofCallback", "MemprofTrainerCallback"]

# attribute -> submodule that defines it
_LAZY = {"MemprofCallback": ".lightning", "MemprofTrainerCallback": ".hf"}


def __getattr__(name: str) -> Any:
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(submodule, __name__), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
