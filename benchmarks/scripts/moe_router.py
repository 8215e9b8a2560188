# Switch/Mixtral-style MoE LM block with top-k routing, per-expert loops, aux loss, AdamW(fused=True)
import argparse, math
import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--dim", type=int, default=768)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--experts", type=int, default=8)
ap.add_argument("--topk", type=int, default=2)
ap.add_argument("--layers", type=int, default=6)
ap.add_argument("--heads", type=int, default=12)
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--bs", type=int, default=8)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--aux_coef", type=float, default=0.01)
ap.add_argument("--device", default="cuda")
cfg = ap.parse_args()

class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False); self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

class MoE(nn.Module):
    def __init__(self, dim, hidden, n_experts, k):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim, hidden) for _ in range(n_experts)])
        self.k, self.n = k, n_experts
    def forward(self, x):
        B, T, C = x.shape
        x = x.view(-1, C)
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        topv, topi = torch.topk(probs, self.k, dim=-1)
        topv = topv / topv.sum(dim=-1, keepdim=True)
        topv = topv.to(x.dtype)
        # aux load-balancing loss (Switch): fraction routed * mean prob
        one_hot = F.one_hot(topi, self.n).float()           # (N, k, E)
        tokens_per_expert = one_hot.sum(dim=(0, 1)) / (x.shape[0] * self.k)
        aux = self.n * torch.sum(tokens_per_expert * probs.mean(0))
        out = torch.zeros_like(x)
        flat_i = topi.view(-1)
        flat_v = topv.view(-1, 1)
        token_idx = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.k)
        for e, expert in enumerate(self.experts):
            mask = flat_i == e
            if not mask.any():
                continue
            sel = token_idx[mask]
            y = expert(x[sel]) * flat_v[mask]
            out.index_add_(0, sel, y.to(out.dtype))
        return out.view(B, T, C), aux

class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim); self.ln2 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim); self.proj = nn.Linear(c.dim, c.dim)
        self.moe = MoE(c.dim, c.hidden, c.experts, c.topk); self.h = c.heads
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = [t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        m, aux = self.moe(self.ln2(x))
        return x + m, aux

class MoELM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim); self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.ln_f = nn.LayerNorm(c.dim); self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.tok.weight
    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        aux_total = 0.0
        for blk in self.blocks:
            x, aux = blk(x)
            aux_total = aux_total + aux
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss, aux_total / len(self.blocks)

device = cfg.device
model = MoELM(cfg).to(device)
n_params = sum(p.numel() for p in model.parameters())
print(f"{n_params/1e6:.1f}M params")
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=3e-4, betas=(0.9, 0.95), fused=(device == "cuda"))
for step in range(cfg.steps):
    idx = torch.randint(0, cfg.vocab, (cfg.bs, cfg.seq + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.autocast(device_type="cuda" if device == "cuda" else "cpu", dtype=torch.bfloat16):
        logits, loss, aux = model(x, y)
        total = loss + cfg.aux_coef * aux
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.4f} aux {aux.item():.4f}")
