#!/usr/bin/env python
"""A torchtitan-style mixture-of-experts decoder whose experts run with ``torch._grouped_mm``.

In the manner of torchtitan's ``torchtitan/models/moe.py`` (Llama-4 / DeepSeek-V3
MoE): a ``TokenChoiceTopKRouter`` (sigmoid scores, an ``expert_bias`` buffer
added for the top-k choice only, aux-loss-free load balancing), the tokens per
expert counted with ``torch.histc`` on the router's int64 expert ids, the
(token, slot) pairs sorted by expert with ``torch.argsort(stable=True)``, the
routed tokens gathered, scaled by their scores and sent through
``GroupedExperts``: each expert's group padded to a multiple of 8 tokens in a
static-size buffer (torchtitan's ``indices_padding_wrapper``, as the GPU's
grouped product needs), weights stacked as ``(experts, in, out)`` in bf16 and
run as three ``torch._grouped_mm`` with int32 offsets from
``torch.cumsum(tokens_per_expert, 0)``; a shared expert; outputs combined with
``scatter_add`` (even layers, torchtitan) or ``index_add_`` (odd layers, the
older Mixtral-style combine). Switch-style statistics from ``bincount`` feed a
small auxiliary loss. Attention is grouped-query with complex RoPE
(``view_as_complex``, torchtitan's ``freqs_cis``). The model is built on the
meta device, materialised with ``to_empty``, cast to bf16 and initialised
(``init_weights``) as torchtitan does; bf16 parameters, AdamW, gradient
clipping, random tokens.

``torch._grouped_mm`` needs bf16 operands and 16-byte aligned strides (every
dimension here is a multiple of 8).

    python grouped_mm_moe.py                      # 4 layers, d=512, 8 experts top-2, 8 x 512 tokens
    python grouped_mm_moe.py --device cpu --steps 2
"""

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 16384
    max_seq_len: int = 512
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    num_experts: int = 8
    top_k: int = 2
    moe_inter_dim: int = 1024
    num_shared_experts: int = 1
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance_coeff: float = 1e-3


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


def _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert):
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    # weights are (experts, in, out): x (tokens, in) @ w[e] for each expert's rows of x
    h = F.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16(), offs=offsets))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16(), offs=offsets)
    out = torch._grouped_mm(h, w2.bfloat16(), offs=offsets).type_as(x)
    return out


# On the GPU each token group must start 16 bytes apart along the token dimension: the weight
# gradient's grouped product (2D x 2D, tokens contracted) loads each group with TMA, and an
# unaligned group is a device-side assert (GroupMMCommon.cuh). torchtitan pads each expert's group
# to a multiple of TOKEN_GROUP_ALIGN_SIZE_M (8 for bf16) inside a static-size buffer.
TOKEN_GROUP_ALIGN_SIZE_M = 8


def generate_permute_indices(tokens_per_expert, num_experts, max_len, alignment, num_tokens):
    """torchtitan's generate_permute_indices (one rank), in torch ops: for every row of a buffer of
    ``max_len`` rows, which routed token fills it (``num_tokens``: the appended zero row, for padding),
    and each expert's padded group size."""
    counts = tokens_per_expert.long()
    padded = torch.clamp_min((counts + alignment - 1) // alignment * alignment, alignment)
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    src_start = torch.cumsum(counts, 0) - counts
    rows = torch.arange(max_len, device=counts.device)
    expert = torch.searchsorted(padded_end, rows, right=True).clamp_max(num_experts - 1)
    pos = rows - padded_start[expert]
    valid = (pos < counts[expert]) & (rows < padded_end[-1])
    permuted_indices = torch.where(valid, src_start[expert] + pos, torch.full_like(rows, num_tokens))
    return permuted_indices, padded


def _round_up(x, y):
    return (x + y - 1) // y * y


def indices_padding_wrapper(func):
    """torchtitan's wrapper around the experts: permute the routed tokens into aligned groups, run, unpermute."""
    def wrapper(w1, w2, w3, x, num_tokens_per_expert):
        num_experts = w1.shape[0]
        max_len = _round_up(x.shape[0] + num_experts * TOKEN_GROUP_ALIGN_SIZE_M, TOKEN_GROUP_ALIGN_SIZE_M)
        with torch.no_grad():
            permuted_indices, num_tokens_per_expert = generate_permute_indices(
                num_tokens_per_expert, num_experts, max_len, TOKEN_GROUP_ALIGN_SIZE_M, x.shape[0])
        x = torch.vstack((x, x.new_zeros((x.shape[-1]))))
        input_shape = x.shape
        x = x[permuted_indices, :]
        out = func(w1, w2, w3, x, num_tokens_per_expert)
        out_unpermuted = out.new_empty(input_shape)
        out_unpermuted[permuted_indices, :] = out
        return out_unpermuted[:-1]
    return wrapper


class GroupedExperts(nn.Module):
    def __init__(self, dim, hidden_dim, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x, num_tokens_per_expert):
        return indices_padding_wrapper(_run_experts_grouped_mm)(self.w1, self.w2, self.w3, x, num_tokens_per_expert)

    def init_weights(self, init_std):
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim, num_experts, top_k, route_norm, route_scale):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.route_norm = route_norm
        self.route_scale = route_scale

    def forward(self, x, expert_bias=None):
        scores = self.gate(x)
        scores = torch.sigmoid(scores.to(torch.float32))
        if expert_bias is not None:
            _, selected_experts_indices = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
            top_scores = scores.gather(dim=1, index=selected_experts_indices)
        else:
            top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        if self.route_norm:
            denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
            top_scores = top_scores / denominator
        top_scores = top_scores * self.route_scale
        ids = selected_experts_indices.view(-1)
        if ids.device.type == "cpu":  # CPU's histc takes floating point only; CUDA's takes int64 too
            ids = ids.float()
        num_tokens_per_expert = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected_experts_indices, num_tokens_per_expert

    def init_weights(self, init_std):
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)


