"""Activation checkpointing of the model's repeated blocks (torch.utils.checkpoint)."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import torch

from memprof.workload import Workload

from .base import Door, Strategy

__all__ = ["Checkpointing", "find_blocks"]


def _shape(module: nn.Module):
    """What makes two modules the same block: the class, and for a container
    (``nn.Sequential``, ``nn.ModuleList``) its children's shapes in order."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return type(module), tuple(_shape(c) for c in module)
    return type(module)


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks, looked for in this order:

    1. composite children of ModuleLists/Sequentials whose children are all the
       same block (transformer layers, ResNet bottlenecks, ``nn.Sequential(conv,
       norm, act)`` stacks): every such stack (an encoder's layers and a decoder's);
       where those children are ModuleLists of a layer's parts (vit-pytorch's
       ``ModuleList([ModuleList([Attention, FeedForward])])``), the composite parts;
    2. among mixed children (``nn.Sequential(stem, *blocks, head)``, or a model's
       own attributes: a UNet's ``self.down1 = Block(64, 128)`` ...), the children
       of the composite class that occurs most often, at least twice;
    3. single layers stacked in a ModuleList/Sequential, of the class stacked most.

    A stack outranks blocks that repeat inside its members: nn.Transformer's
    encoder and decoder layers, not the two attentions of each decoder layer
    (self and cross), which checkpointed alone save little; of stacks inside
    stacks, the innermost, but for a mixture's experts (a stack named for them,
    or beside a router with an output per member), which run side by side on
    their share of the tokens: the layers holding them are the blocks."""
    tiers: list[list[tuple[str, nn.Module, Any]]] = [[], [], []]
    experts: set[str] = set()
    modules = dict(model.named_modules())
    for name, module in modules.items():
        # TorchScript calls a scripted module's children inside its interpreter, past any Python
        # forward the checkpointing would put there: scripted modules are no blocks.
        children = [(n, c) for n, c in module.named_children() if not isinstance(c, torch.jit.ScriptModule)]
        if len(children) < 2 or isinstance(module, torch.jit.ScriptModule):
            continue
        prefix = f"{name}." if name else ""
        shapes = Counter(_shape(c) for _, c in children)
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        # A ModuleList has no forward of its own to checkpoint.
        first = children[0][1]
        if (container and len(shapes) == 1 and not isinstance(first, nn.ModuleList)
                and any(True for _ in first.parameters())):
            composite = any(True for _ in first.children())
            tiers[0 if composite else 2] += [(f"{prefix}{i}", c, _shape(c)) for i, c in children]
            parent = modules.get(name.rpartition(".")[0]) if name else None
            if "expert" in name.rpartition(".")[2].lower() or any(
                    isinstance(m, nn.Linear) and m.out_features == len(children)
                    for m in (parent.children() if parent is not None else ())):
                experts.add(prefix)
        elif container and len(shapes) == 1 and isinstance(first, nn.ModuleList):
            # Each member a list of the layer's parts, called one by one (vit-pytorch's
            # `for attn, ff in self.layers: x = attn(x) + x; ...`): a list has no forward, its parts do.
            tiers[0] += [(f"{prefix}{i}.{j}", g, _shape(g)) for i, c in children for j, g in c.named_children()
                         if any(True for _ in g.children()) and any(True for _ in g.parameters())]
        elif len(shapes) > 1 or not container:
            # Only blocks made of modules: a checkpointed single layer saves its input anyway.
            tiers[1] += [(f"{prefix}{i}", c, _shape(c)) for i, c in children
                         if shapes[_shape(c)] >= 2 and not isinstance(c, nn.ModuleList)
                         and any(True for _ in c.children()) and any(True for _ in c.parameters())]
    stacked = [t for t in tiers[0] if not any(t[0].startswith(e) for e in experts)]
    if stacked:
        # The innermost stacks: a Swin stage's blocks, not the stages holding them. The same blocks
        # among mixed children are theirs too: a stage written as Sequential(*blocks, downsample)
        # (only the last stage, without the downsampling, was a stack of them alone).
        names = [n for n, _, _ in stacked]
        blocks = [t for t in stacked if not any(o.startswith(t[0] + ".") for o in names)]
        shapes, found = {shape for _, _, shape in blocks}, [n for n, _, _ in blocks]
        blocks += [t for t in tiers[1] if t[2] in shapes and not any(
            t[0] == o or t[0].startswith(o + ".") or o.startswith(t[0] + ".") for o in found)]
        order = {name: i for i, name in enumerate(modules)}
        return [(n, m) for n, m, _ in sorted(blocks, key=lambda t: order[t[0]])]
    candidates = tiers[1] or tiers[0] or tiers[2]
    if not candidates:
        return []
    counts = Counter(shape for _, _, shape in candidates)
    most = max(counts.values())
    return [(n, m) for n, m, shape in candidates if counts[shape] == most]


# Selective checkpointing keeps the outputs of the expensive ops (matmuls,
# attention) and recomputes the cheap elementwise ones (Korthikanti et al.
# 2022, "selective activation recomputation").
_KEEP = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    # The kernel SDPA picks on Hopper GPUs for 16-bit inputs (memprof.sdpa); recomputing it
    # would cost the attention's flops again.
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
]


def _hf_checkpointing_argument() -> str:
    """``TrainingArguments``' name for checkpointing: ``activation_checkpointing`` since
    transformers 5 (``gradient_checkpointing`` stays as its deprecated alias)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "gradient_checkpointing"
    return "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else "gradient_checkpointing"


