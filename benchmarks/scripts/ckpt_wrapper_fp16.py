#!/usr/bin/env python
"""Train a small decoder LM on one GPU the way PyTorch's FSDP / torchtune docs wrap it.

Activation checkpointing is applied from outside the model with
``apply_activation_checkpointing`` and a non-reentrant ``checkpoint_wrapper``
(the recipe the FSDP tutorial and torchtune's ``set_activation_checkpointing``
use), fp16 autocast with ``torch.amp.GradScaler("cuda")``, ``scaler.unscale_``
before ``clip_grad_norm_``, fused AdamW, a linear-warmup ``LambdaLR``, and
``zero_grad(set_to_none=True)``. Data is random tokens made on the GPU.

    python ckpt_wrapper_fp16.py --steps 20
"""

import argparse
import functools
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_heads, dropout):
        super().__init__()
        assert dim % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim, dropout):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, dim, n_heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class DecoderLM(nn.Module):
    def __init__(self, vocab_size, dim, n_layers, n_heads, max_seq_len, dropout=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList([Block(dim, n_heads, dropout) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, tokens):
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)
        h = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def get_lr_lambda(warmup_steps, total_steps):
    def lr_lambda(step):
        if step < warmup_steps:
            return float(step + 1) / float(max(1, warmup_steps))
        progress = (step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return lr_lambda


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(1337)
    device = torch.device("cuda")

    model = DecoderLM(args.vocab_size, args.dim, args.n_layers, args.n_heads, args.seq_len).to(device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    non_reentrant_wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=non_reentrant_wrapper, check_fn=lambda m: isinstance(m, Block)
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, get_lr_lambda(args.warmup_steps, args.steps))
    scaler = torch.amp.GradScaler("cuda")

    model.train()
    t0 = time.time()
    for step in range(args.steps):
        # random tokens standing in for a packed pre-training shard
        data = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
        inputs, labels = data[:, :-1], data[:, 1:]

        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        print(f"step {step}: loss {loss.item():.4f} | grad_norm {grad_norm.item():.3f} | "
              f"lr {scheduler.get_last_lr()[0]:.2e} | scale {scaler.get_scale():.0f} | {(t1 - t0) * 1000:.1f} ms")
        t0 = t1

    print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    print(f"max memory reserved: {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
