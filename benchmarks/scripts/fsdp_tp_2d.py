#!/usr/bin/env python
"""2-D parallel (FSDP2 x tensor parallel) training of a small Llama-style decoder.

In the manner of torchtitan and PyTorch's 2-D parallel tutorial: a
("dp", "tp") device mesh; inside each block the attention and feed-forward
projections are split with ``ColwiseParallel`` / ``RowwiseParallel`` and the
norms run sequence parallel; each block is wrapped for activation
checkpointing, then sharded with FSDP2's ``fully_shard`` over the "dp" mesh
under a bf16 ``MixedPrecisionPolicy`` (fp32 gradient reduction), and the root
last. The vocabulary-sharded logits are trained with ``loss_parallel()``.
Random token ids stand in for a dataset; each dp rank draws its own batch.

    torchrun --nproc_per_node=8 fsdp_tp_2d.py --tp 4        # dp=2, tp=4
    python fsdp_tp_2d.py                                    # one process (dp=1, tp=1)
"""

import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


@torch.no_grad()
def _rope(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (end, dim): cos | sin


def apply_rope(x, rope):
    # x: (bs, seqlen, heads, head_dim); rotate-half form, real arithmetic only
    cos, sin = rope[: x.shape[1]].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1)[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, rope):
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_rep > 1)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x, rope):
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", _rope(args.dim // args.n_heads, args.seq_len), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def apply_tp(model, tp_mesh):
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_ac(model):
    for name, block in model.layers.named_children():
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype):
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        # the last block is needed again right away by backward: don't reshard it after forward
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def parse_args():
    p = argparse.ArgumentParser(description="FSDP2 + tensor parallel Llama training on random tokens")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (dp = world size / tp)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--local-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--no-ac", action="store_true", help="disable activation checkpointing")
    p.add_argument("--fp32", action="store_true", help="no mixed precision")
    return p.parse_args()


def main():
    args = parse_args()
    if "WORLD_SIZE" not in os.environ:  # not launched by torchrun: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29542")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device_type, backend = "cuda", "nccl"
        torch.cuda.set_device(local_rank)
    else:
        device_type, backend = "cpu", "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))

    tp = min(args.tp, world_size)
    if world_size % tp:
        raise SystemExit(f"world size {world_size} is not divisible by --tp {tp}")
    dp = world_size // tp
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]

    torch.manual_seed(0)  # the same initial weights on every rank
    with torch.device(device_type):
        model = Llama(args)
    apply_tp(model, tp_mesh)
    if not args.no_ac:
        apply_ac(model)
    if args.fp32:
        apply_fsdp(model, dp_mesh, None, None)
    else:
        apply_fsdp(model, dp_mesh, torch.bfloat16, torch.float32)
    if rank == 0:
        print(f"dp={dp} tp={tp} params={sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    # every rank of a tp group must see the same tokens: seed by the dp rank
    gen = torch.Generator(device=device_type)
    gen.manual_seed(1234 + dp_mesh.get_local_rank())
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens = torch.randint(0, args.vocab_size, (args.local_batch_size, args.seq_len + 1),
                               device=device_type, generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel():
            pred = model(inputs)
            loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            mem = f" peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if device_type == "cuda" else ""
            print(f"step {step}: loss {loss.item():.4f} grad norm {norm.full_tensor().item():.3f} "
                  f"{time.perf_counter() - t0:.2f}s{mem}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
