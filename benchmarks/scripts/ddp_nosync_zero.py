#!/usr/bin/env python
"""GPT pre-training with DDP, gradient accumulation under ``no_sync()`` and ZeRO-1, written for torchrun.

In the manner of nanoGPT-derived repos that do without DeepSpeed: a GPT written by
hand (GPT-2 medium's shape, ~350 M parameters with the tied embedding), bf16
autocast, 4 micro-batches per optimizer step with DDP's all-reduce skipped
(``model.no_sync()``) for all but the last, ``ZeroRedundancyOptimizer`` sharding
AdamW's state over the ranks, the gradient norm clipped, and at the end the
optimizer state consolidated on rank 0 and saved with the model.

    torchrun --nproc_per_node=8 ddp_nosync_zero.py
    python ddp_nosync_zero.py                     # one process (world size 1)
"""

import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, d, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, d, dropout):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(block_size, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def parse_args():
    p = argparse.ArgumentParser(description="DDP + no_sync accumulation + ZeRO-1 on random tokens")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--max-iters", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--out-dir", default="out-ddp-zero")
    return p.parse_args()


def get_batch(args, device):
    x = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.block_size + 1))
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def main():
    args = parse_args()
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="nccl")
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    else:  # a plain `python ddp_nosync_zero.py`: one rank of one, still through DDP and ZeRO
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29544")
        dist.init_process_group(backend="nccl", rank=0, world_size=1)
        rank = local_rank = 0
        world_size = 1
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    master = rank == 0
    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout).to(device)
    if master:
        print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    model = DDP(model, device_ids=[local_rank])
    raw_model = model.module

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                        betas=(0.9, 0.95), weight_decay=0.1)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16)

    X, Y = get_batch(args, device)
    t0 = time.time()
    for it in range(args.max_iters):
        lr = args.lr * min(1.0, (it + 1) / 2)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro_step in range(args.grad_accum):
            last = micro_step == args.grad_accum - 1
            sync = contextlib.nullcontext() if last else model.no_sync()
            with sync:
                with ctx:
                    logits, loss = model(X, Y)
                    loss = loss / args.grad_accum
                X, Y = get_batch(args, device)  # prefetch the next micro-batch while the GPU works
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        lossf = loss.detach() * args.grad_accum
        dist.all_reduce(lossf, op=dist.ReduceOp.AVG)
        t1 = time.time()
        if master:
            print(f"iter {it}: loss {lossf.item():.4f}, norm {norm.item():.3f}, time {(t1 - t0) * 1000:.0f}ms, "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        t0 = t1

    optimizer.consolidate_state_dict(to=0)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "args": vars(args)},
                   os.path.join(args.out_dir, "ckpt.pt"))
        print(f"saved checkpoint to {args.out_dir}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
