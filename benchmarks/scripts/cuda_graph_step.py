# Whole-training-step CUDA graph capture (PyTorch docs "whole network capture" /
# MLPerf habits): static input/target buffers, side-stream warmup, capturable AdamW,
# torch.cuda.CUDAGraph + torch.cuda.graph(...), replay per step with copy_() into the
# static tensors. A small pre-LN transformer LM in bf16 autocast.
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, HEADS, T, B = 32768, 1024, 8, 16, 1024, 8
STEPS, WARMUP_ITERS = 8, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.zeros(1, T, D))
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.emb(idx) + self.pos)))


def main():
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = LM().to(device)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    static_input = torch.randint(0, VOCAB, (B, T), device=device)
    static_target = torch.randint(0, VOCAB, (B, T), device=device)

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(static_input)
            loss = loss_fn(logits.float().view(-1, VOCAB), static_target.view(-1))
        loss.backward()
        opt.step()
        return loss

    # warm up on a side stream (required before capture)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(WARMUP_ITERS):
            opt.zero_grad(set_to_none=True)
            train_step()
    torch.cuda.current_stream().wait_stream(s)

    # capture: grads are allocated from the graph's private pool
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = train_step()
    print(f"captured; allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
          f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")

    for step in range(STEPS):
        data = torch.randint(0, VOCAB, (B, T + 1), device=device)
        static_input.copy_(data[:, :-1])
        static_target.copy_(data[:, 1:])
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        print(f"step {step}: loss {static_loss.item():.4f} ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
    print(f"max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"max reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
