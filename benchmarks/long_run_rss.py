"""Host memory of a long tracked run on the CPU: every step profiled.

A tiny MLP (64 -> 64 -> 64, AdamW, batch 8) trains for ``--steps`` steps
under ``memprof.track(warmup=0, every=1)``; at each checkpoint the script
prints the process's resident set size (VmRSS), the time so far and the size
of the report as ``Report.save`` writes it. ``--input-requires-grad`` makes the batch a leaf that
needs grad (an input being optimised), whose hooks outlive each step's graph.
``--tracemalloc`` also lists the source lines whose Python allocations grew
most between the first and the last checkpoint.

    python benchmarks/long_run_rss.py [--steps 10000] [--history 10000] [--threads 1]
        [--untracked] [--input-requires-grad] [--tracemalloc]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
from torch import nn

import memprof

MiB = 1 << 20


def rss() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--history", type=int, default=10_000)
    ap.add_argument("--checkpoints", default="500,1000,5000,10000")
    ap.add_argument("--untracked", action="store_true", help="the same loop without memprof, for the time per step")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (the steps are too small to share)")
    ap.add_argument("--input-requires-grad", action="store_true")
    ap.add_argument("--tracemalloc", action="store_true")
    args = ap.parse_args()
    checkpoints = {int(s) for s in args.checkpoints.split(",")}

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 64, requires_grad=args.input_requires_grad)
    first = None

    def loop(prof):
        nonlocal first
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(1, args.steps + 1):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            x.grad = None
            if i in checkpoints:
                gc.collect()
                size = prof.report().save(Path(tmp) / "report.json").stat().st_size if prof else 0
                print(
                    f"step {i:6d}  rss {rss() / MiB:8.1f} MiB  {time.perf_counter() - t0:7.1f} s "
                    f"({time.process_time() - c0:7.1f} s CPU)  report {size:9d} B"
                )
                if args.tracemalloc:
                    snap = tracemalloc.take_snapshot()
                    if first is None:
                        first = snap
                    else:
                        for stat in snap.compare_to(first, "lineno")[:10]:
                            print("   ", stat)

    if args.tracemalloc:
        tracemalloc.start(5)
    with tempfile.TemporaryDirectory() as tmp:
        if args.untracked:
            loop(None)
        else:
            with memprof.track(model, opt, warmup=0, every=1, history=args.history) as prof:
                loop(prof)


if __name__ == "__main__":
    main()