def _disable_kv_cache(workload: Workload) -> None:
    """Turn off a Hugging Face model's key/value cache, as its own
    ``gradient_checkpointing_enable()`` does: the cache would keep every
    checkpointed block's keys and values alive until backward (and grow them
    again in the recomputation), the memory checkpointing is meant to free."""
    for module in workload.model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            workload.patch(config, "use_cache", False)


class Checkpointing(Strategy):
    """Recompute each block's forward in backward instead of keeping its activations.

    ``blocks``: qualified module names, or None to find the repeated blocks
    (:func:`find_blocks`). ``selective``: keep matmul and attention outputs.
    Non-reentrant ``torch.utils.checkpoint``; module names and hooks stay as
    they were (the block's ``forward`` is wrapped on the instance). As with
    any use of ``torch.utils.checkpoint``, a BatchNorm inside a block updates
    its running statistics again when the block is recomputed. A Hugging Face
    model's key/value cache is turned off (``config.use_cache = False``).
    """

    def __init__(self, blocks: list[str] | None = None, selective: bool = False) -> None:
        self.blocks = blocks
        self.selective = selective
        self.name = "sel_ckpt" if selective else "ckpt"
        self.wrapped: list[str] = []
        self.classes: list[str] = []  # the wrapped blocks' classes (an FSDP wrapping policy names them)

    def apply(self, workload: Workload) -> None:
        model = workload.model
        if self.blocks is None:
            found = find_blocks(model)
        else:
            named = dict(model.named_modules())
            missing = [b for b in self.blocks if b not in named]
            if missing:
                raise ValueError(f"no module named {missing} in the model; give qualified names from model.named_modules()")
            found = [(b, named[b]) for b in self.blocks]
        if not found:
            raise ValueError(
                f"found no repeated blocks to checkpoint in {type(model).__name__} (a stack of layers of one class); "
                "from Python, name them: Checkpointing(blocks=[...]) with names from model.named_modules()")
        kwargs = {"use_reentrant": False}
        if self.selective:
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _KEEP)
        for _, block in found:
            workload.patch(block, "forward", functools.partial(checkpoint, block.forward, **kwargs))
        _disable_kv_cache(workload)
        self.wrapped = [n for n, _ in found]
        self.classes = sorted({type(b).__name__ for _, b in found})
        workload.applied.append(self.name)

    @property
    def key(self) -> str:
        return f"{self.name}({','.join(self.blocks)})" if self.blocks else self.name

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        door = Door.of(door)
        names = self.wrapped or self.blocks or ["the repeated blocks"]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        keep = ", context_fn=<selective: keep matmul and attention outputs>" if self.selective else ""
        wrap = (f"`block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, "
                f"use_reentrant=False{keep})` for {shown}")
        if door is Door.LIGHTNING:
            policy = "{" + ", ".join(self.classes) + "}" if self.classes else "{<block class>}"
            return (f"in the LightningModule's configure_model, checkpoint each repeated block: {wrap} "
                    f"(with FSDPStrategy: FSDPStrategy(activation_checkpointing_policy={policy}))")
        if door is Door.HF and not self.selective:
            name = _hf_checkpointing_argument()
            return (f"TrainingArguments({name}=True, {name}_kwargs={{'use_reentrant': False}}) "
                    f"(a model without Hugging Face's support for it: {wrap} before training)")
        switch = getattr(facts, "checkpointing_switch", "")
        if switch and not self.selective:
            return f"checkpoint each repeated block with the model's own switch: `{switch}` (or by hand: {wrap})"
        return f"checkpoint each repeated block: {wrap} (Hugging Face: model.activation_checkpointing_enable(), before transformers 5.2x gradient_checkpointing_enable())"
