"""How much of the datasheet each kind of kernel reaches: measured kernel by kernel on the GPU.

    python benchmarks/kernel_time.py measure [--out DIR]   # on the GPU: kernel-time-measured.json
    python benchmarks/kernel_time.py fit [--out DIR]       # anywhere: kernel-time-fit.json

``measure`` runs one steady training step (after three) of each workload
(benchmarks/suite.py's models at their suite sizes, AdamW; fp32, fp32 with
TF32 matrix products, bf16 autocast) under ``torch.profiler`` and keeps,
per operator and input shapes, the calls and the device time of the
kernels each launched itself. ``fit``
simulates the same steps on the H200 and sets each kind of kernel of
``memprof.simulate.TimeModel`` (``_kernel_kind``) against the measured time
of the same operators:

* matrix products: their arithmetic from the measured shapes (2 M N K per
  product) over their measured time, at the rate they run at, for the
  products the arithmetic bounds (fp32; TF32; 16-bit; on tensor cores with a
  dimension that is not a multiple of 16 bytes, at the 16-bit rate, 16-bit
  ones with even dimensions apart);
* convolutions and fused attention: the simulated arithmetic over the
  measured time, at the rate they run at (16-bit, or TF32 as cuDNN allows
  convolutions by default; the attention backend the GPU ran may differ
  from the one the simulation, on another torch, chose);
* every other kernel: the simulated bytes over the measured time, per
  operator family (PyTorch names the kernel of a cast ``copy_``, the
  simulation sees ``_to_copy``; autograd accumulates gradients with ``add_``
  on the GPU and ``add`` under a dispatch mode), elementwise kernels apart.

Each kind's rows (a workload's operator family, or a matrix product's
shapes) are fitted as TimeModel prices a kernel: time = work at the
datasheet's rate / share + calls x a fixed cost, least squares on the
relative error, the share at most 1 and the fixed cost at least 0 (where the
rows cannot tell them apart the fixed cost is 0: the share is then the sum
of the work over the sum of the time). ``benchmarks/step_time.py fit``
takes the shares as they are and fits the host's constants and the cost
per kernel to whole steps.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import default_plans  # noqa: E402

WORKLOADS = ("llama", "gpt2", "bert", "vit_b_16", "deep_mlp", "resnet50")
#: Plans: "tf32" is the baseline with torch.backends.cuda.matmul.allow_tf32 on.
PLANS = ("baseline", "tf32", "bf16")
#: The matrix operands of the products, by the profiler's operator name.
GEMM = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}


def measure(out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise SystemExit("measure runs on a CUDA GPU")
    runs = {}
    for model in WORKLOADS:
        for plan in PLANS:
            torch.cuda.empty_cache()
            w = workload(model, "cuda")
            for s in default_plans()[_plan(plan)]():
                s.apply(w)
            with _tf32(plan):
                for _ in range(3):
                    w.step()
                torch.cuda.synchronize()
                t = time.perf_counter()
                w.step()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                    w.step()
                    torch.cuda.synchronize()
            ops: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
            for e in prof.key_averages(group_by_input_shape=True):
                if e.device_type.name == "CPU" and e.self_device_time_total > 0:
                    row = ops[f"{e.key}|{e.input_shapes}"]
                    row[0] += e.count
                    row[1] += e.self_device_time_total * 1e-6
            runs[f"{model}|{plan}"] = {"step_seconds": seconds, "ops": ops}
            print(model, plan, f"{seconds * 1e3:.1f} ms", flush=True)
            del w, prof
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel-time-measured.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=0) + "\n")


def _plan(plan: str) -> str:
    return "baseline" if plan == "tf32" else plan


@contextlib.contextmanager
def _tf32(plan: str):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = plan == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _family(name: str) -> str:
    name = name.removeprefix("aten::")
    if name in ("_to_copy", "copy_", "copy"):
        return "copy"
    if "attention" in name:  # the GPU's kernel names and the simulation's operators differ; so may the backend
        return "attention backward" if "backward" in name else "attention"
    if name.startswith("cudnn_batch_norm"):  # the simulation sees the operator PyTorch dispatches to its kernels
        return name.replace("cudnn_batch_norm", "native_batch_norm")
    return "convolution" if name == "cudnn_convolution" else name.rstrip("_")


def simulated(model: str, plan: str, gpu) -> tuple[dict[str, list], float]:
    """Per operator family of a steady simulated step: [calls, flops, bytes, kind, precision],
    from the rows the simulation traces for its kernels; and the step's simulated seconds
    (memprof's TimeModel as shipped)."""
    from memprof.simulate import SimulatedAllocator, _state_tensors
    from memprof.virtual_cuda import VirtualCUDA

    rows: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0, 0, 0])

    class Recording(SimulatedAllocator):
        """Names each kernel's trace row (SimulatedAllocator.trace) after its operator."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = len(self.trace) if self.trace is not None else None
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if before is not None and len(self.trace) > before and self.trace[-1][2] >= 0:
                flops, nbytes, precision, *_, kind = self.trace[-1]
                r = rows[_family(func.__name__.split(".")[0])]
                r[0] += 1
                r[1] += flops
                r[2] += nbytes
                r[3], r[4] = kind, precision
            return out

    alloc = Recording(gpu)
    with VirtualCUDA(gpu, allocator=alloc):
        with torch.device("meta"):
            w = workload(model, "cuda")
        alloc.adopt(_state_tensors(w.model, w.optimizer))
        for s in default_plans(gpu=gpu)[_plan(plan)]():
            s.apply_simulated(w)
        with _tf32(plan):
            w.step()
            w.step()
            alloc.trace, start = [], alloc.clock()
            w.step()
            seconds = alloc.clock() - start
    return dict(rows), seconds


def fit(out: Path) -> None:
    from memprof.devices import get_gpu
    from memprof.simulate import ATTENTION, CONVOLUTION, NATIVE_BATCH_NORM, STREAMING

    gpu = get_gpu("H200-141GB")
    measured = json.loads((out / "kernel-time-measured.json").read_text())["runs"]
    rates = {0: gpu.fp32_tflops * 1e12, 1: gpu.tf32_tflops * 1e12, 2: gpu.bf16_tflops * 1e12}
    rows: dict[str, list] = collections.defaultdict(list)  # kind -> [(work at the datasheet's rate, calls, seconds)]
    per_workload = {}
    for key, run in measured.items():
        model, plan = key.split("|")
        precision = {"baseline": 0, "tf32": 1, "bf16": 2}[plan]
        sim, predicted = simulated(model, plan, gpu)
        families: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for op, (calls, seconds) in run["ops"].items():
            name, shapes = op.split("|", 1)
            if not name.startswith("aten::"):
                continue  # the profiler's own rows (a full launch queue: "Command Buffer Full")
            if name not in GEMM:
                f = families[_family(name)]
                f[0] += calls
                f[1] += seconds
                continue
            sh = ast.literal_eval(shapes)
            a, b = (sh[i] for i in GEMM[name])
            m, k, n = a[-2], a[-1], b[-1]
            batch = a[0] if len(a) == 3 else 1
            size = 2 if precision == 2 else 4
            flops = 2 * batch * m * n * k * calls
            nbytes = (batch * (m * k + k * n + m * n)) * size * calls
            rate = rates[precision]
            if flops / rate < nbytes / gpu.memory_bandwidth:
                continue  # the bytes bound it: says nothing of the arithmetic rate
            kind = ("fp32", "TF32", "16-bit")[precision]
            if precision and any(x % (16 // size) for x in (m, k, n)):  # the shapes stand for the leading dimensions
                even = size == 2 and not any(x % 2 for x in (m, k, n))
                kind, rate = f"misaligned{', even' if even else ''}, of the 16-bit rate", rates[2]  # TimeModel.seconds
            rows["matmul " + kind].append((flops / rate, calls, seconds))
        for family, (calls, flops, nbytes, kind, precision) in sim.items():
            if family in {_family(name) for name in GEMM} or family not in families:  # priced from their shapes
                continue
            if kind in (CONVOLUTION, ATTENTION):
                name, amount = ("convolution" if kind == CONVOLUTION else "attention"), flops / rates[precision]
            else:
                name = {STREAMING: "elementwise", NATIVE_BATCH_NORM: "batch norm, PyTorch's kernel"}.get(kind, "other")
                amount = nbytes / gpu.memory_bandwidth
            rows[name].append((amount, families[family][0], families[family][1]))
        per_workload[key] = {"step_seconds": run["step_seconds"], "predicted_step_seconds": predicted,
                             "step_error": predicted / run["step_seconds"] - 1,
                             "kernel_seconds": sum(r[1] for k, r in run["ops"].items() if k.startswith("aten::"))}
        print(key, flush=True)
    shares = {kind: _share(r) for kind, r in sorted(rows.items())}
    print(json.dumps(shares, indent=1))
    (out / "kernel-time-fit.json").write_text(json.dumps(
        {"shares": shares, "per_workload": per_workload, "torch": torch.__version__,
         "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")


def _share(rows: list[tuple]) -> dict:
    """time = work / share + calls x fixed, weighted by 1 / time (relative errors)."""
    work, calls, seconds = (np.array(c, dtype=float) for c in zip(*rows))
    a = np.stack([work, calls], axis=1) / seconds[:, None]
    (inverse, fixed), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    if not (inverse >= 1 and fixed >= 0):  # the rows cannot tell the two apart: no fixed cost
        inverse, fixed = seconds.sum() / work.sum(), 0.0
    predicted = work * inverse + calls * fixed
    return {"share": 1 / inverse, "fixed_seconds": fixed, "rows": len(rows), "kernels": int(calls.sum()),
            "seconds": seconds.sum(), "median_abs_error": float(np.median(np.abs(predicted / seconds - 1))),
            "work_over_time": work.sum() / seconds.sum()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["measure", "fit"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    measure(a.out) if a.what == "measure" else fit(a.out)


if __name__ == "__main__":
    main()
