#!/usr/bin/env python
"""A small GPT trained with custom operators registered the modern way (``torch.library``).

In the manner of libraries that ship fused kernels as PyTorch custom operators
so ``torch.compile`` can trace through them (flash-attn 2.6+'s
``flash_attn::_flash_attn_forward`` / ``_flash_attn_backward``, Liger, vLLM,
the PyTorch "Custom Python Operators" tutorial):

* ``mylib::fused_rmsnorm`` (``@torch.library.custom_op``, ``mutates_args=()``)
  returns the normalised output and the per-row ``rstd``; its implementation is
  plain torch ops (on a GPU it would be a Triton or CUDA kernel);
  ``@fused_rmsnorm.register_fake`` gives its shapes, and
  ``torch.library.register_autograd`` with a ``setup_context`` that saves
  ``x``, ``weight`` and ``rstd`` makes it trainable;
* its backward calls ``mylib::fused_rmsnorm_backward``, a custom op that writes
  the input's gradient into a preallocated ``out`` (``mutates_args={"out"}``,
  as flash-attn's backward writes ``dq``, ``dk``, ``dv``) and returns the
  weight's gradient;
* ``mylib::swiglu`` (functional, autograd registered, ``setup_context`` saves
  both inputs) for the MLP.

A GPT with these in every block, bf16 autocast, fused AdamW, random tokens.

    python custom_op_library.py                       # 6 layers, d=512, 16 x 256 tokens
    python custom_op_library.py --device cpu --steps 2
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# ---------------------------------------------------------------- custom operators

@torch.library.custom_op("mylib::fused_rmsnorm", mutates_args=())
def fused_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd * weight.float()).to(x.dtype)
    return y, rstd


@fused_rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("mylib::fused_rmsnorm_backward", mutates_args={"out"})
def fused_rmsnorm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, out: Tensor) -> Tensor:
    xf, gf, wf = x.float(), grad.float(), weight.float()
    xhat = xf * rstd
    gw = gf * wf
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    out.copy_(dx)
    dweight = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dweight.to(weight.dtype)


@fused_rmsnorm_backward.register_fake
def _(grad, x, weight, rstd, out):
    return torch.empty_like(weight)


def _rmsnorm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _rmsnorm_backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx = torch.empty_like(x)
    dweight = fused_rmsnorm_backward(grad_y, x, weight, rstd, dx)
    return dx, dweight, None


torch.library.register_autograd("mylib::fused_rmsnorm", _rmsnorm_backward, setup_context=_rmsnorm_setup_context)


@torch.library.custom_op("mylib::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


@swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


def _swiglu_setup_context(ctx, inputs, output):
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    sig = torch.sigmoid(gate.float())
    silu = gate.float() * sig
    dgate = grad.float() * up.float() * sig * (1 + gate.float() * (1 - sig))
    dup = grad.float() * silu
    return dgate.to(gate.dtype), dup.to(up.dtype)


torch.library.register_autograd("mylib::swiglu", _swiglu_backward, setup_context=_swiglu_setup_context)


# ---------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y, _ = fused_rmsnorm(x, self.weight, self.eps)
        return y


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)
        self.c_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_head, hidden):
        super().__init__()
        self.ln_1 = RMSNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_2 = RMSNorm(d_model)
        self.mlp = MLP(d_model, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, d_model, n_layer, n_head, hidden):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList([Block(d_model, n_head, hidden) for _ in range(n_layer)])
        self.ln_f = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1408)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true")
    return p.parse_args()


def main():
    args = parse_args()
    device = args.device
    torch.manual_seed(1337)
    model = GPT(args.vocab_size, args.block_size, args.d_model, args.n_layer, args.n_head, args.hidden).to(device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=(device == "cuda"))
    if args.compile:
        model = torch.compile(model)
    ctx = torch.autocast(device_type=device, dtype=torch.bfloat16)

    for step in range(args.steps):
        t0 = time.time()
        x = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size), device=device)
        y = torch.randint(0, args.vocab_size, (args.batch_size, args.block_size), device=device)
        with ctx:
            logits, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"step {step}: loss {loss.item():.4f}, {(time.time() - t0) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
