"""Where a profiled step's time goes: the cost of each allocator counter read,
and a cProfile of the tracker's hooks on one workload.

    python benchmarks/profile_hooks.py [WORKLOAD] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import memprof  # noqa: E402
from common import WORKLOADS  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default="resnet50-bf16")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    w = WORKLOADS[a.workload]()
    for _ in range(3):
        w.step()
    dev = torch.cuda.current_device()
    calls = {
        "torch.cuda.memory_stats": lambda: torch.cuda.memory_stats(dev),
        "torch._C._cuda_memoryStats": lambda: torch._C._cuda_memoryStats(dev),
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(dev),
        "torch.cuda.reset_peak_memory_stats": lambda: torch.cuda.reset_peak_memory_stats(dev),
        "torch._C._cuda_resetPeakMemoryStats": lambda: torch._C._cuda_resetPeakMemoryStats(dev),
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(dev),
    }
    lines = [f"{name:40} {per_call_us(fn):8.1f} us/call" for name, fn in calls.items()]
    prof = cProfile.Profile()
    with memprof.track(w.model, warmup=0, every=1):
        w.step()
        prof.enable()
        for _ in range(3):
            w.step()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    text = "\n".join(lines) + "\n\n" + s.getvalue()
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"profile_hooks-{a.workload}.txt").write_text(text)


if __name__ == "__main__":
    main()
