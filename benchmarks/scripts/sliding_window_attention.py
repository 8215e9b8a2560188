"""Longformer-style local (sliding-window) attention written by hand: keys/values padded by the window and unfolded with Tensor.unfold, einsum scores, masked_fill(-inf) of the out-of-sequence window slots, softmax, einsum with the values; a 6-layer MLM encoder at sequence length 4096, bf16 autocast, fused AdamW, 4 micro-batches of gradient accumulation with the loss divided by 4."""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def sliding_window_attention(q, k, v, window, dropout_p=0.0, training=True):
    """Each query i attends to keys i-window .. i+window (2*window+1 keys).

    q, k, v: (batch, heads, seq_len, head_dim)
    """
    B, H, L, D = q.shape
    W = 2 * window + 1
    # pad the sequence dimension so every query has a full window, then take overlapping windows
    k = F.pad(k, (0, 0, window, window))
    v = F.pad(v, (0, 0, window, window))
    k_win = k.unfold(2, W, 1)  # (B, H, L, D, W)
    v_win = v.unfold(2, W, 1)  # (B, H, L, D, W)

    scores = torch.einsum("bhld,bhldw->bhlw", q, k_win) / math.sqrt(D)

    # window slots that fall on the zero padding (before the start / past the end of the sequence)
    pad_mask = F.pad(torch.zeros(L, dtype=torch.bool, device=q.device), (window, window), value=True)
    pad_mask = pad_mask.unfold(0, W, 1)  # (L, W)
    scores = scores.masked_fill(pad_mask[None, None], float("-inf"))

    attn = F.softmax(scores, dim=-1)
    attn = F.dropout(attn, p=dropout_p, training=training)
    return torch.einsum("bhlw,bhldw->bhld", attn, v_win)


class LocalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, window, dropout=0.1):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.window = window
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = sliding_window_attention(q, k, v, self.window, self.dropout, self.training)
        y = y.transpose(1, 2).reshape(B, L, C)
        return self.out(y)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, window, dim_ff, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = LocalSelfAttention(d_model, n_heads, window, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, dim_ff), nn.GELU(), nn.Linear(dim_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        x = x + self.drop(self.ff(self.ln2(x)))
        return x


class LocalTransformerMLM(nn.Module):
    def __init__(self, vocab_size, max_len, d_model, n_heads, n_layers, window, dim_ff, dropout=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_heads, window, dim_ff, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_dense = nn.Linear(d_model, d_model)
        self.lm_ln = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tie
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids):
        B, L = input_ids.shape
        pos = torch.arange(L, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos)[None])
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        x = self.lm_ln(F.gelu(self.lm_dense(x)))
        return self.lm_head(x)


def get_batch(batch_size, seq_len, vocab_size, mask_token_id, device, mlm_prob=0.15):
    """Random token ids with BERT-style masking (labels -100 where not predicted)."""
    input_ids = torch.randint(5, vocab_size, (batch_size, seq_len), device=device)
    labels = input_ids.clone()
    masked = torch.rand(input_ids.shape, device=device) < mlm_prob
    labels[~masked] = -100
    replace = masked & (torch.rand(input_ids.shape, device=device) < 0.8)
    input_ids[replace] = mask_token_id
    return input_ids, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab_size", type=int, default=30522)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--n_heads", type=int, default=12)
    parser.add_argument("--n_layers", type=int, default=6)
    parser.add_argument("--window", type=int, default=64, help="one-sided attention window")
    parser.add_argument("--dim_ff", type=int, default=3072)
    parser.add_argument("--micro_batch_size", type=int, default=1)
    parser.add_argument("--grad_accum_steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--log_every", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(42)
    torch.cuda.manual_seed_all(42)
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True

    model = LocalTransformerMLM(args.vocab_size, args.seq_len, args.d_model, args.n_heads, args.n_layers,
                                args.window, args.dim_ff).to(device)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M | "
          f"seq_len {args.seq_len} | window {2 * args.window + 1}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
                                  weight_decay=args.weight_decay, fused=True)
    mask_token_id = 4

    model.train()
    for step in range(args.steps):
        t0 = time.time()
        accum_loss = 0.0
        for micro_step in range(args.grad_accum_steps):
            input_ids, labels = get_batch(args.micro_batch_size, args.seq_len, args.vocab_size, mask_token_id, device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(input_ids)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            loss = loss / args.grad_accum_steps
            loss.backward()
            accum_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            torch.cuda.synchronize()
            dt = time.time() - t0
            tokens = args.micro_batch_size * args.grad_accum_steps * args.seq_len
            print(f"step {step:4d} | loss {accum_loss.item():.4f} | grad norm {grad_norm.item():.3f} | "
                  f"{tokens / dt:,.0f} tok/s | max mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
