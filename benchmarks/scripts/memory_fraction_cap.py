#!/usr/bin/env python
"""Train a small GPT on a shared GPU, capped with ``torch.cuda.set_per_process_memory_fraction``.

In the manner of people sharing one big GPU between jobs (lab servers, notebooks on a
shared node): the script limits its own caching allocator to a fraction of the device's
memory first thing (``torch.cuda.set_per_process_memory_fraction(0.25)``), then looks for
the largest batch that trains under that cap by starting too large and halving the batch
on ``torch.cuda.OutOfMemoryError``, emptying the cache between tries, and logs
``torch.cuda.max_memory_reserved()`` against the cap. The model is a plain-PyTorch
nanoGPT-style decoder (manual causal attention, GELU MLP, tied embeddings, AdamW).
Random token ids stand in for a dataset, so it runs offline.

    python memory_fraction_cap.py                    # cap 25 % of the GPU, start at batch 2048
    python memory_fraction_cap.py --fraction 0.5 --start-batch-size 256
"""

import argparse
import gc
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description="GPT training under a per-process memory fraction")
    p.add_argument("--fraction", type=float, default=0.25, help="share of the GPU's memory this process may use")
    p.add_argument("--start-batch-size", type=int, default=2048, help="first batch tried (too large for the cap)")
    p.add_argument("--min-batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args()


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gib(n):
    return n / 2**30


def main():
    args = parse_args()
    device = "cuda"

    # Share the GPU: this process's caching allocator may reserve at most fraction x total memory.
    torch.cuda.set_per_process_memory_fraction(args.fraction)
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(args.fraction * total)
    print(f"{torch.cuda.get_device_name(0)}: total {gib(total):.2f} GiB, cap {args.fraction} -> {gib(cap):.2f} GiB")

    torch.manual_seed(1337)
    model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    batch_size = args.start_batch_size
    while True:
        if batch_size < args.min_batch_size:
            raise SystemExit("no batch size fits under the memory cap")
        torch.cuda.reset_peak_memory_stats()
        try:
            model.train()
            for step in range(args.steps):
                t0 = time.time()
                x = torch.randint(0, args.vocab_size, (batch_size, args.block_size), device=device)
                y = torch.randint(0, args.vocab_size, (batch_size, args.block_size), device=device)
                _, loss = model(x, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                torch.cuda.synchronize()
                print(f"bs {batch_size} step {step}: loss {loss.item():.4f}, {1000 * (time.time() - t0):.0f} ms, "
                      f"max reserved {gib(torch.cuda.max_memory_reserved()):.2f} GiB "
                      f"(cap {gib(cap):.2f} GiB), max allocated {gib(torch.cuda.max_memory_allocated()):.2f} GiB")
            break
        except torch.cuda.OutOfMemoryError as e:
            print(f"OOM at batch size {batch_size} (max reserved {gib(torch.cuda.max_memory_reserved()):.2f} GiB): "
                  f"{str(e).splitlines()[0][:160]}")
            # drop everything the failed step holds before retrying
            x = y = loss = None
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            batch_size //= 2
    print(f"trained at batch size {batch_size}; max_memory_reserved {gib(torch.cuda.max_memory_reserved()):.2f} GiB "
          f"under a cap of {gib(cap):.2f} GiB")


if __name__ == "__main__":
    main()
