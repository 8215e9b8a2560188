"""Where a profiled step's time goes, per kind of hook.

For each workload, in one process: the untracked step (time on the GPU's
clock, and the host's time to launch it), the profiled step
(``track(warmup=0, every=1)``), and then the profiled step again with every
tracker hook timed: calls, exclusive host time per call and per step, for
each kind of hook (module forward pre/post, saved tensor, autograd node,
backward start/end, gradient accumulated, optimizer, counter reads and
resets). The costs of the counter calls themselves are printed first.

    python3 benchmarks/profile_hooks.py [WORKLOAD ...] [--steps N] [--out DIR]

With ``--simulate`` the workloads run on a simulated H200
(``memprof.virtual_cuda``, meta tensors), where kernels cost nothing: what a
hook costs the host is what it costs on the GPU's host, and the step's time
is the host's (the simulation's own dispatch included, on both sides).
Python's garbage collections are timed as their own line, not as part of
the hook they happen to interrupt.

    python3 benchmarks/profile_hooks.py --simulate [WORKLOAD ...] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import memprof  # noqa: E402
import memprof.tracker as tracker_mod  # noqa: E402
from common import WORKLOADS, Workload, _vision, free  # noqa: E402
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
        self._gc: list[float] = []

    def on_gc(self, phase: str, info: dict) -> None:
        """A gc.callbacks entry: a collection counts as a callee of whatever it interrupted."""
        if phase == "start":
            self._gc.append(time.perf_counter())
            return
        total = time.perf_counter() - self._gc.pop()
        label = f"gc (generation {info['generation']})"
        self.seconds[label] += total
        self.calls[label] += 1
        if self._stack:
            self._stack[-1][1] += total

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


def live_objects_at_backward(w) -> tuple[int, int]:
    """Objects Python's garbage collector tracks when the loss's backward
    begins, in an untracked step and in a profiled one. What a profiled step
    keeps alive that long brings the collector's next scan of the whole heap
    closer (generation 2: hundreds of ms in a large model's process)."""
    counts = []
    backward = torch.Tensor.backward

    def counted(*args, **kwargs):
        counts.append(len(gc.get_objects()))
        return backward(*args, **kwargs)

    torch.Tensor.backward = counted
    try:
        w.step()
        with memprof.track(w.model, warmup=0, every=1):
            for _ in range(4):  # two full profiles, then cheap ones
                w.step()
    finally:
        torch.Tensor.backward = backward
    return counts[0], counts[-1]


def host_times(step, n: int) -> tuple[list[float], list[float]]:
    """The host's time of each step, twice: on a simulated GPU that is the step's time."""
    host = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
    return host, host


def attribute_costs() -> list[str]:
    """What reading a tensor's attribute costs on the simulated GPU, where
    VirtualCUDA's torch-function mode answers it, and on a plain tensor: a
    hook that reads tensors costs more in a simulation than on a GPU's host."""
    from memprof.virtual_cuda import VirtualCUDA

    plain = torch.empty(1)
    lines = [f"{'tensor.is_meta, plain tensor':40} {per_call_us(lambda: plain.is_meta, 20000):8.2f} us/call"]
    with VirtualCUDA("H200"):
        t = torch.empty(1, device="cuda")
        lines.append(f"{'tensor.is_meta, simulated GPU':40} {per_call_us(lambda: t.is_meta, 20000):8.2f} us/call")
    return lines


def measure(name: str, steps: int, simulated: bool = False) -> dict:
    if not simulated:
        return _measure(WORKLOADS[name](), steps, step_times)
    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator, usable_bytes
    from memprof.virtual_cuda import VirtualCUDA

    gpu = get_gpu("H200")
    allocator = SimulatedAllocator(gpu, capacity=usable_bytes(gpu))
    with VirtualCUDA(gpu, allocator=allocator):
        with torch.device("meta"):  # weights are never materialised
            w = SIMULATED[name]()
        allocator.adopt([*w.model.parameters(), *w.model.buffers()])
        return _measure(w, steps, host_times, simulated=True)


def _measure(w, steps: int, times, simulated: bool = False, rounds: int = 4) -> dict:
    times(w.step, 5)
    # Blocks of untracked and profiled steps alternate, so that drift in the
    # host's speed hits both alike; each block of profiled steps is a track()
    # block of its own, whose first two (full) profiles are not counted.
    untracked = HookTimer()  # its garbage collections only
    gpu_u, host_u, gpu_p = [], [], []
    block = max(steps // rounds, 1)
    for _ in range(rounds):
        gc.callbacks.append(untracked.on_gc)
        try:
            g, h = times(w.step, block)
        finally:
            gc.callbacks.remove(untracked.on_gc)
        gpu_u += g
        host_u += h
        with memprof.track(w.model, warmup=0, every=1):
            times(w.step, 2)
            gpu_p += times(w.step, block)[0]
    objects = live_objects_at_backward(w)
    timer = HookTimer()
    for h in HOOKS:
        timer.wrap(tracker_mod.Tracker, h, h)
    for c in COUNTERS:
        timer.wrap(DeviceCounters, c, f"counters.{c}")
    timer.wrap(tracker_mod, "_on_first_grad", "_on_first_grad")
    gc.callbacks.append(timer.on_gc)
    try:
        with memprof.track(w.model, warmup=0, every=1):
            times(w.step, 2)
            timer.calls.clear()
            timer.seconds.clear()
            gpu_i, _ = times(w.step, steps)
    finally:
        gc.callbacks.remove(timer.on_gc)
        timer.unwrap()
    res = {
        "workload": w.name,
        "simulated": simulated,
        "untracked_gc_ms": sum(untracked.seconds.values()) / len(gpu_u) * 1e3,
        "gc_objects_at_backward": objects,
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


def vit_like(precision: str = "bf16", batch: int = 128) -> Workload:
    """ViT-B/16's shape without torchvision: patch convolution, 12 pre-norm
    encoder blocks (nn.MultiheadAttention, GELU MLP), class token, head."""

    class Block(nn.Module):
        def __init__(self, d: int = 768, heads: int = 12, mlp: int = 3072) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, d), nn.Dropout(0.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.ln_1(x)
            x = x + self.self_attention(y, y, y, need_weights=False)[0]
            return x + self.mlp(self.ln_2(x))

    class ViT(nn.Module):
        def __init__(self, d: int = 768, layers: int = 12) -> None:
            super().__init__()
            self.conv_proj = nn.Conv2d(3, d, 16, 16)
            self.class_token = nn.Parameter(torch.zeros(1, 1, d))
            self.pos_embedding = nn.Parameter(torch.zeros(1, 197, d))
            self.layers = nn.Sequential(*(Block(d) for _ in range(layers)))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv_proj(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
            return self.head(self.ln(self.layers(x))[:, 0])

    torch.manual_seed(0)
    return _vision(ViT(), "vit-like-B/16", batch, precision)


# Workloads that build without a GPU (and without torchvision), for --simulate.
SIMULATED = {
    "bert-bf16": WORKLOADS["bert-bf16"],
    "gpt2-bf16": WORKLOADS["gpt2-bf16"],
    "vit-like-bf16": vit_like,
}


def render(r: dict) -> str:
    if r.get("simulated"):
        head = (
            f"{r['workload']} ({r['modules']} modules), simulated H200: host time of a step untracked "
            f"{r['untracked_ms']:.1f} ms (gc {r['untracked_gc_ms']:.1f} ms), profiled {r['profiled_ms']:.1f} ms "
            f"(+{r['profiled_ms'] - r['untracked_ms']:.1f} ms = {r['ratio_profiled']:.3f}x)"
        )
    else:
        head = (
            f"{r['workload']} ({r['modules']} modules): untracked {r['untracked_ms']:.1f} ms "
            f"(host {r['untracked_host_ms']:.1f} ms), profiled {r['profiled_ms']:.1f} ms = {r['ratio_profiled']:.3f}x"
        )
    u, p = r["gc_objects_at_backward"]
    lines = [
        head,
        f"  objects the garbage collector tracks as backward begins: untracked {u}, profiled {p} (+{p - u})",
        f"  {'hook':28} {'calls/step':>10} {'us/call':>8} {'ms/step':>8}",
    ]
    total = 0.0
    for k, h in r["hooks"].items():
        lines.append(f"  {k:28} {h['calls_per_step']:10.0f} {h['us_per_call']:8.1f} {h['ms_per_step']:8.2f}")
        total += h["ms_per_step"]
    lines.append(f"  {'all lines (exclusive sum)':28} {'':10} {'':8} {total:8.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--simulate", action="store_true", help="on a simulated H200: the hooks' host time, no GPU needed")
    a = ap.parse_args()
    if a.simulate:
        text = ["$ python3 benchmarks/profile_hooks.py " + " ".join(sys.argv[1:]), "", *attribute_costs()]
        print("\n".join(text[1:]), flush=True)
        for n in a.workloads or list(SIMULATED):
            r = measure(n, a.steps, simulated=True)
            text.append("")
            text.append(render(r))
            print(text[-1], flush=True)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "profile_hooks-simulated.txt").write_text("\n".join(text) + "\n")
        return
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
    for n in a.workloads or ["bert-bf16", "resnet50-bf16", "vit-bf16", "gpt2-bf16"]:
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
