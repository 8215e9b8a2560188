"""Gradient accumulation: k micro-batches, one optimizer step, the same effective batch."""

from __future__ import annotations

from memprof.coupling import what_changes
from memprof.workload import Workload

from .base import Door, Strategy

__all__ = ["Accumulation"]


class Accumulation(Strategy):
    """Run the batch as ``k`` micro-batches of 1/k each and accumulate gradients.

    Activation memory divides by about k; each micro-batch's loss is divided
    by k, so the gradients equal the full batch's (up to float rounding) where
    each sample's loss depends on that sample alone: not with batch norm in
    training mode, in-batch pairs or other statistics of the batch
    (:meth:`changes`).
    """

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or k < 2:
            raise ValueError(f"micro-batches must be an integer >= 2, got {k!r}")
        self.k = k
        self.name = f"accum{k}"

    def apply(self, workload: Workload) -> None:
        workload.micro_batches *= self.k
        workload.applied.append(self.name)

    def changes(self, coupling: dict[str, int]) -> str:
        return what_changes(coupling, self.k)

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        k, now = self.k, getattr(facts, "micro_batches", 1)
        size = getattr(facts, "batch_size", None)
        smaller = f"{size // k}" if size and size % k == 0 else f"<batch size>/{k}"
        same = f"the same {now * size} samples" if size else "as many samples as now"
        if Door.of(door) is Door.LIGHTNING:
            return (f"Trainer(accumulate_grad_batches={now * k}) and DataLoader(batch_size={smaller}): "
                    f"{same} per optimizer step")
        if Door.of(door) is Door.HF:
            return (f"TrainingArguments(gradient_accumulation_steps={now * k}, per_device_train_batch_size={smaller}): "
                    f"{same} per optimizer step")
        if now > 1:  # the script accumulates already: more micro-batches, each smaller
            return (
                f"raise gradient accumulation from {now} to {now * k} micro-batches per optimizer step, each 1/{k} "
                f"of the batch it has now (e.g. its batch-size option divided by {k}, its accumulation option times {k})"
            )
        return (
            f"split each batch into {k} micro-batches, divide each micro-batch's loss by {k}, call backward() on each "
            f"and optimizer.step() once per {k} (Lightning: Trainer(accumulate_grad_batches={k}); "
            f"Hugging Face: TrainingArguments(gradient_accumulation_steps={k}))"
        )
