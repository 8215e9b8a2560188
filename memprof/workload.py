"""A training step in parts that memory strategies can change.

``memprof.track`` takes any training loop as it is. To *change* a step
(autocast it, split its batch, checkpoint its blocks) the advisor needs its
parts: the model, the optimizer, one batch, and how a loss is computed from
a batch. ``Workload.step()`` is then the plain loop every strategy adjusts::

    for micro_batch in split(batch, micro_batches):
        with autocast, saved_tensors_hooks:
            loss = loss_fn(model, micro_batch) / micro_batches
        (scaler.scale(loss) if scaler else loss).backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

__all__ = ["Workload", "split_batch"]


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut into ``parts`` micro-batches along dimension 0 (tensors,
    and tensors inside tuples, lists and dicts; anything else is shared)."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % parts:
            n = batch.shape[0] if batch.dim() else "no"
            raise ValueError(
                f"a batch of {n} sample{'' if n == 1 else 's'} cannot be split into {parts} equal "
                f"micro-batches; choose a number of micro-batches that divides the batch size"
            )
        return list(batch.chunk(parts))
    if isinstance(batch, dict):
        cols = {k: split_batch(v, parts) for k, v in batch.items()}
        return [type(batch)({k: cols[k][i] for k in batch}) for i in range(parts)]
    if isinstance(batch, (list, tuple)):
        cols = [split_batch(v, parts) for v in batch]
        return [type(batch)(c[i] for c in cols) for i in range(parts)]
    return [batch] * parts


@dataclass
class Workload:
    """One training step: ``loss_fn(model, batch)`` then backward and an optimizer step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    #: Set by strategies.
    autocast_dtype: torch.dtype | None = None
    scaler: Any = None
    micro_batches: int = 1
    saved_tensors_hooks: Callable[[], ContextManager] | None = None
    #: Strategies applied so far, by name, in order.
    applied: list[str] = field(default_factory=list)
    #: Set by a simulation: called before micro-batch ``i`` of ``n`` (from 0),
    #: returns how many micro-batches from ``i`` on need not run because they
    #: would repeat earlier ones exactly.
    repeats: Callable[[int, int], int] | None = field(default=None, repr=False)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def step(self) -> torch.Tensor | None:
        """One optimizer step over the whole batch; returns the last micro-batch's loss
        (None in a simulation: there every micro-batch lets its loss go, so that the
        last is one more like the others, which it may replay: ``repeats``)."""
        parts = split_batch(self.batch, self.micro_batches)
        device_type = _device_type(self.model, self.batch)
        i, last = 0, None
        while i < len(parts):
            if self.repeats is not None:
                i += self.repeats(i, len(parts))
                if i == len(parts):
                    break
            part = parts[i]
            amp = (
                torch.autocast(device_type, dtype=self.autocast_dtype)
                if self.autocast_dtype is not None
                else contextlib.nullcontext()
            )
            hooks = self.saved_tensors_hooks() if self.saved_tensors_hooks is not None else contextlib.nullcontext()
            with amp, hooks:
                loss = self.loss_fn(self.model, part) / len(parts)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            i += 1
            if i == len(parts) and self.repeats is None:
                last = loss.detach()
            del loss  # each micro-batch starts from the same tensors
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return last

    # -- trying strategies ---------------------------------------------------------
    def patch(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, undone by :meth:`plan`'s exit (a strategy's change to the model).

        A module's attribute is set in its ``__dict__``, as ``nn.Module.__setattr__`` sets a
        function: a wrapper's own ``__setattr__`` (Lightning Fabric's ``_FabricModule`` passes
        it on to the module it wraps) would set it on another module too."""
        if isinstance(obj, nn.Module):
            own = obj.__dict__
            if name in own:
                old = own[name]
                self._undo.append(lambda: own.__setitem__(name, old))
            else:  # e.g. a method: without the instance attribute the class's is found again
                self._undo.append(lambda: own.pop(name, None))
            own[name] = value
            return
        if name in getattr(obj, "__dict__", {}):
            old = obj.__dict__[name]
            self._undo.append(lambda: setattr(obj, name, old))
        else:  # e.g. a method: deleting the instance attribute brings the class's back
            self._undo.append(lambda: delattr(obj, name))
        setattr(obj, name, value)

    @contextlib.contextmanager
    def plan(self, strategies, simulated: bool = False):
        """Apply ``strategies`` (``apply_simulated`` on a simulated GPU) for the
        ``with`` block, then undo them: the workload's settings come back and
        every :meth:`patch` is reverted, last first."""
        settings = {f: getattr(self, f) for f in _SETTINGS}
        applied, undo = list(self.applied), len(self._undo)
        try:
            for s in strategies:
                (s.apply_simulated if simulated else s.apply)(self)
            yield self
        finally:
            while len(self._undo) > undo:
                self._undo.pop()()
            for f, v in settings.items():
                setattr(self, f, v)
            self.applied[:] = applied


_SETTINGS = ("autocast_dtype", "scaler", "micro_batches", "saved_tensors_hooks")


def _device_type(model: nn.Module, batch: Any) -> str:
    """The device type the step computes on, for autocast: the first device
    other than the host's among the batch's tensors, the model's buffers and
    its parameters, in that order. The parameters come last because FSDP2's
    CPU offload keeps them on the host while the step computes on the GPU
    (an autocast for the parameters' device would then be the CPU's, and the
    GPU would compute in fp32)."""
    from torch.utils._pytree import tree_leaves

    tensors = (t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
    for t in itertools.chain(tensors, model.buffers(), model.parameters()):
        if t.device.type != "cpu":
            # On a simulated GPU the tensors are meta tensors, and autocast is CUDA's.
            return "cuda" if t.device.type == "meta" else t.device.type
    return "cpu"