class TokenReorderer(nn.Module):
    def __init__(self, num_experts, top_k):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, top_scores, selected_experts_indices):
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        return top_scores_experts_sorted, token_indices_experts_sorted


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, combine: str):
        super().__init__()
        dim = args.dim
        self.combine = combine
        self.experts = GroupedExperts(dim, args.moe_inter_dim, args.num_experts)
        self.router = TokenChoiceTopKRouter(dim, args.num_experts, args.top_k, args.route_norm, args.route_scale)
        self.reorderer = TokenReorderer(args.num_experts, args.top_k)
        self.shared_experts = (FeedForward(dim, args.moe_inter_dim * args.num_shared_experts)
                               if args.num_shared_experts > 0 else None)
        self.load_balance_coeff = args.load_balance_coeff
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)
        self.aux_stats = None

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        # Switch-style statistics for a small auxiliary loss: the fraction of slots per expert
        # (bincount, no gradient) times the mean router probability per expert.
        counts = torch.bincount(selected_experts_indices.view(-1), minlength=self.experts.num_experts)
        frac = counts.float() / selected_experts_indices.numel()
        probs = torch.sigmoid(self.router.gate(x).float()).mean(0)
        self.aux_stats = (frac * probs).sum() * self.experts.num_experts

        top_scores_experts_sorted, token_indices_experts_sorted = self.reorderer(top_scores, selected_experts_indices)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim))
        routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)

        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if self.combine == "scatter_add":
            index = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
            out = out.scatter_add(dim=0, index=index, src=routed_output)
        else:
            combined = torch.zeros_like(x)
            combined.index_add_(0, token_indices_experts_sorted, routed_output)
            out = out + combined
        return out.reshape(bs, slen, dim)

    def init_weights(self, init_std, buffer_device):
        self.experts.init_weights(init_std)
        self.router.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.device(buffer_device):
            self.expert_bias = torch.zeros(self.experts.num_experts, dtype=torch.float32)
            self.tokens_per_expert = torch.zeros(self.experts.num_experts, dtype=torch.float32)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.moe = MoE(args, "scatter_add" if layer_id % 2 == 0 else "index_add")
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self, buffer_device):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.moe.init_weights(self.weight_init_std, buffer_device)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _precompute_freqs_cis(self):
        return precompute_freqs_cis(self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta)

    def init_weights(self, buffer_device):
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        self.norm.reset_parameters()
        final_out_std = self.args.dim ** -0.5
        cutoff_factor = 3
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std,
                              a=-cutoff_factor * final_out_std, b=cutoff_factor * final_out_std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h)
        return self.output(h)


def update_expert_bias(model):
    """torchtitan's aux-loss-free load balancing, run after the optimizer step."""
    with torch.no_grad():
        for block in model.layers.values():
            moe = block.moe
            tpe = moe.tokens_per_expert
            delta = moe.load_balance_coeff * torch.sign(tpe.mean() - tpe)
            delta = delta - delta.mean()
            moe.expert_bias.add_(delta)
            tpe.zero_()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--aux-coef", type=float, default=1e-3)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def main():
    args = parse_args()
    device = args.device
    torch.manual_seed(0)
    model_args = ModelArgs(max_seq_len=args.seq_len)

    with torch.device("meta"):
        model = Transformer(model_args)
    model.to_empty(device=device)
    model.to(torch.bfloat16)  # bf16 parameters (torchtitan's param dtype)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()

    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters (bf16)")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1, foreach=True)

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        inputs = torch.randint(0, model_args.vocab_size, (args.batch_size, args.seq_len), device=device)
        labels = torch.randint(0, model_args.vocab_size, (args.batch_size, args.seq_len), device=device)
        optimizer.zero_grad()
        pred = model(inputs)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        aux = sum(block.moe.aux_stats for block in model.layers.values())
        (loss + args.aux_coef * aux).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm, foreach=True)
        optimizer.step()
        update_expert_bias(model)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"step {step:3d} | loss {loss.item():.4f} | grad_norm {grad_norm.item():.3f} | {dt * 1000:.0f} ms")
    if device == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
