"""Partial-network CUDA graphs as in the PyTorch CUDA-graphs docs and NVIDIA's MLPerf BERT: torch.cuda.make_graphed_callables on the encoder layers, eager loss and AdamW."""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_args():
    parser = argparse.ArgumentParser(description="Train an encoder whose layers are CUDA-graphed callables")
    parser.add_argument("--arch", choices=["encoder", "mlp"], default="encoder")
    parser.add_argument("--vocab-size", type=int, default=30528)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--warmup-iters", type=int, default=3, help="side-stream warm-up iterations")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (cache_enabled=False)")
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


class MLPBlock(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Encoder(nn.Module):
    """BERT-style masked-LM: embeddings (eager), a stack of layers (graphed), an LM head (eager)."""

    def __init__(self, args):
        super().__init__()
        self.tok_emb = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_emb = nn.Embedding(args.seq_len, args.d_model)
        self.emb_norm = nn.LayerNorm(args.d_model)
        if args.arch == "encoder":
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(args.d_model, args.n_heads, 4 * args.d_model, args.dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
                for _ in range(args.n_layers)
            )
        else:
            self.layers = nn.ModuleList(MLPBlock(args.d_model, args.dropout) for _ in range(args.n_layers))
        self.final_norm = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size)

    def embed(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.emb_norm(self.tok_emb(idx) + self.pos_emb(pos))

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final_norm(x))


def main():
    args = get_args()
    torch.manual_seed(args.seed)
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    model = Encoder(args).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.arch}, {n_params / 1e6:.1f}M parameters")

    # AdamW with capturable=False: the optimizer step stays outside the graphs.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, capturable=False)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.amp, cache_enabled=False)

    # Static-shape synthetic batches (MLPerf pads every batch to max_seq_length).
    def get_batch():
        idx = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=device)
        labels = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=device)
        return idx, labels

    # Warm up on a side stream before capturing, as the CUDA-graphs docs show.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(args.warmup_iters):
            idx, labels = get_batch()
            with autocast:
                logits = model(idx)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
            loss.backward()
            optimizer.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(s)

    # Graph every encoder layer. Sample args need requires_grad matching the real inputs
    # (each layer's input comes from the trainable embeddings).
    sample_args = tuple(
        (torch.randn(args.batch_size, args.seq_len, args.d_model, device=device, requires_grad=True),)
        for _ in range(len(model.layers))
    )
    t0 = time.time()
    with autocast:
        graphed = torch.cuda.make_graphed_callables(tuple(model.layers), sample_args)
    for i, layer in enumerate(graphed):
        model.layers[i] = layer
    torch.cuda.synchronize()
    print(f"captured {len(graphed)} graphed layers in {time.time() - t0:.2f}s")
    del sample_args

    step = 0
    t0 = time.time()
    while step < args.steps:
        idx, labels = get_batch()
        with autocast:
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_interval == 0:
            torch.cuda.synchronize()
            dt = (time.time() - t0) / step
            print(f"step {step:4d} | loss {loss.item():.4f} | {dt * 1000:.1f} ms/step | "
                  f"max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB | "
                  f"max reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
