#!/usr/bin/env python
"""
FP8 training of a small GPT with dynamic per-tensor scaling, in plain PyTorch.

The recipe of torchao's `Float8Linear` (and NVIDIA's "tensorwise" delayed-free
recipe): every nn.Linear in the transformer blocks is swapped for a Float8Linear
whose matmul is a custom autograd Function. Forward casts the input and the
weight to float8_e4m3fn with a scale computed from their amax and calls
`torch._scaled_mm` (bf16 output); backward casts the output gradient to
float8_e5m2 and computes grad_input and grad_weight with `torch._scaled_mm`
as well. The fp8 tensors and their scales are what is saved for backward.

fp8 matmuls need an sm89+ GPU (Ada, Hopper). Elsewhere (CPU, older GPUs) the
same casts are done and the matmul runs in bf16 on the dequantized values.

Example:

    python fp8_linear.py --n-layer 12 --n-embd 768 --n-head 12 --block-size 1024 --batch-size 16
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="FP8 (dynamic tensorwise scaling) training of a small GPT")
parser.add_argument("--n-layer", type=int, default=4)
parser.add_argument("--n-head", type=int, default=4)
parser.add_argument("--n-embd", type=int, default=256)
parser.add_argument("--block-size", type=int, default=256)
parser.add_argument("--vocab-size", type=int, default=4096)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=6e-4)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--grad-clip", type=float, default=1.0)
parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="float32: fp32 master weights + bf16 autocast; bfloat16: the model itself in bf16")
parser.add_argument("--no-fp8", action="store_true", help="keep plain nn.Linear (baseline)")
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()

torch.manual_seed(args.seed)
device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
# fp8 GEMMs (cuBLASLt) exist on sm89 and newer
HAS_FP8_GEMM = device_type == "cuda" and torch.cuda.get_device_capability() >= (8, 9)

# ----------------------------------------------------------------------------------
# fp8 casting with dynamic (per-tensor, "tensorwise") scales

EPS = 1e-12


@torch.no_grad()
def amax_to_scale(amax, float8_dtype):
    # scale so that amax maps to the largest representable fp8 value
    amax = amax.to(torch.float64)
    scale = torch.finfo(float8_dtype).max / torch.clamp(amax, min=EPS)
    return scale.to(torch.float32)


def to_float8(x, float8_dtype):
    """Returns (x in fp8, inverse scale) with x_fp8 * inv_scale ~= x."""
    amax = torch.max(torch.abs(x))
    scale = amax_to_scale(amax, float8_dtype)
    fp8_max = torch.finfo(float8_dtype).max
    x_scaled = x.to(torch.float32) * scale
    x_fp8 = x_scaled.clamp(min=-fp8_max, max=fp8_max).to(float8_dtype)  # saturated cast
    return x_fp8, scale.reciprocal()


def addmm_float8(a_fp8, a_inv_scale, b_fp8, b_inv_scale, output_dtype, use_fast_accum=False):
    """a @ b of two fp8 tensors. a must be row-major, b column-major (cuBLASLt's TN layout)."""
    if HAS_FP8_GEMM:
        return torch._scaled_mm(
            a_fp8, b_fp8,
            scale_a=a_inv_scale, scale_b=b_inv_scale,
            out_dtype=output_dtype, use_fast_accum=use_fast_accum,
        )
    # no fp8 GEMM here: emulate with the same casts, matmul in bf16
    out = torch.mm(a_fp8.to(torch.bfloat16), b_fp8.to(torch.bfloat16))
    return (out.to(torch.float32) * (a_inv_scale * b_inv_scale)).to(output_dtype)


class matmul_with_float8_args(torch.autograd.Function):
    """y = x @ w.t() with x, w and grad_y cast to fp8 (e4m3 forward, e5m2 gradient)."""

    @staticmethod
    def forward(ctx, input, weight):
        orig_shape = input.shape
        input_2d = input.reshape(-1, orig_shape[-1])
        input_fp8, input_inv_scale = to_float8(input_2d, torch.float8_e4m3fn)
        weight_fp8, weight_inv_scale = to_float8(weight, torch.float8_e4m3fn)
        ctx.save_for_backward(input_fp8, input_inv_scale, weight_fp8, weight_inv_scale)
        ctx.input_dtype = input.dtype
        ctx.weight_dtype = weight.dtype
        # weight_fp8 is (out, in) row-major, so weight_fp8.t() is (in, out) column-major
        output = addmm_float8(input_fp8, input_inv_scale, weight_fp8.t(), weight_inv_scale,
                              output_dtype=torch.bfloat16, use_fast_accum=True)
        return output.reshape(*orig_shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_fp8, input_inv_scale, weight_fp8, weight_inv_scale = ctx.saved_tensors
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        go_fp8, go_inv_scale = to_float8(grad_output_2d, torch.float8_e5m2)

        # grad_input = grad_output @ weight: (M, N) @ (N, K); weight needs to be column-major
        weight_fp8_col = weight_fp8.t().contiguous().t()
        grad_input = addmm_float8(go_fp8, go_inv_scale, weight_fp8_col, weight_inv_scale,
                                  output_dtype=ctx.input_dtype)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])

        # grad_weight = grad_output.t() @ input: (N, M) @ (M, K)
        go_fp8_t = go_fp8.t().contiguous()
        input_fp8_col = input_fp8.t().contiguous().t()
        grad_weight = addmm_float8(go_fp8_t, go_inv_scale, input_fp8_col, input_inv_scale,
                                   output_dtype=ctx.weight_dtype)
        return grad_input, grad_weight


