#!/usr/bin/env python
"""Pretrain a small GPT on random tokens with Lightning Fabric.

The loop follows Lightning's Fabric examples and lit-gpt's pretraining script:
``fabric.setup`` / ``fabric.setup_dataloaders``, ``fabric.backward``,
gradient accumulation under ``fabric.no_backward_sync``, ``fabric.clip_gradients``
and a warmup + cosine learning rate set on the param groups by hand.

    python fabric_lm.py                                   # ~16M params, 8 optimizer steps of 2 micro-batches
    python fabric_lm.py --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 \
        --micro-batch-size 8 --grad-accum 4               # GPT-2 124M
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning.fabric import Fabric


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias, dropout):
        super().__init__()
        assert n_embd % n_head == 0
        self.attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head = n_head
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias, dropout):
        super().__init__()
        self.norm_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias, dropout)
        self.norm_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        x = x + self.mlp(self.norm_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=False, dropout=0.0):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, bias, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        T = idx.size(1)
        assert T <= self.block_size, f"Cannot forward sequence of length {T}, block size is {self.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


class RandomTokens(Dataset):
    """Stands in for a tokenized corpus: fixed random blocks of block_size + 1 tokens."""

    def __init__(self, num_samples, block_size, vocab_size, seed=42):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (num_samples, block_size + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        chunk = self.data[i]
        return chunk[:-1], chunk[1:]


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@torch.no_grad()
def validate(fabric, model, val_dataloader, max_iters):
    fabric.print("Validating ...")
    model.eval()
    losses = torch.zeros(max_iters, device=fabric.device)
    for k, (input_ids, targets) in enumerate(val_dataloader):
        if k >= max_iters:
            break
        logits = model(input_ids)
        losses[k] = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    model.train()
    return losses.mean()


def train(fabric, model, optimizer, train_dataloader, val_dataloader, args):
    step_count = 0
    iter_num = 0
    total_t0 = time.perf_counter()
    model.train()
    train_iter = iter(train_dataloader)
    while step_count < args.max_steps:
        lr = get_lr(step_count, args.learning_rate, args.warmup_steps, args.max_steps, args.min_lr)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        iter_t0 = time.perf_counter()
        try:
            input_ids, targets = next(train_iter)
        except StopIteration:
            train_iter = iter(train_dataloader)
            input_ids, targets = next(train_iter)

        is_accumulating = (iter_num + 1) % args.grad_accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            fabric.backward(loss / args.grad_accum)

        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_count += 1

        iter_num += 1
        if iter_num % args.log_interval == 0:
            dt = (time.perf_counter() - iter_t0) * 1000
            fabric.print(f"iter {iter_num} step {step_count}: loss {loss.item():.4f}, lr {lr:.2e}, {dt:.1f} ms")

        if not is_accumulating and args.eval_interval and step_count % args.eval_interval == 0:
            val_loss = validate(fabric, model, val_dataloader, args.eval_iters)
            fabric.print(f"step {step_count}: val loss {val_loss.item():.4f}")

    fabric.print(f"Training time: {time.perf_counter() - total_t0:.2f}s")
    if fabric.device.type == "cuda":
        fabric.print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")


def main(args):
    accelerator = args.accelerator
    if accelerator == "cuda" and not torch.cuda.is_available():
        accelerator = "cpu"
    fabric = Fabric(accelerator=accelerator, devices=args.devices, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(1337 + fabric.global_rank)
    torch.set_float32_matmul_precision("high")

    t0 = time.perf_counter()
    with fabric.init_module(empty_init=False):
        model = GPT(
            args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd,
            bias=args.bias, dropout=args.dropout,
        )
    fabric.print(f"Time to instantiate model: {time.perf_counter() - t0:.02f} seconds.")
    fabric.print(f"Total parameters {sum(p.numel() for p in model.parameters()):,}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
        betas=(args.beta1, args.beta2),
        foreach=False,
    )
    model, optimizer = fabric.setup(model, optimizer)

    num_train = args.micro_batch_size * args.grad_accum * args.max_steps
    train_data = RandomTokens(num_train, args.block_size, args.vocab_size, seed=1337)
    val_data = RandomTokens(args.micro_batch_size * args.eval_iters, args.block_size, args.vocab_size, seed=1338)
    train_dataloader = DataLoader(train_data, batch_size=args.micro_batch_size, shuffle=True, num_workers=args.num_workers)
    val_dataloader = DataLoader(val_data, batch_size=args.micro_batch_size, num_workers=args.num_workers)
    train_dataloader, val_dataloader = fabric.setup_dataloaders(train_dataloader, val_dataloader)

    train(fabric, model, optimizer, train_dataloader, val_dataloader, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="GPT pretraining with Lightning Fabric")
    parser.add_argument("--vocab-size", type=int, default=50304)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--min-lr", type=float, default=6e-5)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--eval-interval", type=int, default=4, help="0: no validation")
    parser.add_argument("--eval-iters", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="bf16-mixed")
    main(parser.parse_args())
