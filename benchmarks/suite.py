"""The accuracy suite's workloads: five models under five ways of training.

Each ``build(model, variant, device)`` returns ``(module, optimizer, step)``
where ``step()`` runs one optimizer step with random data made on ``device``.
The same code runs for real on a GPU and under memprof's simulator.

Variants: ``fp32``; ``bf16`` (autocast); ``pure_bf16`` (bf16 weights, AdamW on
them); ``ckpt`` (fp32, activation checkpointing of the repeated blocks by
hand, non-reentrant); ``accum4`` (fp32, 4 micro-batches of a quarter batch).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODELS = ("gpt2", "llama", "vit_b_16", "resnet50", "deep_mlp")
VARIANTS = ("fp32", "bf16", "pure_bf16", "ckpt", "accum4")


class Checkpointed(nn.Module):
    """Recompute ``block`` in backward instead of keeping its activations."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _checkpoint_children(container: nn.Module) -> None:
    for name, child in list(container.named_children()):
        setattr(container, name, Checkpointed(child))


def _hf(model: str, batch: int, seq: int, device: str):
    import transformers

    if model == "gpt2":
        cfg = transformers.GPT2Config()
        net = transformers.GPT2LMHeadModel(cfg)
    elif model == "bert":  # BERT-base, masked-language-model head; every token a label
        cfg = transformers.BertConfig()
        cfg._attn_implementation = "sdpa"
        net = transformers.BertForMaskedLM(cfg)
    else:  # Llama-style decoder, 0.50 B parameters, SDPA attention
        cfg = transformers.LlamaConfig(
            hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
            num_key_value_heads=12, vocab_size=32000, max_position_embeddings=2048,
        )
        cfg._attn_implementation = "sdpa"
        net = transformers.LlamaForCausalLM(cfg)
    vocab = cfg.vocab_size

    def data(b):
        ids = torch.randint(0, vocab, (b, seq), device=device)
        return dict(input_ids=ids, labels=ids)

    blocks = {"gpt2": lambda m: m.transformer.h, "bert": lambda m: m.bert.encoder.layer}.get(model, lambda m: m.model.layers)
    return net, data, batch, blocks


def _vision(model: str, batch: int, device: str):
    import torchvision

    net = getattr(torchvision.models, model)()

    def data(b):
        return dict(x=torch.randn(b, 3, 224, 224, device=device), y=torch.randint(0, 1000, (b,), device=device))

    blocks = (lambda m: m.encoder.layers) if model == "vit_b_16" else None
    return net, data, batch, blocks


class DeepMLP(nn.Module):
    """Many wide layers, few tokens: memory is states, not activations."""

    def __init__(self, width: int = 4096, depth: int = 32) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.layers(x))


_SIZES = {"gpt2": (16, 1024), "llama": (4, 2048), "bert": (32, 512), "vit_b_16": (128,), "resnet50": (128,), "deep_mlp": (64,)}


def _parts(model: str, device: str, size: tuple | None = None):
    """(module, data(batch_size) -> batch, batch size, repeated blocks or None, loss_of(module, batch)).

    ``size``: (batch, sequence) for the language models, (batch,) for the others; default the suite's."""
    size = size or _SIZES[model]
    if model in ("gpt2", "llama", "bert"):
        net, data, batch, blocks = _hf(model, *size, device)
        return net, data, batch, blocks, lambda m, d: m(**d).loss
    if model in ("vit_b_16", "resnet50"):
        net, data, batch, blocks = _vision(model, size[0], device)
    else:
        net, batch, blocks = DeepMLP(), size[0], (lambda m: m.layers)

        def data(b):
            return dict(x=torch.randn(b, 4096, device=device), y=torch.randint(0, 10, (b,), device=device))

    return net, data, batch, blocks, lambda m, d: nn.functional.cross_entropy(m(d["x"]), d["y"])


def workload(model: str, device: str = "cuda", size: tuple | None = None):
    """``model`` at its suite batch size (or ``size``), fp32, AdamW, as a memprof Workload for the advisor."""
    from memprof.workload import Workload

    torch.manual_seed(0)
    net, data, batch, _, loss_of = _parts(model, device, size)
    net = net.to(device)
    return Workload(net, torch.optim.AdamW(net.parameters(), lr=1e-4), data(batch), loss_of)


def build(model: str, variant: str, device: str = "cuda") -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    if model not in MODELS or variant not in VARIANTS:
        raise ValueError(f"unknown workload {model}/{variant}: models {MODELS}, variants {VARIANTS}")
    torch.manual_seed(0)
    net, data, batch, blocks, loss_of = _parts(model, device)
    if variant == "ckpt":
        if blocks is None:  # ResNet: checkpoint each residual block of the four stages
            for stage in (net.layer1, net.layer2, net.layer3, net.layer4):
                _checkpoint_children(stage)
        else:
            _checkpoint_children(blocks(net))
    net = net.to(device)
    if variant == "pure_bf16":
        net = net.to(torch.bfloat16)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    micro = 4 if variant == "accum4" else 1
    batches = [data(batch // micro) for _ in range(micro)]
    if variant == "pure_bf16" and model not in ("gpt2", "llama"):
        for d in batches:
            d["x"] = d["x"].to(torch.bfloat16)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if variant == "bf16" else contextlib.nullcontext()

    def step() -> None:
        for d in batches:
            with amp:
                loss = loss_of(net, d) / micro
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return net, opt, step