class Float8Linear(nn.Linear):
    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new_mod = cls(mod.in_features, mod.out_features, bias=False)
        new_mod.weight = mod.weight
        new_mod.bias = mod.bias
        return new_mod

    def forward(self, input):
        if torch.is_autocast_enabled(input.device.type):
            # autocast does not see inside the custom Function: cast like F.linear would
            input = input.to(torch.get_autocast_dtype(input.device.type))
        output = matmul_with_float8_args.apply(input, self.weight)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def extra_repr(self):
        return super().extra_repr() + ", cast=dynamic_tensorwise"


def swap_linear_with_float8_linear(module, module_filter_fn=None, fqn=""):
    for name, child in module.named_children():
        child_fqn = f"{fqn}.{name}" if fqn else name
        if type(child) is nn.Linear and (module_filter_fn is None or module_filter_fn(child, child_fqn)):
            setattr(module, name, Float8Linear.from_float(child))
        else:
            swap_linear_with_float8_linear(child, module_filter_fn, child_fqn)
    return module


# ----------------------------------------------------------------------------------
# model (nanoGPT)

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

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
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


model = GPT(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
if not args.no_fp8:
    # torchao's default filter: skip the output projection and dims that fp8 GEMMs can't take
    def module_filter_fn(mod, fqn):
        return fqn != "lm_head" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
    swap_linear_with_float8_linear(model, module_filter_fn)
param_dtype = getattr(torch, args.param_dtype)
model = model.to(device=device, dtype=param_dtype)
print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M, "
      f"fp8 linears: {sum(isinstance(m, Float8Linear) for m in model.modules())}, fp8 GEMM: {HAS_FP8_GEMM}")

use_autocast = param_dtype == torch.float32
ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_autocast)

decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr, betas=(0.9, 0.95), fused=device_type == "cuda",
)


def get_batch():
    data = torch.randint(args.vocab_size, (args.batch_size, args.block_size + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


model.train()
t0 = time.time()
for it in range(args.steps):
    x, y = get_batch()
    with ctx:
        logits, loss = model(x, y)
    loss.backward()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    print(f"iter {it}: loss {loss.item():.4f}, time {(t1 - t0) * 1000:.1f}ms")
    t0 = t1

if device_type == "cuda":
    print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
