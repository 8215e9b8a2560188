"""Workloads shared by the GPU benchmarks: real models, random data, one step; and a
kernel's time measured with CUDA events."""

from __future__ import annotations

import contextlib
import statistics
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


def event_seconds(fn: Callable[[], object], runs: int) -> list[float]:
    """The seconds of each of ``runs`` calls of ``fn``, timed with CUDA events."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return times


def timed(fn: Callable[[], object], runs: int = 5, warmup: int = 2) -> float:
    """The median seconds of ``runs`` calls of ``fn`` after ``warmup`` (:func:`event_seconds`)."""
    for _ in range(warmup):
        fn()
    return statistics.median(event_seconds(fn, runs))


def _autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _hf_lm(model: nn.Module, name: str, batch: int, seq: int, precision: str) -> Workload:
    """A Hugging Face language model on random tokens, each its own label (loss inside the model)."""
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step() -> None:
        with _autocast(precision):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload(f"{name} {precision} {batch}x{seq}", model, opt, step)


def gpt2(precision: str = "fp32", batch: int = 16, seq: int = 1024, **config) -> Workload:
    """GPT-2 (124M unless ``config`` shrinks it) from its config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**config))
    size = "124M" if not config else f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"
    return _hf_lm(model, f"gpt2-{size}", batch, seq, precision)


def _vision(model: nn.Module, name: str, batch: int, precision: str) -> Workload:
    """An image classifier on random 224x224 images, cross-entropy outside the model."""
    model = model.cuda()
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

    return Workload(f"{name} {precision} {batch}", model, opt, step)


def resnet(precision: str = "bf16", batch: int = 128, depth: int = 50) -> Workload:
    import torchvision

    torch.manual_seed(0)
    return _vision(getattr(torchvision.models, f"resnet{depth}")(), f"resnet{depth}", batch, precision)


def bert(precision: str = "bf16", batch: int = 32, seq: int = 512) -> Workload:
    """BERT-base masked-language model (HF ``BertForMaskedLM``), every token a label."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return _hf_lm(BertForMaskedLM(BertConfig()), "bert-base", batch, seq, precision)


def vit(precision: str = "bf16", batch: int = 128) -> Workload:
    import torchvision

    torch.manual_seed(0)
    return _vision(torchvision.models.vit_b_16(), "vit_b_16", batch, precision)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "bert-bf16": lambda: bert("bf16"),
    "vit-bf16": lambda: vit("bf16"),
    "gpt2-fp32": lambda: gpt2("fp32"),
    "gpt2-bf16": lambda: gpt2("bf16"),
    "resnet50-bf16": lambda: resnet("bf16"),
    "resnet50-fp32": lambda: resnet("fp32"),
    # The small models of tests/test_tracker_cuda.py, to look at their peaks in full.
    "gpt2-small-bf16": lambda: gpt2("bf16", 8, 512, n_layer=2, n_embd=256, n_head=4, vocab_size=8192),
    "resnet18-fp32": lambda: resnet("fp32", 32, depth=18),
}


def free(w: Workload) -> None:
    del w.model, w.optimizer, w.step
    import gc

    gc.collect()
    torch.cuda.empty_cache()
