#!/usr/bin/env python
"""Tensor parallel (+ sequence parallel) training of a small Llama-style decoder.

In the manner of PyTorch's "Large Scale Transformer model training with Tensor
Parallel" tutorial and torchtitan: a 1-D device mesh over all ranks,
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` for the
attention and feed-forward projections, ``SequenceParallel`` for the norms,
a vocabulary-sharded output projection trained with ``loss_parallel()``, and
AdamW. Random token ids stand in for a dataset.

    torchrun --nproc_per_node=4 tp_llama.py
    python tp_llama.py                      # one process, tp = 1 (gloo on a CPU-only machine)
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


# --------------------------------------------------------------------------- model
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    bs, slen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1: the local number of heads once wq/wk/wv are column-sharded
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        out = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of=256):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=1e-5)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.seq_len * 2),
                             persistent=False)

    def init_weights(self):
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02 / math.sqrt(2 * len(self.layers)))
        nn.init.trunc_normal_(self.output.weight, std=self.output.weight.shape[1] ** -0.5)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------- parallelism
def apply_tp(model, tp_mesh):
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # keep the logits sharded over the vocabulary for loss_parallel()
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers:
        plan = {
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
        }
        parallelize_module(block, tp_mesh, plan)
    return model


def parse_args():
    p = argparse.ArgumentParser(description="Tensor parallel Llama training on random tokens")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


def main():
    args = parse_args()
    # torchrun sets these; a plain `python tp_llama.py` runs as a world of one
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29541")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    assert args.n_kv_heads % world_size == 0, f"{args.n_kv_heads} kv heads cannot be split over {world_size} ranks"

    # init_device_mesh creates the default process group (nccl on GPUs, gloo on the CPU)
    tp_mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("tp",))

    torch.manual_seed(0)
    model = Transformer(args).to(device_type)
    model.init_weights()
    model = apply_tp(model, tp_mesh)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"tp={world_size} params={n_params / 1e6:.2f}M (global)")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        # every TP rank must see the same batch
        torch.manual_seed(step)
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device_type)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        optimizer.zero_grad()
        with loss_parallel():
            pred = model(inputs)
            loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        optimizer.step()
        if rank == 0:
            mem = f" peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if device_type == "cuda" else ""
            print(f"step {step}: loss {loss.item():.4f} {time.perf_counter() - t0:.2f}s{mem}")

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
