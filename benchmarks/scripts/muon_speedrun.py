#!/usr/bin/env python
"""A modded-nanogpt-style "speedrun" training script, single GPU, on random tokens.

GPT with rotary embeddings, QK-norm, ReLU^2 MLP, value embeddings mixed into the
attention values, U-net skip connections and a tanh/sigmoid-capped lm_head; Muon
(Newton-Schulz orthogonalized momentum, in bf16) for the blocks' hidden matrices
and Adam for the embeddings, the head and the scalars; the learning rate and
Muon's momentum set by hand on the param groups every step.

    python muon_speedrun.py                                           # ~69M params (51M of them in the four embeddings)
    python muon_speedrun.py --num-layers 12 --num-heads 6 --head-dim 128 --model-dim 768 \
        --seq-len 1024 --batch-size 64 --num-iterations 10            # GPT-2 small shape
"""

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# Muon optimizer


def zeropower_via_newtonschulz5(G, steps: int):
    """
    Newton-Schulz iteration to compute the zeroth power / orthogonalization of G. We opt to use a
    quintic iteration whose coefficients are selected to maximize the slope at zero. For the purpose
    of minimizing steps, it turns out to be empirically effective to keep increasing the slope at
    zero even beyond the point where the iteration no longer converges all the way to one everywhere
    on the interval. This iteration therefore does not produce UV^T but rather something like US'V^T
    where S' is diagonal with S_{ii}' ~ Uniform(0.5, 1.5), which turns out not to hurt model
    performance at all relative to UV^T, where USV^T = G is the SVD.
    """
    assert G.ndim >= 2  # batched Muon implementation by @scottjmaddox, and put into practice in the record by @YouJiacheng
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT

    # Ensure spectral norm is at most 1
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    # Perform the NS iterations
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A  # quintic computation strategy adapted from suggestion by @jxbz, @leloykun, and @YouJiacheng
        X = a * X + B @ X

    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class Muon(torch.optim.Optimizer):
    """
    Muon - MomentUm Orthogonalized by Newton-schulz

    Muon internally runs standard SGD-momentum, and then performs an orthogonalization post-
    processing step, in which each 2D parameter's update is replaced with the nearest orthogonal
    matrix. To efficiently orthogonalize each update, we use a Newton-Schulz iteration, which has
    the advantage that it can be stably run in bfloat16 on the GPU.

    Some warnings:
    - This optimizer should not be used for the embedding layer, the final fully connected layer,
    or any {0,1}-D parameters; those should all be optimized by a standard method (e.g., AdamW).
    """

    def __init__(self, params, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        params = list(params)
        assert all(isinstance(p, torch.Tensor) for p in params)
        # group parameters of one shape together, so they can be orthogonalized in one batch
        shapes = sorted({tuple(p.shape) for p in params})
        param_groups = [dict(params=[p for p in params if tuple(p.shape) == shape]) for shape in shapes]
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                grads.append(p.grad.lerp_(buf, group["momentum"]) if group["nesterov"] else buf)
            # orthogonalize every update of this group at once
            g = torch.stack(grads)
            v = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
            for p, u in zip(params, v.unbind(0)):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u.view_as(p), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)


# -----------------------------------------------------------------------------
# PyTorch nn.Module definitions for the GPT model


def norm(x: torch.Tensor):
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        std = 0.5 * (self.in_features ** -0.5)  # 0.5 is a bit better than the default 1/sqrt(3)
        bound = (3 ** 0.5) * std
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    def __init__(self, dim: int, max_seq_len: int):
        super().__init__()
        # half-truncate RoPE by @YouJiacheng (w/ base freq tuning)
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(dim // 4)])
        t = torch.arange(max_seq_len, dtype=torch.float32)
        theta = torch.einsum("i,j -> ij", t, angular_freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD: torch.Tensor):
        assert self.cos.size(0) >= x_BTHD.size(-3)
        cos, sin = self.cos[None, : x_BTHD.size(-3), None, :], self.sin[None, : x_BTHD.size(-3), None, :]
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x_BTHD)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, max_seq_len: int, head_dim=128):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        hdim = num_heads * head_dim
        std = 0.5 * (dim ** -0.5)
        bound = (3 ** 0.5) * std  # improved init scale by @YouJiacheng
        # merged QKV weights: suggested by many, implemented by @fernbear.bsky.social, and further improved by @YouJiacheng
        # https://x.com/hi_tysam/status/1879699187107033311
        self.qkv_w = nn.Parameter(torch.empty(3, hdim, dim).uniform_(-bound, bound))
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.rotary = Rotary(head_dim, max_seq_len)
        self.c_proj = CastedLinear(hdim, dim)
        self.c_proj.weight.detach().zero_()  # zero init suggested by @Grad62304977

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None):
        B, T = x.size(0), x.size(1)
        q, k, v = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
        q, k = norm(q), norm(k)  # QK norm @Grad62304977
        q, k = self.rotary(q), self.rotary(k)
        if ve is not None:
            v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)  # @KoszarskyB & @Grad62304977
        else:  # skip mid-layers token value embeddings by @YouJiacheng
            v = self.lambdas[0] * v
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.12)
        y = y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim)  # re-assemble all head outputs side by side
        y = self.c_proj(y)
        return y


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        hdim = 4 * dim
        self.c_fc = CastedLinear(dim, hdim)
        self.c_proj = CastedLinear(hdim, dim)
        self.c_proj.weight.detach().zero_()  # zero init suggested by @Grad62304977

    def forward(self, x: torch.Tensor):
        x = self.c_fc(x)
        x = F.relu(x).square()  # https://arxiv.org/abs/2109.08668v2; ~1-2% better than GELU; suggested by @SKYLINEZ007 and @Grad62304977
        x = self.c_proj(x)
        return x


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, max_seq_len: int, layer_idx: int, head_dim: int, skip_attn_layer: int):
        super().__init__()
        # skip attention of one middle block by @YouJiacheng
        self.attn = CausalSelfAttention(dim, num_heads, max_seq_len, head_dim) if layer_idx != skip_attn_layer else None
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, x0: torch.Tensor):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), ve)
        x = x + self.mlp(norm(x))
        return x


