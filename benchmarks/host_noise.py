"""What moves a host-bound step's time: the host's speed, Python's garbage collector, or the build.

    python3 benchmarks/host_noise.py --out DIR [--models gpt2 llama bert] [--builds 2] [--steps 12]

On the GPU. For each plan (by default those the advisor's benchmark found
host-bound and worst predicted, and one device-bound control) it builds the
workload ``--builds`` times in this process and times ``--steps`` steps one
by one after 2 warm-up steps (``torch.cuda.synchronize`` around each), once
as Python runs by default and once with the collector's objects frozen and
collection off during the timed steps (``gc.freeze``, ``gc.disable``). Between
plans it times the host's issue rate with a probe that bounds nothing but the
host: 400 small ``linear`` + ``gelu`` operators with autograd on (forward) and
their backward, median of 5, in microseconds per operator. Also recorded: the
kernel, the CPU model and the number of objects the collector tracks.
Writes ``host-noise.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import default_plans  # noqa: E402

PLANS = {
    "gpt2": ["bf16+ckpt+accum8", "bf16+ckpt+accum4", "bf16+accum4", "baseline"],
    "llama": ["bf16+ckpt+accum4", "bf16+accum4", "bf16+ckpt", "bf16"],
    "bert": ["bf16+ckpt", "bf16+ckpt+accum2", "bf16"],
}


def probe(n: int = 400, rounds: int = 5) -> dict:
    """Microseconds the host needs per small operator, forward (Python, autograd recording) and backward (the engine)."""
    x = torch.randn(8, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    fwd, bwd = [], []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = x
        for _ in range(n // 2):
            y = torch.nn.functional.gelu(torch.nn.functional.linear(y, w))
        loss = y.sum()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        w.grad = None
        fwd.append((t1 - t) / n * 1e6)
        bwd.append((t2 - t1) / n * 1e6)
    return {"forward_us": statistics.median(fwd[1:]), "backward_us": statistics.median(bwd[1:])}


def timed(model: str, plan: str, steps: int, frozen: bool) -> list[float]:
    gc.collect()
    torch.cuda.empty_cache()
    w = workload(model)
    for s in default_plans()[plan]():
        s.apply(w)
    for _ in range(2):
        w.step()
    torch.cuda.synchronize()
    if frozen:
        gc.collect()
        gc.freeze()
        gc.disable()
    times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            w.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    finally:
        if frozen:
            gc.enable()
            gc.unfreeze()
    del w
    gc.collect()
    torch.cuda.empty_cache()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(PLANS), choices=list(PLANS))
    ap.add_argument("--builds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    meta = {"kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(), "command": "python3 " + " ".join(sys.argv)}
    print(meta, flush=True)
    rows = []
    path = args.out / "host-noise.json"
    for m in args.models:
        for plan in PLANS[m]:
            for b in range(args.builds):
                for frozen in (False, True):
                    before = probe()
                    times = timed(m, plan, args.steps, frozen)
                    row = {"model": m, "plan": plan, "build": b, "frozen": frozen, "probe": before,
                           "gc_objects": len(gc.get_objects()), "median": statistics.median(times),
                           "steps": times}
                    rows.append(row)
                    print(m, plan, b, "frozen" if frozen else "gc on", f"probe {before['forward_us']:.1f}/"
                          f"{before['backward_us']:.1f} us", f"median {1e3 * row['median']:.1f} ms",
                          "steps", " ".join(f"{1e3 * t:.0f}" for t in times), flush=True)
                    path.write_text(json.dumps({"meta": meta, "rows": rows, "probe_end": None}, indent=1) + "\n")
    path.write_text(json.dumps({"meta": meta, "rows": rows, "probe_end": probe()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
