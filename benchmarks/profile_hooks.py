"""Where a profiled step's time goes, per kind of hook.

For each workload, in one process: the untracked step (time on the GPU's
clock, and the host's time to launch it), the profiled step
(``track(warmup=0, every=1)``), and then the profiled step again with every
tracker hook timed: calls, exclusive host time per call and per step, for
each kind of hook (module forward pre/post, saved tensor, autograd node,
backward start/end, gradient accumulated, optimizer, counter reads and
resets). The costs of the counter calls themselves are printed first.

    python3 benchmarks/profile_hooks.py [WORKLOAD ...] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import memprof  # noqa: E402
import memprof.tracker as tracker_mod  # noqa: E402
from common import WORKLOADS, free  # noqa: E402
from memprof.allocator import DeviceCounters  # noqa: E402

# Tracker methods PyTorch calls as hooks, and what they call that costs.
HOOKS = [
    "_on_pre", "_on_post", "_on_saved", "_on_node_grads", "_on_backward_start", "_on_backward_end",
    "_on_backward_done", "_on_grad_accumulated", "_on_optimizer_pre", "_on_optimizer_post",
    "_hook_graph", "_start_profile", "_finish_profile", "_sample", "_push_saved_hooks", "_pop_saved_hooks",
]
COUNTERS = ["read", "reset_peak", "nvml_used"]


def per_call_us(fn, n: int = 2000) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


class HookTimer:
    """Exclusive host time per wrapped function (time in wrapped callees is theirs)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []
        self._undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        timer = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0]
            timer._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                timer._stack.pop()
                total = time.perf_counter() - frame[0]
                timer.seconds[label] += total - frame[1]
                timer.calls[label] += 1
                if timer._stack:
                    timer._stack[-1][1] += total

        setattr(owner, name, timed)
        self._undo.append((owner, name, fn))

    def unwrap(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


def step_times(step, n: int) -> tuple[list[float], list[float]]:
    """GPU time of each step (CUDA events) and the host's time to return from it."""
    gpu, host = [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return gpu, host


def measure(name: str, steps: int) -> dict:
    w = WORKLOADS[name]()
    step_times(w.step, 5)
    gpu_u, host_u = step_times(w.step, steps)
    with memprof.track(w.model, warmup=0, every=1):
        step_times(w.step, 2)
        gpu_p, _ = step_times(w.step, steps)
    timer = HookTimer()
    for h in HOOKS:
        timer.wrap(tracker_mod.Tracker, h, h)
    for c in COUNTERS:
        timer.wrap(DeviceCounters, c, f"counters.{c}")
    timer.wrap(tracker_mod, "_on_first_grad", "_on_first_grad")
    try:
        with memprof.track(w.model, warmup=0, every=1):
            step_times(w.step, 2)
            timer.calls.clear()
            timer.seconds.clear()
            gpu_i, _ = step_times(w.step, steps)
    finally:
        timer.unwrap()
    res = {
        "workload": w.name,
        "modules": sum(1 for _ in w.model.modules()),
        "untracked_ms": statistics.median(gpu_u),
        "untracked_host_ms": statistics.median(host_u),
        "profiled_ms": statistics.median(gpu_p),
        "ratio_profiled": statistics.median(gpu_p) / statistics.median(gpu_u),
        "instrumented_ms": statistics.median(gpu_i),
        "hooks": {
            k: {"calls_per_step": timer.calls[k] / steps, "us_per_call": timer.seconds[k] / timer.calls[k] * 1e6,
                "ms_per_step": timer.seconds[k] / steps * 1e3}
            for k in sorted(timer.seconds, key=timer.seconds.get, reverse=True)
        },
    }
    free(w)
    return res


def render(r: dict) -> str:
    lines = [
        f"{r['workload']} ({r['modules']} modules): untracked {r['untracked_ms']:.1f} ms "
        f"(host {r['untracked_host_ms']:.1f} ms), profiled {r['profiled_ms']:.1f} ms = {r['ratio_profiled']:.3f}x",
        f"  {'hook':28} {'calls/step':>10} {'us/call':>8} {'ms/step':>8}",
    ]
    total = 0.0
    for k, h in r["hooks"].items():
        lines.append(f"  {k:28} {h['calls_per_step']:10.0f} {h['us_per_call']:8.1f} {h['ms_per_step']:8.2f}")
        total += h["ms_per_step"]
    lines.append(f"  {'all hooks (exclusive sum)':28} {'':10} {'':8} {total:8.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", default=["bert-bf16", "resnet50-bf16", "vit-bf16", "gpt2-bf16"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    dev = torch.cuda.current_device()
    torch.empty(1, device="cuda")
    calls = {
        "torch.cuda.memory_stats": lambda: torch.cuda.memory_stats(dev),
        "torch._C._cuda_memoryStats": lambda: torch._C._cuda_memoryStats(dev),
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(dev),
        "torch._C._cuda_resetPeakMemoryStats": lambda: torch._C._cuda_resetPeakMemoryStats(dev),
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(dev),
    }
    text = [f"{name:40} {per_call_us(fn):8.1f} us/call" for name, fn in calls.items()]
    results = []
    for n in a.workloads:
        r = measure(n, a.steps)
        results.append(r)
        text.append("")
        text.append(render(r))
        print(text[-1], flush=True)
    out = "\n".join(text) + "\n"
    print(out)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile_hooks.txt").write_text(out)
    (a.out / "profile_hooks.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