def next_multiple_of_n(v: float | int, *, n: int):
    return next(x for x in range(n, int(v) + 1 + n, n) if x >= v)


class GPT(nn.Module):
    def __init__(self, vocab_size: int, num_layers: int, num_heads: int, model_dim: int, max_seq_len: int, head_dim: int):
        super().__init__()
        assert num_layers >= 6 and num_layers % 2 == 0
        self.embed = nn.Embedding(vocab_size, model_dim)
        # token value embeddings by @KoszarskyB - inspired by @Grad62304977's value residual implementation following https://arxiv.org/abs/2410.17897
        # value embedding code simplification inspired by @ragulpr https://github.com/KellerJordan/modded-nanogpt/pull/78
        self.value_embeds = nn.ModuleList([nn.Embedding(vocab_size, model_dim) for _ in range(3)])
        skip_attn_layer = num_layers // 2 + 1 if num_layers > 6 else -1
        self.blocks = nn.ModuleList([Block(model_dim, num_heads, max_seq_len, i, head_dim, skip_attn_layer) for i in range(num_layers)])
        # there are only 50257 unique GPT-2 tokens; we extend to nearest multiple of 128 for efficiency.
        # suggested to me by @Grad62304977. this originates from Karpathy's experiments.
        self.lm_head = CastedLinear(model_dim, next_multiple_of_n(vocab_size, n=128))
        self.lm_head.weight.detach().zero_()  # @Grad62304977
        # Add learnable skip connection weights for decoder layers
        self.skip_weights = nn.Parameter(torch.ones(num_layers // 2))

    def forward(self, input_seq: torch.Tensor, target_seq: torch.Tensor):
        ve = [value_embed(input_seq) for value_embed in self.value_embeds]
        # 012 ... 012 structure on token value embeddings by @YouJiacheng, improved on @leloykun's U-net structure
        ve = [ve[0], ve[1], ve[2]] + [None] * (len(self.blocks) - 6) + [ve[0], ve[1], ve[2]]
        assert len(ve) == len(self.blocks)

        x = x0 = norm(self.embed(input_seq))  # use of norm here by @Grad62304977

        # U-net design by @brendanh0gan
        skip_connections = []
        n = len(self.skip_weights)
        for i in range(len(self.blocks)):
            if i >= n:
                x = x + self.skip_weights[i - n] * skip_connections.pop()
            x = self.blocks[i](x, ve[i], x0)
            if i < n:
                skip_connections.append(x)

        x = norm(x)
        logits = self.lm_head(x).float()
        # @Grad62304977 added tanh softcapping following Gemma 2 paper, @KoszarskyB reduced it from 30 to 15, @YouJiacheng shifted it by +15 (2*sigmoid(2*x)=tanh(x)+1)
        logits = 30 * torch.sigmoid(logits / (7.5 * x.size(-1) ** 0.5))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target_seq.reshape(-1), reduction="sum" if self.training else "mean")
        return loss


# -----------------------------------------------------------------------------
# Our own simple data loader: random tokens stand in for the fineweb shards


def random_data_generator(vocab_size: int, batch_size: int, seq_len: int, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        buf = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
        if device.type == "cuda":
            buf = buf.pin_memory()
        inputs = buf[:, :-1].to(device=device, dtype=torch.int32, non_blocking=True)  # no sync on host side;
        targets = buf[:, 1:].to(device=device, dtype=torch.int64, non_blocking=True)  # H2D in another stream isn't helpful.
        yield inputs, targets


# -----------------------------------------------------------------------------
# int main


@dataclass
class Hyperparameters:
    # optimization
    batch_size: int = 8  # sequences per micro-batch
    seq_len: int = 512
    grad_accum_steps: int = 1
    num_iterations: int = 8  # number of iterations to run
    cooldown_frac: float = 0.4  # fraction of training spent cooling down the learning rate
    # evaluation and logging
    val_loss_every: int = 4  # every how many steps to evaluate val loss? 0 for only at the end
    val_steps: int = 2
    # architecture
    vocab_size: int = 50257
    num_layers: int = 6
    num_heads: int = 4
    head_dim: int = 64
    model_dim: int = 256
    compile: bool = False


def parse_args() -> Hyperparameters:
    parser = argparse.ArgumentParser()
    defaults = Hyperparameters()
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    return Hyperparameters(**vars(parser.parse_args()))


def main():
    args = parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    master_process = int(os.environ.get("RANK", 0)) == 0

    def print0(s):
        if master_process:
            print(s, flush=True)

    print0(f"Running PyTorch {torch.version.__version__} on {device}")

    global zeropower_via_newtonschulz5
    if args.compile:
        zeropower_via_newtonschulz5 = torch.compile(zeropower_via_newtonschulz5)

    model = GPT(
        vocab_size=args.vocab_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        model_dim=args.model_dim,
        max_seq_len=args.seq_len,
        head_dim=args.head_dim,
    ).to(device)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.bfloat16()
    print0(f"parameters: {sum(p.numel() for p in model.parameters()):,}")

    # collect the parameters to optimize
    hidden_matrix_params = [p for n, p in model.blocks.named_parameters() if p.ndim >= 2 and "embed" not in n]
    embed_params = [p for n, p in model.named_parameters() if "embed" in n]
    scalar_params = [p for p in model.parameters() if p.ndim < 2]
    head_params = [model.lm_head.weight]

    # init the optimizer(s)
    adam_params = [dict(params=head_params, lr=0.008), dict(params=embed_params, lr=0.6), dict(params=scalar_params, lr=0.04)]
    # small adam epsilon by @YouJiacheng. this is an alternate method of fixing the world_size dependence
    # discovered by @fernbear.bsky.social https://x.com/hi_tysam/status/1879692937589875094
    optimizer1 = torch.optim.Adam(adam_params, betas=(0.8, 0.95), eps=1e-10, fused=device.type == "cuda")
    optimizer2 = Muon(hidden_matrix_params, lr=0.05, momentum=0.95, weight_decay=0.0)
    optimizers = [optimizer1, optimizer2]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]

    # learning rate schedule: stable then decay
    def get_lr(step: int):
        x = step / args.num_iterations  # progress in training
        assert 0 <= x < 1
        if x < 1 - args.cooldown_frac:
            return 1.0
        else:
            w = (1 - x) / args.cooldown_frac
            return w * 1.0 + (1 - w) * 0.1

    ctx = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    train_loader = random_data_generator(args.vocab_size, args.batch_size, args.seq_len, device, seed=0)

    training_time_ms = 0
    # start the clock
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    # begin training
    train_steps = args.num_iterations
    for step in range(train_steps + 1):
        last_step = step == train_steps

        # --------------- VALIDATION SECTION -----------------
        if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
            # stop the clock
            if device.type == "cuda":
                torch.cuda.synchronize()
            training_time_ms += 1000 * (time.perf_counter() - t0)
            model.eval()
            val_loader = random_data_generator(args.vocab_size, args.batch_size, args.seq_len, device, seed=1)
            val_loss = 0
            with torch.no_grad():
                for _ in range(args.val_steps):
                    inputs, targets = next(val_loader)
                    with ctx:
                        val_loss += model(inputs, targets)
            val_loss /= args.val_steps
            del val_loader
            print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms step_avg:{training_time_ms/max(step, 1):.2f}ms")
            model.train()
            # start the clock again
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()

        if last_step:
            break

        # --------------- TRAINING SECTION -----------------
        for _ in range(args.grad_accum_steps):
            inputs, targets = next(train_loader)
            with ctx:
                loss = model(inputs, targets)
            loss.backward()
        if args.grad_accum_steps > 1:
            for param in model.parameters():
                param.grad /= args.grad_accum_steps
        # set optimization hyperparameters
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * get_lr(step)
        for group in optimizer2.param_groups:
            frac = min(step / 300, 1)  # momentum warmup for muon
            group["momentum"] = (1 - frac) * 0.85 + frac * 0.95
        # step the optimizers
        for opt in optimizers:
            opt.step()
        # null the gradients
        model.zero_grad(set_to_none=True)
        # logging
        approx_training_time_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
        print0(f"step:{step+1}/{train_steps} train_loss:{loss.item() / (args.batch_size * args.seq_len):.4f} train_time:{approx_training_time_ms:.0f}ms step_avg:{approx_training_time_ms/(step + 1):.2f}ms")

    if device.type == "cuda":
        print0(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 1024 // 1024} MiB "
               f"reserved: {torch.cuda.max_memory_reserved() // 1024 // 1024} MiB")


if __name__ == "__main__":
    main()
