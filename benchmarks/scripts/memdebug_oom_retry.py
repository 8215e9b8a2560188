#!/usr/bin/env python
"""Train a Transformer-encoder text classifier while debugging its memory, with an OOM batch-size search.

In the manner of someone chasing a CUDA OOM with PyTorch's own tools (pytorch.org's
"Understanding CUDA Memory Usage" recipe) and Hugging Face Accelerate's
``find_executable_batch_size``: the allocator's history is recorded from the start
(``torch.cuda.memory._record_memory_history``), the training function is retried with half
the batch whenever it raises ``torch.cuda.OutOfMemoryError`` (or a ``RuntimeError`` saying
"out of memory"), emptying the cache in between, and the model and optimizer are built
inside that function as Accelerate's docs ask. Along the way it prints
``torch.cuda.memory_summary()``, ``memory_stats()["allocated_bytes.all.peak"]`` and
``mem_get_info()``, and at the end dumps the snapshot for pytorch.org/memory_viz.
Random token ids and labels stand in for a dataset, so it runs offline.

    python memdebug_oom_retry.py                        # starts at a batch an H200 cannot hold
    python memdebug_oom_retry.py --accelerate           # accelerate.utils.find_executable_batch_size
"""

import argparse
import functools
import gc
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description="Transformer classifier with an OOM batch-size search")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--ffn-dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--num-classes", type=int, default=4)
    p.add_argument("--start-batch-size", type=int, default=2048,
                   help="the first batch tried; about 300 GB at the default sizes, so an H200 runs out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--accelerate", action="store_true", help="use accelerate.utils.find_executable_batch_size")
    p.add_argument("--snapshot", default="/tmp/probeB/snap.pickle")
    return p.parse_args()


class TransformerClassifier(nn.Module):
    def __init__(self, vocab_size, d_model, n_heads, ffn_dim, n_layers, seq_len, num_classes, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, ffn_dim, dropout=dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids, pad_mask):
        x = self.embed(ids) + self.pos[:, : ids.size(1)]
        x = self.encoder(x, src_key_padding_mask=pad_mask)
        keep = (~pad_mask).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)


def should_reduce_batch_size(exc: BaseException) -> bool:
    """As accelerate.utils.memory.should_reduce_batch_size: an OOM by type or by message."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and len(exc.args) == 1 and "out of memory" in str(exc.args[0])


def find_executable_batch_size(function=None, starting_batch_size=128):
    """Hand-rolled copy of Accelerate's decorator: halve the batch after every OOM."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size)
    batch_size = starting_batch_size

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        gc.collect()
        torch.cuda.empty_cache()
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if should_reduce_batch_size(e):
                    print(f"OOM at batch size {batch_size}: {str(e).splitlines()[0][:120]}")
                    gc.collect()
                    torch.cuda.empty_cache()
                    batch_size //= 2
                    free, total = torch.cuda.mem_get_info()
                    print(f"  after empty_cache: allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
                          f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB, "
                          f"free {free / 2**30:.2f} of {total / 2**30:.2f} GiB; retrying with {batch_size}")
                else:
                    raise

    return decorator


def main():
    args = parse_args()
    os.makedirs(os.path.dirname(args.snapshot) or ".", exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100000)
    device = torch.device("cuda")
    torch.manual_seed(0)

    if args.accelerate:
        from accelerate.utils import find_executable_batch_size as search
    else:
        search = find_executable_batch_size

    @search(starting_batch_size=args.start_batch_size)
    def train(batch_size):
        print(f"trying batch size {batch_size} (allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
              f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB)")
        model = TransformerClassifier(args.vocab_size, args.d_model, args.n_heads, args.ffn_dim, args.n_layers,
                                      args.seq_len, args.num_classes).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        model.train()
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps):
            ids = torch.randint(1, args.vocab_size, (batch_size, args.seq_len), device=device)
            lengths = torch.randint(args.seq_len // 2, args.seq_len + 1, (batch_size,), device=device)
            pad_mask = torch.arange(args.seq_len, device=device)[None, :] >= lengths[:, None]
            ids = ids.masked_fill(pad_mask, 0)
            labels = torch.randint(0, args.num_classes, (batch_size,), device=device)
            t0 = time.perf_counter()
            logits = model(ids, pad_mask)
            loss = F.cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
            print(f"bs {batch_size} step {step} | loss {loss.item():.4f} | {time.perf_counter() - t0:.3f}s | "
                  f"allocated.peak {peak / 2**30:.2f} GiB")
            if step == 0:
                print(torch.cuda.memory_summary(abbreviated=True))
        return batch_size

    final_bs = train()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    print(f"batch size that fits: {final_bs}")
    print(f"mem_get_info: free {free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB; "
          f"allocated_bytes.all.peak {stats['allocated_bytes.all.peak'] / 2**30:.2f} GiB; "
          f"num_ooms {stats.get('num_ooms')}; num_alloc_retries {stats.get('num_alloc_retries')}")
    torch.cuda.memory._dump_snapshot(args.snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"snapshot written to {args.snapshot}")
    print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB "
          f"(max_memory_allocated = {torch.cuda.max_memory_allocated()})")


if __name__ == "__main__":
    main()
