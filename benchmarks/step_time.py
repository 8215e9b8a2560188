"""Step time of every plan, measured on the GPU and simulated, to fit and check the time model.

    python benchmarks/step_time.py measure --set fit|check [--out DIR]   # on the GPU
    python benchmarks/step_time.py fit [--out DIR]                      # anywhere: fit on "fit", check on "check"

``measure`` applies every default plan (one GPU: no ZeRO, no state offload)
to each workload of the set with PyTorch's engines and times the median of
4 steps after 2 warm-up steps (``memprof.advisor.measure_steps``). Two sets:
the time model is fitted on ``fit`` and re-checked on ``check``, whose
workloads (and sizes) it never saw. ``fit`` simulates each plan on the
H200 (activation offload's pack as the measured torch did it) and fits
``memprof.simulate.TimeModel``'s constants to the measured steps by
coordinate descent on the mean |log| of predicted over measured; it reports
the error per plan and per workload for both sets, next to the constants
memprof ships, and the plan the advisor would choose in 12 and 24 GiB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import astuple, fields
from pathlib import Path

import numpy as np
import torch
from torch.torch_version import TorchVersion

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import _measure, default_plans  # noqa: E402
from memprof.simulate import TimeModel  # noqa: E402

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


def trace(model: str, size: tuple, plan: str, gpu, synchronous_pack: bool) -> np.ndarray:
    """The simulated step of ``plan`` on ``model``, operator by operator: the
    rows of ``SimulatedAllocator.trace`` (flops, bytes, precision or -1 without
    a kernel, -2 for a transfer, -3 for one the host waits for; is a
    convolution; runs in backward; is recomputed; operators the host issues);
    the third step of a fresh build, every micro-batch run. Activation
    offload's pack waits for its copy as the measured torch's did
    (``synchronous_pack``)."""
    from memprof.simulate import SimulatedAllocator, _state_tensors
    from memprof.strategies import ActivationOffload
    from memprof.virtual_cuda import VirtualCUDA

    alloc = SimulatedAllocator(gpu)
    before, ActivationOffload.synchronous_pack = ActivationOffload.synchronous_pack, synchronous_pack
    try:
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
    finally:
        ActivationOffload.synchronous_pack = before
    return np.array(alloc.trace, dtype=np.float64).reshape(-1, COLUMNS)


COLUMNS = 7  # of a trace row; a cached trace of another width is made again
#: TimeModel's constants, in the order step_seconds takes them.
PARAMS = tuple(f.name for f in fields(TimeModel))


def step_seconds(tr: np.ndarray, gpu, fe: float, be: float, per_kernel: float, host_forward: float,
                 host_backward: float, host_convolution: float, host_recompute: float, link: float) -> float:
    """TimeModel on a trace, vectorised. The host issues row j at the sum of
    the issue costs up to it; the device runs each kernel (or transfer) once
    issued and the previous one is done, so between two synchronisations (a
    transfer the host waits for) the device ends at the max over j of
    (issue_j + the device time of row j and all after it up to the
    synchronisation), and the segment lasts the longer of that and the host's
    sum; the step is the sum of its segments."""
    if not len(tr):
        return 0.0
    flops, nbytes, kind = tr[:, 0], tr[:, 1], tr[:, 2]
    conv, bwd, rec, ops = tr[:, 3] > 0, tr[:, 4] > 0, tr[:, 5] > 0, tr[:, 6]
    # TimeModel.host_seconds, times the operators each row stands for.
    phase = np.where(conv, host_convolution, np.where(bwd & ~rec, host_backward, host_forward))
    host = ops * (phase + np.where(rec, host_recompute, 0.0))
    rates = np.array([gpu.fp32_tflops, gpu.tf32_tflops or gpu.bf16_tflops / 2, gpu.bf16_tflops]) * 1e12 * fe
    kernel, transfer = kind >= 0, kind <= -2
    roof = np.maximum(flops / rates[np.clip(kind, 0, 2).astype(int)], nbytes / (gpu.memory_bandwidth * be)) + per_kernel
    dev = np.where(kernel, roof, np.where(transfer, nbytes / (gpu.pcie_bandwidth * link), 0.0))
    n = len(tr)
    ends = np.flatnonzero(kind == -3)
    starts = np.unique(np.concatenate([[0], ends[ends + 1 < n] + 1]))
    segment = np.zeros(n, dtype=int)
    segment[starts[1:]] = 1
    segment = np.cumsum(segment)
    issue = np.cumsum(host)
    issue -= np.concatenate([[0.0], issue])[starts][segment]  # from the segment's start
    after = np.cumsum(dev[::-1])[::-1]  # device time of rows j.. to the trace's end
    last = np.concatenate([starts[1:] - 1, [n - 1]])
    after -= np.concatenate([after, [0.0]])[last + 1][segment]  # .. to the segment's end
    device = np.maximum.reduceat(np.where(kernel | transfer, issue + after, 0.0), starts)
    return float(np.maximum(device, np.add.reduceat(host, starts)).sum())


def _descend(score, start: list[float], bounded: tuple[int, ...]) -> list[float]:
    """Coordinate descent from ``start`` by relative steps (50 % down to 0.5 %),
    each constant up or down while ``score`` falls; those in ``bounded`` stay <= 1."""
    best, value = list(start), score(start)
    for step in (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005):
        moved = True
        while moved:
            moved = False
            for i in range(len(best)):
                for factor in (1 + step, 1 / (1 + step)):
                    trial = list(best)
                    trial[i] = min(trial[i] * factor, 1.0) if i in bounded else trial[i] * factor
                    v = score(trial)
                    if v < value - 1e-12:
                        best, value, moved = trial, v, True
    return best


def fit(out: Path) -> None:
    """Simulate every measured plan, fit the time model on the fit set, report both sets."""
    from memprof.devices import get_gpu

    gpu = get_gpu("H200-141GB")
    sets = {which: json.loads((out / f"step-time-measured-{which}.json").read_text()) for which in SETS}
    measured = {which: data["runs"] for which, data in sets.items()}
    traces: dict[tuple[str, str, str], tuple[np.ndarray, float]] = {}
    cache = out / "step-time-traces.npz"  # not kept in the repository: made again when absent
    kept = {k: v for k, v in np.load(cache).items() if v.shape[1:] == (COLUMNS,)} if cache.exists() else {}
    for which, runs in measured.items():
        # save_on_cpu's pack waited for its copy before torch 2.12 (see ActivationOffload.synchronous_pack).
        version = TorchVersion(sets[which]["meta"]["torch"])
        for (model, size) in SETS[which]:
            for plan, row in runs.get(_name(model, size), {}).items():
                if "seconds" not in row:
                    continue
                key = f"{which}|{_name(model, size)}|{plan}"
                if key not in kept:
                    t = time.perf_counter()
                    kept[key] = trace(model, size, plan, gpu, synchronous_pack=version < (2, 12))
                    print(f"{key}: {len(kept[key])} ops ({time.perf_counter() - t:.1f} s)", flush=True)
                traces[which, _name(model, size), plan] = (kept[key], row["seconds"])
    np.savez_compressed(cache, **kept)

    def errors(params, which):
        return [math.log(step_seconds(tr, gpu, *params) / sec) for (w, *_), (tr, sec) in traces.items() if w == which]

    def score(params) -> float:
        return statistics.mean(abs(e) for e in errors(params, "fit"))

    shipped = list(astuple(TimeModel()))  # the constants memprof has now
    best = [float(v) for v in _descend(score, shipped, bounded=(0, 1, PARAMS.index("link_efficiency")))]
    rows = []
    for (which, name, plan), (tr, sec) in traces.items():
        new, now = step_seconds(tr, gpu, *best), step_seconds(tr, gpu, *shipped)
        rows.append({"set": which, "workload": name, "plan": plan, "ops": len(tr), "measured_s": sec,
                     "predicted_s": new, "error": new / sec - 1, "shipped_s": now, "error_shipped": now / sec - 1})
    summary: dict = {}
    for which in SETS:
        for key in ("error", "error_shipped"):
            errs = sorted(abs(r[key]) for r in rows if r["set"] == which)
            summary[f"{which}_{key}"] = {"plans": len(errs), "median": statistics.median(errs), "worst": errs[-1]}
    per_workload = {}
    for which in SETS:
        for (model, size) in SETS[which]:
            errs = [r["error"] for r in rows if r["set"] == which and r["workload"] == _name(model, size)]
            if errs:
                per_workload[f"{which}|{_name(model, size)}"] = {
                    "plans": len(errs), "median": statistics.median(abs(e) for e in errs),
                    "worst": max(errs, key=abs), "mean": statistics.mean(errs)}
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
                fastest = min(fit_plans, key=lambda p: mine[p]["measured_s"])
                row = {"set": which, "workload": _name(model, size), "budget_GiB": budget, "fastest": fastest}
                for suffix, column in (("", "predicted_s"), ("_shipped", "shipped_s")):
                    chosen = min(fit_plans, key=lambda p: mine[p][column])
                    row["chosen" + suffix] = chosen
                    row["slower_than_fastest" + suffix] = mine[chosen]["measured_s"] / mine[fastest]["measured_s"] - 1
                choices.append(row)
    for suffix in ("", "_shipped"):
        within = sum(c["slower_than_fastest" + suffix] <= 0.05 for c in choices)
        summary["choices_within_5_percent" + suffix] = f"{within} of {len(choices)}"
    params = dict(zip(PARAMS, best))
    print(params, json.dumps(summary, indent=1))
    (out / "step-time-fit.json").write_text(json.dumps(
        {"fit": params, "shipped": dict(zip(PARAMS, shipped)), "summary": summary, "per_workload": per_workload,
         "choices": choices, "runs": rows, "torch": torch.__version__, "command": "python " + " ".join(sys.argv)},
        indent=1) + "\n")


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
