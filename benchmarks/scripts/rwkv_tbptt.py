# RWKV-4-style LM (BlinkDL RWKV-LM / char-RNN style): custom autograd.Function WKV with a chunked Python time loop and a hand-written backward, truncated BPTT with a detached recurrent state, per-block non-reentrant checkpoint, fp16 autocast + torch.cuda.amp.GradScaler, clip after unscale_, LambdaLR warmup, Adam with param groups
"""RWKV-4 language model trained with truncated backpropagation through time.

The WKV time-mix is the RWKV-4 recurrence

    y_t = (a_t + e^{u+k_t} v_t) / (b_t + e^{u+k_t})
    a_{t+1} = w a_t + e^{k_t} v_t,   b_{t+1} = w b_t + e^{k_t}

written as a torch.autograd.Function whose forward walks the time axis in
chunks with a Python loop (no CUDA kernel to build) and whose backward is
written by hand, as RWKV-LM's "wkv_cuda" fallback and char-RNN repos do.
A long random "document" per batch row is cut into ctx_len chunks; each chunk
is one optimizer step, and the recurrent state (token-shift inputs and the WKV
numerator/denominator of every layer) is carried from chunk to chunk and
detached after the step. fp16 autocast with a GradScaler, gradients clipped
after unscale_, a linear LambdaLR warmup, Adam with separate parameter groups.

    python rwkv_tbptt.py                          # 6 layers, 512 wide, 16 x 128 per step, on cuda
    python rwkv_tbptt.py --device cpu --steps 3   # float32 on the CPU
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


########################################################################################################
# WKV: the time-mix recurrence, python loop forward, hand-written backward
########################################################################################################

class WKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k, v, aa, bb, chunk_len):
        # w: (C,) decay in (0, 1); u: (C,) bonus; k, v: (B, T, C); aa, bb: (B, C) carried state (fp32)
        B, T, C = k.shape
        out_dtype = k.dtype
        w = w.float().contiguous()
        u = u.float().contiguous()
        k = k.float().clamp(max=30.0).contiguous()  # RWKV-2/3: k = torch.clamp(k, max=60) before exp
        v = v.float().contiguous()
        a = aa.float().clone()
        b = bb.float().clone()
        a_hist = torch.empty(B, T, C, device=k.device, dtype=torch.float32)
        b_hist = torch.empty(B, T, C, device=k.device, dtype=torch.float32)
        y = torch.empty(B, T, C, device=k.device, dtype=torch.float32)
        for c0 in range(0, T, chunk_len):
            c1 = min(T, c0 + chunk_len)
            kc = k[:, c0:c1]
            vc = v[:, c0:c1]
            ek = torch.exp(kc)
            e = torch.exp(u + kc)
            ekv = ek * vc
            ev = e * vc
            for i in range(c1 - c0):
                t = c0 + i
                a_hist[:, t] = a
                b_hist[:, t] = b
                y[:, t] = (a + ev[:, i]) / (b + e[:, i])
                a = w * a + ekv[:, i]
                b = w * b + ek[:, i]
        ctx.save_for_backward(w, u, k, v, a_hist, b_hist)
        ctx.chunk_len = chunk_len
        return y.to(out_dtype), a, b

    @staticmethod
    def backward(ctx, gy, ga_T, gb_T):
        w, u, k, v, a_hist, b_hist = ctx.saved_tensors
        B, T, C = k.shape
        gy = gy.float()
        ek = torch.exp(k)
        e = torch.exp(u + k)
        N = a_hist + e * v
        D = b_hist + e
        gN = gy / D
        gD = -gy * N / (D * D)
        # reverse-time recurrence for the state gradients, chunk by chunk
        GA = torch.empty_like(a_hist)  # dL/d(state after step t)
        GB = torch.empty_like(b_hist)
        ga = ga_T.float().clone() if ga_T is not None else torch.zeros(B, C, device=k.device)
        gb = gb_T.float().clone() if gb_T is not None else torch.zeros(B, C, device=k.device)
        for c1 in range(T, 0, -ctx.chunk_len):
            c0 = max(0, c1 - ctx.chunk_len)
            for t in range(c1 - 1, c0 - 1, -1):
                GA[:, t] = ga
                GB[:, t] = gb
                ga = w * ga + gN[:, t]
                gb = w * gb + gD[:, t]
        gw = (GA * a_hist + GB * b_hist).sum((0, 1))
        gv = gN * e + GA * ek
        ge = gN * v + gD
        gk = (GA * v + GB) * ek + ge * e
        gu = (ge * e).sum((0, 1))
        g_aa = ga if ctx.needs_input_grad[4] else None
        g_bb = gb if ctx.needs_input_grad[5] else None
        return gw, gu, gk.to(gy.dtype), gv, g_aa, g_bb, None


def run_wkv(w, u, k, v, aa, bb, chunk_len):
    y, aa, bb = WKV.apply(w, u, k, v, aa, bb, chunk_len)
    return y, aa, bb


########################################################################################################
# RWKV-4 blocks
########################################################################################################

class RWKV_TimeMix(nn.Module):
    def __init__(self, n_embd, layer_id, n_layer, chunk_len):
        super().__init__()
        self.chunk_len = chunk_len
        ratio_0_to_1 = layer_id / (n_layer - 1)
        ratio_1_to_almost0 = 1.0 - (layer_id / n_layer)
        h = torch.arange(n_embd, dtype=torch.float32)
        decay_speed = -5 + 8 * (h / (n_embd - 1)) ** (0.7 + 1.3 * ratio_0_to_1)
        self.time_decay = nn.Parameter(decay_speed)
        zigzag = torch.tensor([(i + 1) % 3 - 1 for i in range(n_embd)]) * 0.5
        self.time_first = nn.Parameter(torch.ones(n_embd) * math.log(0.3) + zigzag)
        x = (torch.arange(n_embd, dtype=torch.float32) / n_embd).view(1, 1, n_embd)
        self.time_mix_k = nn.Parameter(torch.pow(x, ratio_1_to_almost0))
        self.time_mix_v = nn.Parameter(torch.pow(x, ratio_1_to_almost0) + 0.3 * ratio_0_to_1)
        self.time_mix_r = nn.Parameter(torch.pow(x, 0.5 * ratio_1_to_almost0))
        self.key = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(n_embd, n_embd, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.output = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x, x_last, aa, bb):
        xx = torch.cat([x_last.unsqueeze(1).to(x.dtype), x[:, :-1]], dim=1)  # token shift across chunks
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xv = x * self.time_mix_v + xx * (1 - self.time_mix_v)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = self.key(xk)
        v = self.value(xv)
        sr = torch.sigmoid(self.receptance(xr))
        w = torch.exp(-torch.exp(self.time_decay))
        wkv, aa, bb = run_wkv(w, self.time_first, k, v, aa, bb, self.chunk_len)
        return self.output(sr * wkv), x[:, -1], aa, bb


class RWKV_ChannelMix(nn.Module):
    def __init__(self, n_embd, layer_id, n_layer):
        super().__init__()
        ratio_1_to_almost0 = 1.0 - (layer_id / n_layer)
        x = (torch.arange(n_embd, dtype=torch.float32) / n_embd).view(1, 1, n_embd)
        self.time_mix_k = nn.Parameter(torch.pow(x, ratio_1_to_almost0))
        self.time_mix_r = nn.Parameter(torch.pow(x, ratio_1_to_almost0))
        hidden_sz = 4 * n_embd
        self.key = nn.Linear(n_embd, hidden_sz, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(hidden_sz, n_embd, bias=False)

    def forward(self, x, x_last):
        xx = torch.cat([x_last.unsqueeze(1).to(x.dtype), x[:, :-1]], dim=1)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = torch.square(torch.relu(self.key(xk)))
        kv = self.value(k)
        return torch.sigmoid(self.receptance(xr)) * kv, x[:, -1]


class Block(nn.Module):
    def __init__(self, n_embd, layer_id, n_layer, chunk_len):
        super().__init__()
        self.layer_id = layer_id
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(n_embd)
        self.att = RWKV_TimeMix(n_embd, layer_id, n_layer, chunk_len)
        self.ffn = RWKV_ChannelMix(n_embd, layer_id, n_layer)

    def forward(self, x, state):
        att_x, ffn_x, aa, bb = state
        if self.layer_id == 0:
            x = self.ln0(x)
        dx, att_x, aa, bb = self.att(self.ln1(x), att_x, aa, bb)
        x = x + dx
        dx, ffn_x = self.ffn(self.ln2(x), ffn_x)
        x = x + dx
        return x, (att_x, ffn_x, aa, bb)


class RWKV(nn.Module):
    def __init__(self, vocab_size, n_embd, n_layer, chunk_len=16, grad_cp=False):
        super().__init__()
        self.n_embd, self.n_layer, self.grad_cp = n_embd, n_layer, grad_cp
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, i, n_layer, chunk_len) for i in range(n_layer)])
        self.ln_out = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        nn.init.uniform_(self.emb.weight, a=-1e-4, b=1e-4)
        nn.init.orthogonal_(self.head.weight, gain=0.5 * math.sqrt(vocab_size / n_embd))

    def init_state(self, batch_size, device):
        return [
            (torch.zeros(batch_size, self.n_embd, device=device),
             torch.zeros(batch_size, self.n_embd, device=device),
             torch.zeros(batch_size, self.n_embd, device=device),
             torch.zeros(batch_size, self.n_embd, device=device))
            for _ in range(self.n_layer)
        ]

    def forward(self, idx, state):
        x = self.emb(idx)
        new_state = []
        for block, s in zip(self.blocks, state):
            if self.grad_cp and self.training:
                x, s = checkpoint(block, x, s, use_reentrant=False)
            else:
                x, s = block(x, s)
            new_state.append(s)
        x = self.ln_out(x)
        return self.head(x), new_state


########################################################################################################
# training: truncated BPTT over long random documents
########################################################################################################

def parse_args():
    p = argparse.ArgumentParser(description="RWKV-4 LM with truncated BPTT")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (one ctx_len chunk each)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--ctx-len", type=int, default=128, help="tokens per chunk (the BPTT truncation)")
    p.add_argument("--doc-chunks", type=int, default=4, help="chunks per document before the state resets")
    p.add_argument("--chunk-len", type=int, default=16, help="time steps per chunk of the WKV python loop")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--grad-cp", type=int, default=1, help="1: checkpoint every block")
    p.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = args.device  # "cuda", as the original scripts hard-code it
    use_fp16 = args.precision == "fp16" and device == "cuda"

    model = RWKV(args.vocab_size, args.n_embd, args.n_layer, args.chunk_len, grad_cp=bool(args.grad_cp)).to(device)
    model.train()

    # RWKV-LM: no weight decay for layer norms, embeddings and the time_* vectors
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.dim() >= 2 and "ln" not in n and "emb" not in n and "time_" not in n:
            decay.append(p)
        else:
            no_decay.append(p)
    optim_groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.Adam(optim_groups, lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    scaler = torch.cuda.amp.GradScaler(enabled=use_fp16)

    n_params = sum(p.numel() for p in model.parameters())
    print(f"RWKV {args.n_layer}x{args.n_embd}, {n_params / 1e6:.2f}M params, "
          f"decay {sum(p.numel() for p in decay) / 1e6:.2f}M / no decay {sum(p.numel() for p in no_decay) / 1e6:.2f}M")

    doc_len = args.ctx_len * args.doc_chunks
    docs, pos, state = None, doc_len, None
    t0 = time.time()
    for step in range(args.steps):
        if pos + args.ctx_len > doc_len:  # a new batch of documents: start from a fresh state
            docs = torch.randint(0, args.vocab_size, (args.batch_size, doc_len + 1))
            pos = 0
            state = model.init_state(args.batch_size, device)
        x = docs[:, pos:pos + args.ctx_len].to(device, non_blocking=True)
        y = docs[:, pos + 1:pos + args.ctx_len + 1].to(device, non_blocking=True)
        pos += args.ctx_len

        with torch.cuda.amp.autocast(enabled=use_fp16, dtype=torch.float16):
            logits, state = model(x, state)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        # truncated BPTT: keep the state's values, drop its history
        state = [tuple(s.detach() for s in layer) for layer in state]

        print(f"step {step} loss {loss.item():.4f} grad_norm {float(grad_norm):.3f} "
              f"lr {scheduler.get_last_lr()[0]:.2e} scale {scaler.get_scale():.0f} "
              f"pos {pos}/{doc_len} {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
