"""Step time with memprof.track over step time without, in one process.

Blocks of steps alternate between untracked and tracked so that clock and
thermal drift hit both sides alike; every step is timed with CUDA events
(synchronised once per step) and the ratio of medians is reported:

* ``light``: steps between profiled ones (``track(warmup=0, every=0)``) --
  what almost every step of a long run costs;
* ``profiled``: every step profiled (``track(warmup=0, every=1)``): full
  profiles until two steps peak at the same moment, cheap ones after;
* ``default``: the amortised cost of ``track()``'s default schedule over a run
  of ``--run-length`` steps (3 profiled warm-up steps, then every 100th).

    python benchmarks/overhead.py [WORKLOAD ...] [--rounds R] [--block K]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import memprof  # noqa: E402
from common import WORKLOADS, event_seconds, free  # noqa: E402

MODES = {"light": dict(warmup=0, every=0), "profiled": dict(warmup=0, every=1)}


def timed_steps(step, n: int) -> list[float]:
    """Milliseconds of each of ``n`` steps."""
    return [s * 1e3 for s in event_seconds(step, n)]


def measure(name: str, rounds: int, block: int, run_length: int) -> dict:
    w = WORKLOADS[name]()
    timed_steps(w.step, 5)  # warm up kernels, allocator and optimizer state
    times: dict[str, list[float]] = {"untracked": [], **{m: [] for m in MODES}}
    untracked_peaks: set[int] = set()
    tracked_peaks: set[int] = set()
    named: list[tuple[int, float, str]] = []  # (step, named share, phase) of each profiled step
    named_full: list[float] = []
    named_cheap: list[float] = []
    full_profiles = 0

    def untracked_step() -> None:
        torch.cuda.reset_peak_memory_stats()
        w.step()
        untracked_peaks.add(torch.cuda.max_memory_allocated())

    for _ in range(rounds):
        for mode, kw in MODES.items():
            times["untracked"] += timed_steps(untracked_step, block)
            with memprof.track(w.model, **kw) as prof:

                def profiled_step() -> None:
                    w.step()
                    named.append((prof.last_peak.step, prof.last_peak.named_fraction, prof.last_peak.phase))

                times[mode] += timed_steps(profiled_step if mode == "profiled" else w.step, block)
            if mode == "profiled":
                r = prof.report()
                tracked_peaks.update(r.steps["peak_allocated"])
                full = set(r.meta["full_profiles"])
                full_profiles += len(full)
                for step, share, _ in named[-block:]:
                    (named_full if step in full else named_cheap).append(share)
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    profiled_steps = 3 + (run_length - 1) // 100
    default = ((run_length - profiled_steps) * med["light"] + profiled_steps * med["profiled"]) / run_length
    res = {
        "workload": w.name,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps_per_side": {k: len(v) for k, v in times.items()},
        "median_ms": med,
        "mean_ms": mean,
        "ratio_light": med["light"] / med["untracked"],
        "ratio_profiled": med["profiled"] / med["untracked"],
        f"ratio_default_{run_length}_steps": default / med["untracked"],
        # Profiled steps: the lowest share of the peak named by a category,
        # whether their peaks are exactly the untracked steps' peaks, and how
        # many were full profiles (the rest are cheap ones).
        "named_share_min": min(share for _, share, _ in named),
        "named_share_min_full": min(named_full),
        "named_share_min_cheap": min(named_cheap, default=None),
        "lowest_named": sorted(named, key=lambda x: x[1])[:3],
        "peak_exact": tracked_peaks == untracked_peaks,
        "peaks": {"untracked": sorted(untracked_peaks), "profiled": sorted(tracked_peaks)},
        "full_profiles": full_profiles,
    }
    print(json.dumps(res, indent=1), flush=True)
    free(w)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", default=["bert-bf16", "resnet50-bf16", "vit-bf16", "gpt2-bf16"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--run-length", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    results = [measure(n, a.rounds, a.block, a.run_length) for n in a.workloads]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "overhead.json").write_text(json.dumps(results, indent=1))
    key = f"ratio_default_{a.run_length}_steps"
    print(f"{'workload':26} {'untracked ms':>12} {'light':>7} {'profiled':>9} {'default':>8} {'named':>6} peak exact")
    for r in results:
        print(
            f"{r['workload']:26} {r['median_ms']['untracked']:12.1f} {r['ratio_light']:7.3f}x "
            f"{r['ratio_profiled']:8.3f}x {r[key]:7.3f}x {r['named_share_min']:6.1%} {r['peak_exact']}"
        )


if __name__ == "__main__":
    main()
