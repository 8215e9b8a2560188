"""Expandable segments: PyTorch's caching allocator grows one segment per pool
page by page instead of making a segment per large request, so free space left
between blocks of different sizes can be reused (Note [Expandable Segments],
c10/cuda/CUDACachingAllocator.cpp). It does not always reserve less: pages are
20 MiB in the large pool, and a 32 MiB tensor at a segment's end maps 40 MiB.

It changes no operator and costs no time in a steady step (mapping pages is
slower than ``cudaMalloc`` once, when the segment grows); what it changes is
``memory_reserved``, which is what decides whether a step fits. PyTorch's own
out-of-memory message suggests it when "reserved but unallocated memory is
large"; the advisor offers it for the plans whose allocated memory fits the
budget but whose reserved memory does not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from memprof.caching import expandable_segments_configured
from memprof.workload import Workload

from .base import Door, Strategy

__all__ = ["ExpandableSegments"]

_SETTING = "expandable_segments:True"


class ExpandableSegments(Strategy):
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: the allocator's setting for the whole
    run, in effect before the model is built (:meth:`building`)."""

    name = "expandable"
    # The build's own blocks (weights, optimizer state) must be laid out in the expandable
    # segments too: a plan with it gets a build of its own.
    revertible = False

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """The setting while a workload or a script is built and run: in the environment PyTorch
        reads at CUDA's initialisation (a script's simulated allocator reads it at its first
        allocation) and, where CUDA already runs (or is simulated), set on its allocator for the
        segments made from now on (``torch.cuda.memory._set_allocator_settings``). Both are put
        back afterwards."""
        saved = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        name = "PYTORCH_CUDA_ALLOC_CONF" if saved["PYTORCH_CUDA_ALLOC_CONF"] is not None or \
            saved["PYTORCH_ALLOC_CONF"] is None else "PYTORCH_ALLOC_CONF"
        os.environ[name] = ",".join(filter(None, [saved[name], _SETTING]))  # the last setting wins
        live = torch.cuda.is_available() and torch.cuda.is_initialized()
        if live:
            _set_allocator_settings(_SETTING)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if live:
                _set_allocator_settings(f"expandable_segments:{expandable_segments_configured()}")

    def apply(self, workload: Workload) -> None:
        # Nothing in the step changes; the setting is :meth:`building`'s, before the build.
        workload.applied.append(self.name)

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        Door.of(door)
        return ("start training with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment (or "
                "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True' before CUDA starts): the "
                "allocator grows its segments in pages instead of reserving one per large request")


def _set_allocator_settings(settings: str) -> None:
    """The running allocator's settings: ``torch._C._accelerator_setAllocatorSettings`` where torch has it
    (``torch.cuda.memory._set_allocator_settings`` calls it, with a deprecation warning), else the latter."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)
