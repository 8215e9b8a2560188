"""Causal linear-attention (Performer / FAVOR+-style) transformer LM on random tokens."""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
torch.set_float32_matmul_precision("high")


def softmax_kernel(x, proj, eps=1e-4):
    # positive random features: exp(w^T x - |x|^2 / 2)
    d = x.shape[-1]
    x = x * d ** -0.25
    xw = torch.einsum("bhnd,md->bhnm", x, proj)
    diag = (x ** 2).sum(-1, keepdim=True) / 2
    return torch.exp(xw - diag - xw.amax(dim=-1, keepdim=True).detach()) + eps


def causal_linear_attention(q, k, v, eps=1e-6):
    # prefix sums over the sequence: O(n * m * d) memory, the naive cumsum formulation
    kv = torch.einsum("bhnm,bhnd->bhnmd", k, v).cumsum(dim=2)
    num = torch.einsum("bhnm,bhnmd->bhnd", q, kv)
    den = torch.einsum("bhnm,bhnm->bhn", q, k.cumsum(dim=2)).unsqueeze(-1)
    return num / (den + eps)


class PerformerAttention(nn.Module):
    def __init__(self, dim, heads, nb_features):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("proj", torch.randn(nb_features, dim // heads))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        q, k = softmax_kernel(q, self.proj), softmax_kernel(k, self.proj)
        y = causal_linear_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, nb_features):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = PerformerAttention(dim, heads, nb_features)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class PerformerLM(nn.Module):
    def __init__(self, vocab, dim, depth, heads, nb_features, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, nb_features) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--nb-features", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()

    device = "cuda"
    model = PerformerLM(args.vocab, args.dim, args.depth, args.heads, args.nb_features, args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=True)
    for it in range(args.iters):
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), device=device)
        inp, tgt = x[:, :-1], x[:, 1:]
        logits = model(inp)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % 10 == 0:
            print(f"iter {it}: loss {loss.item():.4f} (uniform {math.log(args.vocab):.2f})")


if __name__ == "__main__":
    main()
