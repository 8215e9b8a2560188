#!/usr/bin/env python
"""
Mixed-precision (fp16 + GradScaler) training with hand-written fp32 autograd Functions
and parametrized weights.

* `FusedLayerNormFunction` and `SoftmaxCrossEntropyFunction` are custom autograd
  Functions decorated with `torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)`
  / `torch.amp.custom_bwd(device_type="cuda")` (the AMP docs' recipe for numerically
  sensitive ops): under autocast their inputs are cast to fp32 and they run with
  autocast off, forward and backward.
* The token-mixing projection of every block is kept orthogonal
  (`torch.nn.utils.parametrizations.orthogonal`), the MLP's up-projection is
  spectrally normalised (`torch.nn.utils.parametrizations.spectral_norm`), and the
  forward runs inside `torch.nn.utils.parametrize.cached()` so each parametrized
  weight is computed once per step.
* fp16 autocast with `torch.amp.GradScaler("cuda")`, gradients unscaled before
  `clip_grad_norm_`.

Example:

    python custom_fwd_ops.py --d-model 1024 --n-layer 12 --seq-len 512 --batch-size 32 --vocab-size 32000
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm

parser = argparse.ArgumentParser()
parser.add_argument("--vocab-size", type=int, default=2048)
parser.add_argument("--d-model", type=int, default=256)
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--max-grad-norm", type=float, default=1.0)
parser.add_argument("--no-amp", action="store_true")
parser.add_argument("--no-cache", action="store_true", help="don't wrap the forward in parametrize.cached()")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp16 + loss scaling on GPU; CPU autocast prefers bf16 (and needs no scaler)
amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
use_amp = not args.no_amp


class FusedLayerNormFunction(torch.autograd.Function):
    """Layer norm computed in fp32 whatever the autocast dtype (apex's FusedLayerNormAffineFunction)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, input, weight, bias, eps):
        mean = input.mean(dim=-1, keepdim=True)
        var = input.var(dim=-1, unbiased=False, keepdim=True)
        invvar = torch.rsqrt(var + eps)
        output = (input - mean) * invvar * weight + bias
        ctx.eps = eps
        ctx.save_for_backward(input, weight, bias, mean, invvar)
        return output

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        input, weight, bias, mean, invvar = ctx.saved_tensors
        xhat = (input - mean) * invvar
        grad_weight = (grad_output * xhat).reshape(-1, xhat.shape[-1]).sum(0)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        g = grad_output * weight
        n = input.shape[-1]
        grad_input = invvar / n * (n * g - g.sum(-1, keepdim=True) - xhat * (g * xhat).sum(-1, keepdim=True))
        return grad_input, grad_weight, grad_bias, None


class FusedLayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        return FusedLayerNormFunction.apply(x, self.weight, self.bias, self.eps)


class SoftmaxCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy over rows, softmax kept in fp32 for backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, logits, target):
        logits = logits - logits.max(dim=-1, keepdim=True).values
        lse = logits.exp().sum(dim=-1, keepdim=True).log()
        log_probs = logits - lse
        loss = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1).mean()
        probs = log_probs.exp_()
        ctx.save_for_backward(probs, target)
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss):
        probs, target = ctx.saved_tensors
        grad = probs.clone()
        grad.scatter_add_(-1, target.unsqueeze(-1), -torch.ones_like(grad[:, :1]))
        grad.mul_(grad_loss / probs.shape[0])
        return grad, None


def softmax_cross_entropy(logits, target):
    return SoftmaxCrossEntropyFunction.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = FusedLayerNorm(d)
        # square map, kept orthogonal (matrix_exp of a skew-symmetric matrix)
        self.mix = orthogonal(nn.Linear(d, d, bias=False))
        self.ln2 = FusedLayerNorm(d)
        self.up = spectral_norm(nn.Linear(d, 4 * d))
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.mix(self.ln1(x))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return x


class Net(nn.Module):
    def __init__(self, vocab_size, d, n_layer, seq_len):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d))
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_layer)])
        self.ln_f = FusedLayerNorm(d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, idx, targets=None):
        x = self.embed(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, softmax_cross_entropy(logits, targets)


model = Net(args.vocab_size, args.d_model, args.n_layer, args.seq_len).to(device)
print(model.blocks[0])
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)

model.train()
for step in range(args.steps):
    t0 = time.perf_counter()
    idx = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=device)
    targets = torch.roll(idx, shifts=-1, dims=1)
    with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=use_amp):
        if args.no_cache:
            _, loss = model(idx, targets)
        else:
            with parametrize.cached():
                _, loss = model(idx, targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"step {step}: loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
          f"scale {scaler.get_scale():.0f} {(time.perf_counter() - t0) * 1000:.0f} ms")

if device.type == "cuda":
    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
