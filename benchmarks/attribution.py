"""Check memprof.track's attribution against CUDA's own counters on real models.

For each workload: run steps untracked and record each step's
max_memory_allocated; run the same steps under track(every=1) and check that
 * every sample's categories add up to memory_allocated (no category is
   negative, none is double counted),
 * each step's reported peak equals the untracked step's max_memory_allocated,
 * the named categories explain >= 90 % of the peak.

    python benchmarks/attribution.py [WORKLOAD ...] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import memprof  # noqa: E402
from common import WORKLOADS, free  # noqa: E402
from memprof.categories import ALLOCATED  # noqa: E402

GiB = 2**30


def untracked_peaks(w, steps: int) -> list[int]:
    peaks = []
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        w.step()
        peaks.append(torch.cuda.max_memory_allocated())
    return peaks


def check(name: str, steps: int, out: Path) -> dict:
    w = WORKLOADS[name]()
    base = untracked_peaks(w, steps)
    with memprof.track(w.model, every=1, timeline_steps=steps) as prof:
        for _ in range(steps):
            w.step()
    r = prof.report()
    tl = r.timeline
    cats = [c.value for c in ALLOCATED]
    sums_ok = bool((tl[cats].sum(axis=1) == tl["allocated"]).all())
    min_temp = int(tl["temporaries"].min())
    tracked = [int(v) for v in r.steps["peak_allocated"]]
    res = {
        "workload": w.name,
        "steps": steps,
        "samples": len(tl),
        "samples_add_up": sums_ok,
        "min_temporaries": min_temp,
        "untracked_peaks": base,
        "tracked_peaks": tracked,
        "peak_equal_steady": tracked[1:] == base[1:],
        "peak_phase": r.peak.phase,
        "peak_GiB": r.peak.allocated / GiB,
        "named_fraction": r.peak.named_fraction,
        "peak_bytes": r.peak.bytes,
        "optimizer_state": r.optimizer_state,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    r.save(out / f"report-{name}.json")
    print(r)
    print(json.dumps({k: v for k, v in res.items() if k != "peak_bytes"}, indent=1))
    free(w)
    del prof, r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", default=["gpt2-fp32", "gpt2-bf16", "resnet50-bf16"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = [check(n, a.steps, a.out) for n in a.workloads]
    (a.out / "attribution.json").write_text(json.dumps(results, indent=1))
    print(f"{'workload':28} {'peak GiB':>9} {'named':>7} {'add up':>7} {'peak==untracked':>16}  phase")
    for x in results:
        print(
            f"{x['workload']:28} {x['peak_GiB']:9.2f} {100 * x['named_fraction']:6.1f}% {str(x['samples_add_up']):>7} "
            f"{str(x['peak_equal_steady']):>16}  {x['peak_phase']}"
        )


if __name__ == "__main__":
    main()
