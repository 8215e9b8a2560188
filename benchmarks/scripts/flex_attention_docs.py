# Small GPT with FlexAttention (attention-gym / torchtitan habits): document-causal +
# sliding-window block mask rebuilt per batch with create_block_mask, flex_attention
# wrapped in torch.compile, bf16 autocast, AdamW, grad clipping.
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex_attention = torch.compile(flex_attention, dynamic=False)

VOCAB, DIM, N_LAYERS, N_HEADS, SEQ, BATCH, WINDOW = 50304, 768, 12, 12, 4096, 4, 1024
STEPS = 8
device = "cuda"


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, block_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, N_HEADS, C // N_HEADS).permute(2, 0, 3, 1, 4)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # QK-norm
        y = flex_attention(q, k, v, block_mask=block_mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(approximate="tanh"), nn.Linear(4 * DIM, DIM))

    def forward(self, x, block_mask):
        x = x + self.attn(self.ln1(x), block_mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(N_LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, block_mask, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x, block_mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def doc_causal_window_mask(doc_ids):
    def mask_mod(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        same_doc = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        window = q_idx - kv_idx <= WINDOW
        return causal & same_doc & window
    return create_block_mask(mask_mod, B=doc_ids.size(0), H=None, Q_LEN=SEQ, KV_LEN=SEQ, device=device)


def get_batch(eot=50256):
    x = torch.randint(0, eot, (BATCH, SEQ + 1), device=device)
    # sprinkle end-of-text tokens so that rows hold several documents
    eos_pos = torch.randint(0, SEQ + 1, (BATCH, 6), device=device)
    x.scatter_(1, eos_pos, eot)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    doc_ids = torch.cumsum((inp == eot).int(), dim=1)
    return inp, tgt, doc_ids


def main():
    torch.manual_seed(0)
    model = GPT().to(device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    for step in range(STEPS):
        t0 = time.perf_counter()
        inp, tgt, doc_ids = get_batch()
        block_mask = doc_causal_window_mask(doc_ids)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            _, loss = model(inp, block_mask, tgt)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = 6e-4 * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"step {step} | loss {loss.item():.4f} | norm {norm:.3f} | lr {lr:.2e} | {dt * 1000:.0f} ms "
              f"| sparsity {block_mask.sparsity():.1f}%")
    print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
