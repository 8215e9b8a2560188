"""Fit memprof.simulate's TimeModel to the step times measured in the accuracy suite.

    python benchmarks/timing_fit.py [--out DIR]

Simulates one steady-state step of every workload of benchmarks/suite.py on
the H200, records each kernel's flops and bytes, and searches the model's
three constants (achievable fraction of peak flops, of memory bandwidth, and
a fixed cost per kernel) for the least median |log error| against the step
times in accuracy-measured.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import MODELS, VARIANTS, build  # noqa: E402

from memprof.devices import get_gpu  # noqa: E402
from memprof.simulate import SimulatedAllocator  # noqa: E402
from memprof.virtual_cuda import VirtualCUDA  # noqa: E402


def kernels(model: str, variant: str, gpu) -> np.ndarray:
    alloc = SimulatedAllocator(gpu)
    with VirtualCUDA(gpu, allocator=alloc):
        with torch.device("meta"):
            _, _, step = build(model, variant, "cuda")
        step()
        step()
        alloc.trace = []
        step()
    return np.array(alloc.trace, dtype=np.float64)


def predict(trace: np.ndarray, gpu, fe: float, be: float, pk: float) -> float:
    flops, nbytes, kind = trace[:, 0], trace[:, 1], trace[:, 2]
    rate = np.choose(kind.astype(int), [gpu.fp32_tflops, gpu.bf16_tflops / 2, gpu.bf16_tflops]) * 1e12 * fe
    return float(np.sum(np.maximum(flops / rate, nbytes / (gpu.memory_bandwidth * be)) + pk))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--measured", type=Path, default=Path("benchmarks/results/accuracy-measured.json"))
    a = ap.parse_args()
    gpu = get_gpu("H200-141GB")
    measured = {(r["model"], r["variant"]): r["step_seconds"] for r in json.loads(a.measured.read_text())["runs"]}
    traces = {(m, v): kernels(m, v, gpu) for m in MODELS for v in VARIANTS if (m, v) in measured}
    grid = itertools.product(np.arange(0.3, 1.01, 0.05), np.arange(0.3, 1.01, 0.05), np.arange(0, 31e-6, 1e-6))
    best = None
    for fe, be, pk in grid:
        errs = [abs(np.log(predict(t, gpu, fe, be, pk) / measured[k])) for k, t in traces.items()]
        score = statistics.median(errs)
        if best is None or score < best[0]:
            best = (score, fe, be, pk)
    _, fe, be, pk = best
    rows = []
    for k, t in traces.items():
        p = predict(t, gpu, fe, be, pk)
        rows.append({"model": k[0], "variant": k[1], "kernels": len(t), "measured_s": measured[k], "predicted_s": p,
                     "error": p / measured[k] - 1})
        print(f"{k[0]:9} {k[1]:9} kernels {len(t):6d} measured {measured[k] * 1e3:8.1f} ms predicted {p * 1e3:8.1f} ms "
              f"{100 * (p / measured[k] - 1):+6.1f} %")
    errs = sorted(abs(r["error"]) for r in rows)
    fit = {"flop_efficiency": round(fe, 2), "bandwidth_efficiency": round(be, 2), "per_kernel": pk}
    print(fit, f"median |error| {100 * statistics.median(errs):.1f} %, worst {100 * errs[-1]:.1f} %")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "timing-fit.json").write_text(json.dumps({"fit": fit, "runs": rows, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
