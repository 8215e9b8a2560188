"""Workloads shared by the GPU benchmarks: real models, random data, one step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class Workload:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]


def _autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gpt2(precision: str = "fp32", batch: int = 16, seq: int = 1024) -> Workload:
    """GPT-2 124M from its config (no download), random tokens, loss inside the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (batch, seq), device="cuda")

    def step() -> None:
        with _autocast(precision):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload(f"gpt2-124M {precision} {batch}x{seq}", model, opt, step)


def resnet50(precision: str = "bf16", batch: int = 128) -> Workload:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        with _autocast(precision):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload(f"resnet50 {precision} {batch}", model, opt, step)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt2-fp32": lambda: gpt2("fp32"),
    "gpt2-bf16": lambda: gpt2("bf16"),
    "resnet50-bf16": lambda: resnet50("bf16"),
    "resnet50-fp32": lambda: resnet50("fp32"),
}


def free(w: Workload) -> None:
    del w.model, w.optimizer, w.step
    import gc

    gc.collect()
    torch.cuda.empty_cache()
