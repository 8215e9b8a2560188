"""Step time of every plan, measured on the GPU and simulated, to fit and check the time model.

    python benchmarks/step_time.py measure --set fit|check [--out DIR]   # on the GPU
    python benchmarks/step_time.py fit [--out DIR]                      # anywhere: fit on "fit", check on "check"

``measure`` applies every default plan (one GPU: no ZeRO, no state offload)
to each workload of the set with PyTorch's engines and times the median of
4 steps after 2 warm-up steps (``memprof.advisor.measure_steps``). Two sets:
the time model is fitted on ``fit`` and re-checked on ``check``, whose
workloads (and sizes) it never saw. ``fit`` simulates each plan on the
H200 and fits the time model's constants to the measured steps by least
squares on the log of the ratio; it reports the error per plan for both sets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import _measure, default_plans  # noqa: E402

SETS = {
    "fit": [("gpt2", (16, 1024)), ("gpt2", (4, 256)), ("bert", (32, 512)), ("deep_mlp", (64,)), ("resnet50", (64,))],
    "check": [("llama", (4, 2048)), ("bert", (8, 128)), ("vit_b_16", (32,)), ("gpt2", (8, 512))],
}
SKIP = ("offload_states",)  # needs a process group: measured by benchmarks/zero.py


def _name(model: str, size: tuple) -> str:
    return f"{model} {'x'.join(map(str, size))}"


def measure(which: str, out: Path, only: list[str] | None = None) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("measure runs on a CUDA GPU")
    path = out / f"step-time-measured-{which}.json"
    results = json.loads(path.read_text())["runs"] if path.exists() else {}
    for model, size in SETS[which]:
        if _name(model, size) in results and "error" not in str(results[_name(model, size)]) or (
                only and _name(model, size) not in only):
            continue
        rows = {}
        for plan, factory in default_plans().items():
            if any(s in plan for s in SKIP):
                continue
            try:
                rows[plan] = _measure(lambda: workload(model, "cuda", size), factory, steps=4, warmup=2)
            except torch.OutOfMemoryError:
                rows[plan] = {"error": "out of memory"}
                torch.cuda.empty_cache()
            except ValueError as exc:  # e.g. a batch that the micro-batches do not divide
                rows[plan] = {"error": str(exc)}
            print(_name(model, size), plan, rows[plan], flush=True)
        results[_name(model, size)] = rows
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpus": os.cpu_count(),
                "command": "python " + " ".join(sys.argv)}
        out.mkdir(parents=True, exist_ok=True)  # written after each workload: a cut-off run keeps what it measured
        path.write_text(json.dumps({"meta": meta, "runs": results}, indent=1) + "\n")


def trace(model: str, size: tuple, plan: str, gpu) -> np.ndarray:
    """The simulated step of ``plan`` on ``model``, operator by operator: rows of
    (flops, bytes, precision or -1 without a kernel or -2 for a transfer, is a
    convolution, runs in backward); the third step of a fresh build, every
    micro-batch run."""
    from memprof.simulate import SimulatedAllocator, _state_tensors
    from memprof.virtual_cuda import VirtualCUDA

    alloc = SimulatedAllocator(gpu)
    with VirtualCUDA(gpu, allocator=alloc):
        with torch.device("meta"):
            w = workload(model, "cuda", size)
        alloc.adopt(_state_tensors(w.model, w.optimizer))
        for s in default_plans(gpu=gpu)[plan]():
            s.apply_simulated(w)
        w.step()
        w.step()
        alloc.trace = []
        w.step()
    return np.array(alloc.trace, dtype=np.float64).reshape(-1, 5)


def step_seconds(tr: np.ndarray, gpu, fe: float, be: float, per_kernel: float, host_forward: float,
                 host_backward: float, host_convolution: float) -> float:
    """TimeModel on a trace, vectorised: the host issues operator j at the sum
    of the issue costs up to it; the device runs each kernel (or transfer) once
    issued and the previous one is done, so it ends at max over j of
    (issue_j + the device time of kernel j and all after it)."""
    flops, nbytes, kind, conv, bwd = tr[:, 0], tr[:, 1], tr[:, 2], tr[:, 3] > 0, tr[:, 4] > 0
    rates = np.array([gpu.fp32_tflops, gpu.tf32_tflops or gpu.bf16_tflops / 2, gpu.bf16_tflops]) * 1e12 * fe
    kernel = kind >= 0
    roof = np.maximum(flops / rates[np.clip(kind, 0, 2).astype(int)], nbytes / (gpu.memory_bandwidth * be)) + per_kernel
    dev = np.where(kernel, roof, np.where(kind == -2, nbytes / gpu.pcie_bandwidth, 0.0))
    cost = np.where(conv, host_convolution, np.where(bwd, host_backward, host_forward))
    issue = np.cumsum(np.where(kind == -2, 0.0, cost))
    after = np.cumsum(dev[::-1])[::-1]
    on_device = kernel | (kind == -2)
    end = float(np.max((issue + after)[on_device])) if on_device.any() else 0.0
    return max(float(issue[-1]) if len(issue) else 0.0, end)


def fit(out: Path) -> None:
    """Simulate every measured plan, fit the time model on the fit set, report both sets."""
    from memprof.devices import get_gpu
    from memprof.simulate import TimeModel

    gpu = get_gpu("H200-141GB")
    measured = {which: json.loads((out / f"step-time-measured-{which}.json").read_text())["runs"] for which in SETS}
    traces: dict[tuple[str, str, str], tuple[np.ndarray, float]] = {}
    cache = out / "step-time-traces.npz"  # not kept in the repository: made again when absent
    kept = dict(np.load(cache)) if cache.exists() else {}
    for which, runs in measured.items():
        for (model, size) in SETS[which]:
            for plan, row in runs.get(_name(model, size), {}).items():
                if "seconds" not in row:
                    continue
                key = f"{which}|{_name(model, size)}|{plan}"
                if key not in kept:
                    t = time.perf_counter()
                    kept[key] = trace(model, size, plan, gpu)
                    print(f"{key}: {len(kept[key])} ops ({time.perf_counter() - t:.1f} s)", flush=True)
                traces[which, _name(model, size), plan] = (kept[key], row["seconds"])
    np.savez_compressed(cache, **kept)
    def errors(params, which):
        return [math.log(step_seconds(tr, gpu, *params) / sec) for (w, *_), (tr, sec) in traces.items() if w == which]

    def score(params) -> float:
        return statistics.mean(abs(e) for e in errors(params, "fit"))

    old = TimeModel()
    # Coordinate descent from the roofline's constants: each constant in turn over a grid, three rounds.
    grids = [np.arange(0.5, 1.01, 0.05), np.arange(0.3, 0.91, 0.05), np.arange(0, 12.1e-6, 1e-6),
             np.arange(0, 60.1e-6, 1e-6), np.arange(0, 60.1e-6, 1e-6), np.arange(0, 300.1e-6, 5e-6)]
    best = [old.flop_efficiency, old.bandwidth_efficiency, old.per_kernel, 15e-6, 10e-6, 50e-6]
    for _ in range(3):
        for i, grid in enumerate(grids):
            best[i] = min(grid, key=lambda v: score(best[:i] + [v] + best[i + 1:]))
    best = [float(v) for v in best]
    rows = []
    for (which, name, plan), (tr, sec) in traces.items():
        new = step_seconds(tr, gpu, *best)
        before = step_seconds(tr, gpu, old.flop_efficiency, old.bandwidth_efficiency, old.per_kernel, 0.0, 0.0, 0.0)
        rows.append({"set": which, "workload": name, "plan": plan, "ops": len(tr), "measured_s": sec,
                     "predicted_s": new, "error": new / sec - 1, "before_s": before, "error_before": before / sec - 1})
    summary = {}
    for which in SETS:
        for key in ("error", "error_before"):
            errs = sorted(abs(r[key]) for r in rows if r["set"] == which)
            summary[f"{which}_{key}"] = {"plans": len(errs), "median": statistics.median(errs), "worst": errs[-1]}
    # The advisor's choice with these times: the fastest predicted of the plans that fit a budget
    # (fitting by the measured peak reserved, so that this checks the time model alone).
    choices = []
    for which in SETS:
        for (model, size) in SETS[which]:
            runs = measured[which].get(_name(model, size), {})
            mine = {r["plan"]: r for r in rows if r["set"] == which and r["workload"] == _name(model, size)}
            for budget in (12, 24):
                fit_plans = [p for p in mine if runs[p]["peak_reserved"] <= budget * 2**30]
                if not fit_plans:
                    continue
                chosen = min(fit_plans, key=lambda p: mine[p]["predicted_s"])
                fastest = min(fit_plans, key=lambda p: mine[p]["measured_s"])
                choices.append({"set": which, "workload": _name(model, size), "budget_GiB": budget, "chosen": chosen,
                                "fastest": fastest, "slower_than_fastest": mine[chosen]["measured_s"] / mine[fastest]["measured_s"] - 1})
    summary["choices_within_5_percent"] = f"{sum(c['slower_than_fastest'] <= 0.05 for c in choices)} of {len(choices)}"
    params = dict(zip(("flop_efficiency", "bandwidth_efficiency", "per_kernel", "host_forward", "host_backward",
                       "host_convolution"), best))
    print(params, json.dumps(summary, indent=1))
    (out / "step-time-fit.json").write_text(json.dumps(
        {"fit": params, "summary": summary, "choices": choices, "runs": rows, "torch": torch.__version__,
         "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["measure", "fit"])
    ap.add_argument("--set", choices=list(SETS), default="fit")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--only", default=None, help="workloads to measure, comma-separated (e.g. 'gpt2 4x256')")
    a = ap.parse_args()
    measure(a.set, a.out, a.only.split(",") if a.only else None) if a.what == "measure" else fit(a.out)


if __name__ == "__main__":
    main()
