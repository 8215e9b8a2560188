#!/usr/bin/env python
"""A decoder with mixture-of-experts MLPs, dispatched by sorting tokens by expert.

In the manner of Megablocks-free MoE codebases (OLMoE's dropless MoE without
grouped GEMM, Mixtral-style top-2 routers written by hand): router logits,
top-2 of the softmaxed probabilities, the (token, slot) pairs sorted by expert
with ``argsort``, the tokens per expert counted with ``bincount(minlength=E)``,
``split(counts.tolist())`` into one chunk per expert, each chunk through its
SwiGLU expert, and ``index_add_`` of the weighted outputs back into the token
order. A Switch-style load-balancing loss and a router z-loss are added to the
language-model loss. bf16 autocast, AdamW, random tokens.

    python moe_sorted_dispatch.py                          # 8 layers x 8 experts, d=1024, 8 x 1024 tokens
    python moe_sorted_dispatch.py --tiny --device cpu      # a quick check on the CPU
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=2816)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--z-loss-coef", type=float, default=0.001)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a small model for a CPU check")
    args = p.parse_args()
    if args.tiny:
        args.vocab_size, args.d_model, args.n_layers, args.n_heads = 512, 64, 2, 4
        args.expert_hidden, args.seq_len, args.batch_size, args.steps = 128, 32, 2, 2
    return args


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(seq_len, head_dim, device, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[None, None], emb.sin()[None, None]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class Expert(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SortedMoE(nn.Module):
    """Top-k routing with the tokens sorted by expert and split into contiguous chunks."""

    def __init__(self, d, hidden, n_experts, top_k):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(n_experts))

    def forward(self, x):
        B, T, C = x.shape
        tokens = x.reshape(-1, C)                                     # (N, C)
        N = tokens.shape[0]
        router_logits = self.router(tokens)                           # (N, E)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_w, top_e = torch.topk(probs, self.top_k, dim=-1)          # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        # sort the (token, slot) pairs by expert
        flat_e = top_e.reshape(-1)                                    # (N*k,)
        order = torch.argsort(flat_e, stable=True)
        token_of = order // self.top_k                                # which token each sorted slot is
        counts = torch.bincount(flat_e, minlength=self.n_experts)     # tokens per expert
        sorted_tokens = tokens[token_of]                              # (N*k, C), grouped by expert
        sorted_w = top_w.reshape(-1)[order].unsqueeze(-1)

        outs = []
        for expert, chunk in zip(self.experts, sorted_tokens.split(counts.tolist(), dim=0)):
            if chunk.shape[0] == 0:
                outs.append(chunk)
                continue
            outs.append(expert(chunk))
        expert_out = torch.cat(outs, dim=0) * sorted_w.to(x.dtype)
        out = torch.zeros_like(tokens, dtype=expert_out.dtype)
        out.index_add_(0, token_of, expert_out)

        # Switch-style load balancing: E * sum_e (fraction of slots to e) * (mean router prob of e)
        frac = counts.float() / (N * self.top_k)
        aux = self.n_experts * torch.sum(frac * probs.mean(dim=0))
        z = torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()
        return out.view(B, T, C), aux, z, counts


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attn_norm = RMSNorm(a.d_model)
        self.attn = Attention(a.d_model, a.n_heads)
        self.moe_norm = RMSNorm(a.d_model)
        self.moe = SortedMoE(a.d_model, a.expert_hidden, a.n_experts, a.top_k)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        m, aux, z, counts = self.moe(self.moe_norm(x))
        return x + m, aux, z, counts


class MoEDecoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.d_model)
        self.lm_head = nn.Linear(a.d_model, a.vocab_size, bias=False)
        self.head_dim = a.d_model // a.n_heads
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        cos, sin = rotary(T, self.head_dim, idx.device)
        x = self.embed(idx)
        aux_total, z_total, all_counts = 0.0, 0.0, []
        for blk in self.blocks:
            x, aux, z, counts = blk(x, cos, sin)
            aux_total = aux_total + aux
            z_total = z_total + z
            all_counts.append(counts)
        logits = self.lm_head(self.norm(x))
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        n = len(self.blocks)
        return loss, aux_total / n, z_total / n, torch.stack(all_counts)


def main():
    a = parse_args()
    torch.manual_seed(0)
    device = torch.device(a.device)
    model = MoEDecoder(a).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"{n_params / 1e6:.1f} M parameters ({n_expert / 1e6:.1f} M in experts)")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=a.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    model.train()
    for step in range(a.steps):
        t0 = time.time()
        idx = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len + 1), device=device)
        inputs, targets = idx[:, :-1], idx[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            lm_loss, aux, z, counts = model(inputs, targets)
            loss = lm_loss + a.aux_loss_coef * aux + a.z_loss_coef * z
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        load = counts.float() / counts.sum(dim=1, keepdim=True)
        print(f"step {step}: loss {lm_loss.item():.4f} aux {aux.item():.4f} z {z.item():.3f} "
              f"grad_norm {grad_norm.item():.3f} max expert load {load.max().item():.3f} "
              f"({(time.time() - t0) * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
