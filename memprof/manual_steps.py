"""Training steps that no optimizer ends: a loop that updates the parameters itself.

pytorch/examples' word language model and regression example, and the
tutorials that teach ``p -= lr * p.grad``, train without a ``torch.optim``
optimizer, whose ``step()`` is where memprof otherwise sees a step end. Such
a loop has a moment of its own: the model's next forward after a backward
reached its parameters, with their gradients reset since. An optimizer's
loop would have stepped by then, and a micro-batch of gradient accumulation
leaves the gradients as backward made them (the next micro-batch adds to
them), so neither is taken for a step.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .hooks import Shared

__all__ = ["GradientWatch"]


class GradientWatch:
    """Watches the gradients of ``model``'s trainable parameters until :meth:`remove`."""

    def __init__(self, model: nn.Module) -> None:
        on_grad = Shared(self._on_grad)
        self._handles = [p.register_post_accumulate_grad_hook(on_grad)
                         for p in model.parameters() if p.requires_grad]
        # The gradient backward last accumulated: (parameter, gradient, its version), weakly.
        self._last: tuple[weakref.ref, weakref.ref, int] | None = None

    @property
    def trainable(self) -> bool:
        """Whether the model has parameters that take gradients."""
        return bool(self._handles)

    def _on_grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:  # a hook before this one took it: an optimizer stepped in backward (torchtune's)
            return
        self._last = weakref.ref(p), weakref.ref(g), g._version

    def stepped(self) -> bool:
        """Whether a backward reached the parameters since this last answered True, and their
        gradients were reset after it: set to None or replaced (``zero_grad()``), or changed
        in place (``zero_grad(set_to_none=False)``, ``p.grad.zero_()``, or clipping right
        before the update). An update through ``p.data`` leaves the gradient as it was."""
        if self._last is None:
            return False
        p, g, version = self._last[0](), self._last[1](), self._last[2]
        if p is None or not (p.grad is None or p.grad is not g or p.grad._version != version):
            return False
        self._last = None
        return True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._last = None
