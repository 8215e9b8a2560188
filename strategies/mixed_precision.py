"""Mixed precision: bf16 or fp16 autocast (fp16 with GradScaler), or pure bf16 weights."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from memprof.workload import Workload

from .base import Door, Strategy

__all__ = ["Autocast", "PureBF16"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Autocast(Strategy):
    """``torch.autocast`` around the loss; fp16 adds ``torch.amp.GradScaler``.

    Weights, gradients and optimizer state stay fp32; matmuls and what they
    save for backward become 16-bit, while autocast keeps softmax, norms and
    losses in fp32 (which is why GPT-2's fp32 logits stay large).
    """

    def __init__(self, dtype: str = "bf16") -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"autocast dtype {dtype!r} is not one of {sorted(_DTYPES)}; use 'bf16' (Ampere and newer) or 'fp16'")
        self.dtype = dtype
        self.name = dtype

    def apply(self, workload: Workload) -> None:
        workload.autocast_dtype = _DTYPES[self.dtype]
        if self.dtype == "fp16":
            workload.scaler = torch.amp.GradScaler("cuda")
        workload.applied.append(self.name)

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        door = Door.of(door)
        if door is Door.LIGHTNING:
            return f"Trainer(precision={'16-mixed' if self.dtype == 'fp16' else 'bf16-mixed'!r})"
        if door is Door.HF:
            return f"TrainingArguments({self.dtype}=True)"
        if self.dtype == "fp16":
            return (
                "wrap the forward pass and the loss in `with torch.autocast('cuda', dtype=torch.float16):` and step "
                "through `scaler = torch.amp.GradScaler('cuda')`: scaler.scale(loss).backward(), scaler.step(optimizer), "
                "scaler.update() (Lightning: Trainer(precision='16-mixed'); Hugging Face: TrainingArguments(fp16=True))"
            )
        return (
            "wrap the forward pass and the loss in `with torch.autocast('cuda', dtype=torch.bfloat16):` "
            "(Lightning: Trainer(precision='bf16-mixed'); Hugging Face: TrainingArguments(bf16=True))"
        )


class PureBF16(Strategy):
    """Weights, gradients, optimizer state and activations all in bf16 (no fp32 master copy).

    Half the bytes of every category; numerics differ from fp32 training
    (updates smaller than bf16's resolution are lost), so it is offered, and
    named, as a trade-off.
    """

    name = "pure_bf16"
    revertible = False  # the weights are converted in place, and the optimizer's state follows them

    def apply(self, workload: Workload) -> None:
        workload.model.to(torch.bfloat16)  # Parameters keep their identity: the optimizer still holds them
        workload.batch = tree_map(
            lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            workload.batch,
        )
        workload.applied.append(self.name)

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        door = Door.of(door)
        if door is Door.LIGHTNING:
            return "Trainer(precision='bf16-true'): weights, gradients and optimizer state in bf16"
        if door is Door.HF:
            return ("load the model in bf16 (from_pretrained(..., torch_dtype=torch.bfloat16)) and keep "
                    "TrainingArguments(bf16=False): weights, gradients and optimizer state in bf16")
        return (
            "convert the model before building the optimizer: `model.to(torch.bfloat16)`, and feed it bf16 inputs "
            "(Lightning: Trainer(precision='bf16-true'))"
        )
