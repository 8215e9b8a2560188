#!/usr/bin/env python
"""
Report the CUDA environment, then time a short training run of a small
transformer language model on random tokens.

    python cuda_api_probe.py --steps 6

Prints the device properties and memory the runtime reports, then per-step
GPU time (CUDA events), throughput and the caching allocator's counters.
"""

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def gib(n_bytes):
    return n_bytes / 2**30


def print_environment():
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print("=" * 72)
    print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()}")
    print(f"device count        : {torch.cuda.device_count()}")
    print(f"device name         : {torch.cuda.get_device_name()}")
    print(f"capability          : {torch.cuda.get_device_capability()}")
    print(f"properties.name     : {props.name}")
    print(f"total memory        : {gib(props.total_memory):.2f} GiB")
    print(f"compute capability  : sm_{props.major}{props.minor}")
    print(f"multiprocessors     : {props.multi_processor_count}")
    print(f"bf16 supported      : {torch.cuda.is_bf16_supported()}")
    print(f"mem_get_info        : {gib(free):.2f} GiB free / {gib(total):.2f} GiB total")
    print("=" * 72)


class TransformerLM(nn.Module):
    """Token + position embeddings, a pre-LN nn.TransformerEncoder with a causal mask, and a linear head."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, dim_feedforward, max_seq_len, dropout=0.0):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            n_heads,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, n_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        seq_len = idx.size(1)
        pos = torch.arange(seq_len, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len, device=idx.device)
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(x)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--dim-feedforward", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16"],
        default="auto",
        help="autocast dtype; auto picks bfloat16 when the GPU supports it, else float16 with a GradScaler",
    )
    parser.add_argument("--num-batches", type=int, default=4, help="distinct pinned host batches to cycle through")
    return parser.parse_args()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available; this benchmark needs an NVIDIA GPU.", file=sys.stderr)
        sys.exit(1)

    print_environment()

    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.backends.cudnn.benchmark = True

    device = torch.device("cuda")
    if args.dtype == "auto":
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        amp_dtype = getattr(torch, args.dtype)
    use_scaler = amp_dtype == torch.float16

    model = TransformerLM(
        args.vocab_size,
        args.d_model,
        args.n_layers,
        args.n_heads,
        args.dim_feedforward,
        max_seq_len=args.seq_len,
    ).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters, autocast {amp_dtype}, GradScaler {'on' if use_scaler else 'off'}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler)

    # random tokens in page-locked host memory, so the H2D copies can be asynchronous
    host_batches = [
        torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), dtype=torch.long).pin_memory()
        for _ in range(args.num_batches)
    ]
    copy_stream = torch.cuda.Stream()
    start_event = torch.cuda.Event(enable_timing=True)
    end_event = torch.cuda.Event(enable_timing=True)
    tokens_per_step = args.batch_size * args.seq_len

    model.train()
    step_times = []
    for step in range(args.steps):
        cpu_batch = host_batches[step % len(host_batches)]
        t0 = time.perf_counter()
        start_event.record()

        with torch.cuda.stream(copy_stream):
            batch = cpu_batch.to("cuda", non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)
        batch.record_stream(torch.cuda.current_stream())
        x, y = batch[:, :-1], batch[:, 1:]

        with torch.autocast(device_type="cuda", dtype=amp_dtype):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        end_event.record()
        torch.cuda.synchronize()
        gpu_ms = start_event.elapsed_time(end_event)
        wall_ms = (time.perf_counter() - t0) * 1000
        step_times.append(gpu_ms)

        print(
            f"step {step:3d} | loss {loss.item():.4f} | grad norm {grad_norm.item():.3f} | "
            f"gpu {gpu_ms:7.1f} ms | wall {wall_ms:7.1f} ms | {tokens_per_step / (gpu_ms / 1000):,.0f} tok/s | "
            f"allocated {gib(torch.cuda.memory_allocated()):.2f} GiB | "
            f"max allocated {gib(torch.cuda.max_memory_allocated()):.2f} GiB | "
            f"reserved {gib(torch.cuda.memory_reserved()):.2f} GiB"
        )

        if step == 0:
            # the first step pays for cuDNN autotuning and allocator warm-up; measure peaks from here on
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    if len(step_times) > 1:
        steady = step_times[1:]
        mean_ms = sum(steady) / len(steady)
        print(f"mean step time (excluding the first): {mean_ms:.1f} ms, {tokens_per_step / (mean_ms / 1000):,.0f} tok/s")
    free, total = torch.cuda.mem_get_info()
    print(f"peak allocated after warm-up: {gib(torch.cuda.max_memory_allocated()):.2f} GiB, "
          f"mem_get_info: {gib(free):.2f} GiB free / {gib(total):.2f} GiB total")


if __name__ == "__main__":
    main()
