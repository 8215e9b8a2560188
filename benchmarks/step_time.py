"""Step time of every plan, measured on the GPU and simulated, to fit and check the time model.

    python benchmarks/step_time.py measure --set fit|check [--out DIR]   # on the GPU
    python benchmarks/step_time.py fit [--out DIR]                      # anywhere: fit on "fit", check on "check"

``measure`` applies every default plan (one GPU: no ZeRO, no state offload)
to each workload of the set with PyTorch's engines and times the median of
4 steps after 2 warm-up steps (``memprof.advisor.measure_steps``). Two sets:
the time model is fitted on ``fit`` and re-checked on ``check``, whose
workloads (and sizes) it never saw. The advisor's own benchmark
(``benchmarks/advise.py verify``, another day's host) adds a second
measurement of the fit set's GPT-2 16 x 1024 and BERT 32 x 512 to the fit
(one host's speed varies from day to day: the fit takes both days), and
ViT-B/16 at 128 and the Llama to the check. ``fit`` simulates each plan on the
H200 (activation offload's pack as the measured torch did it) and fits
``memprof.simulate.TimeModel``'s host constants, gap per kernel and link
share to the measured steps (the kernels' shares of the datasheet are
measured kernel by kernel, benchmarks/kernel_time.py, and kept) by
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
from memprof.simulate import (  # noqa: E402
    ATTENTION, CONVOLUTION, MISALIGNED, MISALIGNED_EVEN, NATIVE_BATCH_NORM, STREAMING, TimeModel)

SETS = {
    "fit": [("gpt2", (16, 1024)), ("gpt2", (4, 256)), ("bert", (32, 512)), ("deep_mlp", (64,)), ("resnet50", (64,))],
    "check": [("llama", (4, 2048)), ("bert", (8, 128)), ("vit_b_16", (32,)), ("gpt2", (8, 512))],
}
SKIP = ("offload_states",)  # needs a process group: measured by benchmarks/zero.py
#: The workloads of benchmarks/advise.py (the suite's sizes), by model: its verify run's
#: measurements join the fit set where the fit set has the workload, else the check set.
VERIFIED = {"gpt2": (16, 1024), "bert": (32, 512), "vit_b_16": (128,), "llama": (4, 2048)}


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
    a kernel, -2 for a transfer, -3 for one the host waits for, -4 for a saved-tensors hook call; is a
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


COLUMNS = 8  # of a trace row; a cached trace of another width is made again
#: TimeModel's kernel efficiencies, measured kernel by kernel (benchmarks/kernel_time.py), not fitted here.
PER_KERNEL = ("flop_efficiency", "tf32_flop_efficiency", "fp32_flop_efficiency", "misaligned_flop_efficiency",
              "misaligned_even_flop_efficiency", "convolution_flop_efficiency", "attention_flop_efficiency",
              "bandwidth_efficiency", "streaming_bandwidth_efficiency", "native_batch_norm_bandwidth_efficiency")
#: TimeModel's constants, in the order step_seconds takes them.
PARAMS = tuple(f.name for f in fields(TimeModel))


def step_seconds(tr: np.ndarray, gpu, fe: float, te: float, f32e: float, mfe: float, mee: float, ce: float, ae: float,
                 be: float, sbe: float, nbe: float, per_kernel: float, host_forward: float, host_backward: float,
                 host_convolution: float, host_recompute: float, link: float, host_hook: float,
                 extra_host: float = 0.0) -> float:
    """TimeModel on a trace, vectorised. The host issues row j at the sum of
    the issue costs up to it; the device runs each kernel (or transfer) once
    issued and the previous one is done, so between two synchronisations (a
    transfer the host waits for) the device ends at the max over j of
    (issue_j + the device time of row j and all after it up to the
    synchronisation), and the segment lasts the longer of that and the host's
    sum; the step is the sum of its segments. ``extra_host``: host seconds the
    trace does not hold, at its end (the optimizer's Python)."""
    if not len(tr):
        return 0.0
    flops, nbytes, kind = tr[:, 0], tr[:, 1], tr[:, 2]
    conv, bwd, rec, ops, kinds = tr[:, 3] > 0, tr[:, 4] > 0, tr[:, 5] > 0, tr[:, 6], tr[:, 7]
    # TimeModel.host_seconds, times the operators each row stands for.
    phase = np.where(conv, host_convolution, np.where(bwd & ~rec, host_backward, host_forward))
    host = np.where(kind == -4, host_hook, ops * (phase + np.where(rec, host_recompute, 0.0)))  # -4: a hook call
    rates = np.array([gpu.fp32_tflops, gpu.tf32_tflops or gpu.bf16_tflops / 2, gpu.bf16_tflops]) * 1e12
    precision = np.clip(kind, 0, 2).astype(int)
    # on tensor cores: of the 16-bit rate (TimeModel.seconds)
    odd, even = ((kinds == k) & (precision > 0) for k in (MISALIGNED, MISALIGNED_EVEN))
    misaligned = odd | even
    shares = np.select([kinds == CONVOLUTION, kinds == ATTENTION, odd, even, precision == 0, precision == 1],
                       [ce, ae, mfe, mee, f32e, te], fe)
    rates = np.where(misaligned, rates[2], rates[precision]) * shares
    kernel, transfer = kind >= 0, (kind == -2) | (kind == -3)
    bandwidth = gpu.memory_bandwidth * np.select([kinds == STREAMING, kinds == NATIVE_BATCH_NORM], [sbe, nbe], be)
    roof = np.maximum(flops / rates, nbytes / bandwidth) + per_kernel
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
    hosts = np.add.reduceat(host, starts)
    hosts[-1] += extra_host
    return float(np.maximum(device, hosts).sum())


def _descend(score, start: list[float], bounded: tuple[int, ...], frozen: tuple[int, ...] = ()) -> list[float]:
    """Coordinate descent from ``start`` by relative steps (50 % down to 0.5 %),
    each constant but those in ``frozen`` up or down while ``score`` falls;
    those in ``bounded`` stay <= 1."""
    best, value = list(start), score(start)
    for step in (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005):
        moved = True
        while moved:
            moved = False
            for i in (i for i in range(len(best)) if i not in frozen):
                for factor in (1 + step, 1 / (1 + step)):
                    trial = list(best)
                    trial[i] = min(trial[i] * factor, 1.0) if i in bounded else trial[i] * factor
                    v = score(trial)
                    if v < value - 1e-12:
                        best, value, moved = trial, v, True
    return best


def _measurements(out: Path) -> list[dict]:
    """Every measured step: set, run (the file it came from), workload, plan,
    seconds, peak reserved bytes, the torch it ran on. The verify run of
    benchmarks/advise.py (``advise-verified.json``) adds its workloads to the
    fit set where that has them, else to the check set."""
    rows = []
    for which in SETS:
        data = json.loads((out / f"step-time-measured-{which}.json").read_text())
        for (model, size) in SETS[which]:
            for plan, r in data["runs"].get(_name(model, size), {}).items():
                if "seconds" in r:
                    rows.append({"set": which, "run": "step-time", "model": model, "size": size, "plan": plan,
                                 "seconds": r["seconds"], "peak_reserved": r["peak_reserved"],
                                 "torch": data["meta"]["torch"]})
    verified = out / "advise-verified.json"
    if verified.exists():
        data = json.loads(verified.read_text())
        fitted = {_name(*w) for w in SETS["fit"]}
        for model, runs in data["measured"].items():
            size = VERIFIED[model]
            for r in runs:
                seconds = r.get("measured_seconds")  # absent or NaN for a plan that ran out of memory
                if seconds is None or math.isnan(seconds) or any(x in r["plan"] for x in SKIP):
                    continue
                rows.append({"set": "fit" if _name(model, size) in fitted else "check", "run": "advise",
                             "model": model, "size": size, "plan": r["plan"], "seconds": seconds,
                             "peak_reserved": r["measured_peak_reserved"], "torch": data["meta"]["torch"]})
    return rows


def _parameters(model: str) -> int:
    """The parameter tensors of a suite model (built on meta)."""
    from suite import _parts

    with torch.device("meta"):
        return sum(1 for _ in _parts(model, "meta", (1, 8) if model in ("gpt2", "llama", "bert") else (1,))[0].parameters())


def fit(out: Path, optimizer_host: float = 0.0) -> None:
    """Simulate every measured plan, fit the time model on the fit set, report both sets.
    ``optimizer_host``: host seconds per parameter tensor added to every step (the
    optimizer's Python, which the simulated trace does not charge: host_cost.py)."""
    from memprof.devices import get_gpu

    gpu = get_gpu("H200-141GB")
    # Not kept in the repository: made again when absent (delete it when the simulation changes).
    cache = out / "step-time-traces.npz"
    kept = {k: v for k, v in np.load(cache).items() if v.shape[1:] == (COLUMNS,)} if cache.exists() else {}
    rows = _measurements(out)
    for r in rows:
        # save_on_cpu's pack waited for its copy before torch 2.12 (see ActivationOffload.synchronous_pack).
        sync = TorchVersion(r["torch"]) < (2, 12)
        key = f"{_name(r['model'], r['size'])}|{r['plan']}|{'sync' if sync else 'async'}"
        if key not in kept:
            t = time.perf_counter()
            kept[key] = trace(r["model"], r["size"], r["plan"], gpu, synchronous_pack=sync)
            print(f"{key}: {len(kept[key])} ops ({time.perf_counter() - t:.1f} s)", flush=True)
        r["trace"] = kept[key]
        r["extra_host"] = optimizer_host * _parameters(r["model"]) if optimizer_host else 0.0
    np.savez_compressed(cache, **kept)

    def score(params) -> float:
        return statistics.mean(abs(math.log(step_seconds(r["trace"], gpu, *params, extra_host=r["extra_host"])
                                            / r["seconds"]))
                               for r in rows if r["set"] == "fit")

    shipped = list(astuple(TimeModel()))  # the constants memprof has now
    bounded = tuple(PARAMS.index(n) for n in PARAMS if "efficiency" in n)
    best = [float(v) for v in _descend(score, shipped, bounded, frozen=tuple(PARAMS.index(n) for n in PER_KERNEL))]
    for r in rows:
        tr = r.pop("trace")
        r["workload"] = _name(r.pop("model"), r.pop("size"))
        r["ops"] = len(tr)
        extra = r.pop("extra_host")
        r["predicted_s"] = step_seconds(tr, gpu, *best, extra_host=extra)
        r["shipped_s"] = step_seconds(tr, gpu, *shipped)
        r["error"], r["error_shipped"] = r["predicted_s"] / r["seconds"] - 1, r["shipped_s"] / r["seconds"] - 1
    summary: dict = {}
    for which in SETS:
        for key in ("error", "error_shipped"):
            errs = sorted(abs(r[key]) for r in rows if r["set"] == which)
            summary[f"{which}_{key}"] = {"plans": len(errs), "median": statistics.median(errs), "worst": errs[-1],
                                         "within_15": sum(e <= 0.15 for e in errs),
                                         "within_30": sum(e <= 0.30 for e in errs)}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["set"], r["run"], r["workload"]), []).append(r)
    per_workload = {
        "|".join(k): {"plans": len(g), "median": statistics.median(abs(r["error"]) for r in g),
                      "worst": max((r["error"] for r in g), key=abs),
                      "worst_plan": max(g, key=lambda r: abs(r["error"]))["plan"]}
        for k, g in groups.items()}
    # The advisor's choice with these times, per run: the fastest predicted of the plans that fit
    # a budget (fitting by the measured peak reserved, so that this checks the time model alone).
    choices = []
    for (which, run, name), g in groups.items():
        for budget in (12, 24):
            fit_plans = [r for r in g if r["peak_reserved"] <= budget * 2**30]
            if not fit_plans:
                continue
            fastest = min(fit_plans, key=lambda r: r["seconds"])
            row = {"set": which, "run": run, "workload": name, "budget_GiB": budget, "fastest": fastest["plan"]}
            for suffix, column in (("", "predicted_s"), ("_shipped", "shipped_s")):
                chosen = min(fit_plans, key=lambda r: r[column])
                row["chosen" + suffix] = chosen["plan"]
                row["slower_than_fastest" + suffix] = chosen["seconds"] / fastest["seconds"] - 1
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
    ap.add_argument("--optimizer-host", type=float, default=0.0,
                    help="fit: host seconds per parameter tensor added to each step (e.g. 20e-6)")
    a = ap.parse_args()
    measure(a.set, a.out, a.only.split(",") if a.only else None) if a.what == "measure" else fit(a.out, a.optimizer_host)


if __name__ == "__main__":
    main()
