"""The operators a step issues, counted on the GPU and in the simulation, by phase and name.

    python3 benchmarks/op_counts.py measure --out DIR [--cases gpt2:bf16+ckpt ...]    # on the GPU
    python3 benchmarks/op_counts.py simulate --out DIR [--cases ...]                   # anywhere
    python3 benchmarks/op_counts.py compare DIR                                        # the two side by side

The time model charges the host per operator (memprof.simulate.TimeModel), so
the simulated step must issue the operators the real one does. Each case is
a suite workload (benchmarks/suite.py, the advisor's benchmark sizes, or
``model@BxS``) with a default plan applied; the third step is counted by a
dispatch mode below autograd and autocast, as the simulated allocator sees
operators: forward (Python), backward (autograd's engine), recompute (grad
mode on inside backward: checkpointing). Writes ``op-counts-<mode>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import default_plans  # noqa: E402

CASES = ["gpt2:bf16+ckpt", "gpt2:ckpt", "gpt2:bf16", "gpt2@4x256:bf16+ckpt", "llama:bf16+ckpt", "llama:bf16",
         "llama:ckpt", "bert:bf16+ckpt", "bert:bf16", "bert:ckpt"]


def _phase() -> str:
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    return "recompute" if torch.is_grad_enabled() else "backward"


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"{_phase()}|{func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _parse(case: str) -> tuple[str, tuple | None, str]:
    model, plan = case.split(":")
    size = None
    if "@" in model:
        model, dims = model.split("@")
        size = tuple(int(x) for x in dims.split("x"))
    return model, size, plan


def measure(cases: list[str]) -> dict:
    out = {}
    for case in cases:
        model, size, plan = _parse(case)
        w = workload(model, "cuda", size)
        for s in default_plans()[plan]():
            s.apply(w)
        w.step()
        w.step()
        with Count() as c:
            w.step()
        torch.cuda.synchronize()
        out[case] = dict(c.counts)
        print(case, sum(c.counts.values()), flush=True)
        del w
        torch.cuda.empty_cache()
    return out


def simulate(cases: list[str]) -> dict:
    """The operators of the step benchmarks/step_time.py's ``trace`` simulates (its third), as
    the time model charges them: each that adds a row to the trace (not the host's own work:
    a data pipeline, memprof's copies of small tensors' values)."""
    from torch.torch_version import TorchVersion

    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator
    from step_time import trace

    gpu = get_gpu("H200-141GB")
    out = {}
    original = SimulatedAllocator.__torch_dispatch__
    for case in cases:
        model, size, plan = _parse(case)
        counts: collections.Counter = collections.Counter()

        def dispatch(self, func, types, args=(), kwargs=None):
            before = len(self.trace) if self.trace is not None else None
            result = original(self, func, types, args, kwargs)
            if before is not None and len(self.trace) > before:
                counts[f"{_phase()}|{func.__name__}"] += 1
            return result

        SimulatedAllocator.__torch_dispatch__ = dispatch
        try:
            trace(model, size, plan, gpu, synchronous_pack=TorchVersion(torch.__version__) < (2, 12))
        finally:
            SimulatedAllocator.__torch_dispatch__ = original
        out[case] = dict(counts)
        print(case, sum(counts.values()), flush=True)
    return out


#: Operators on the host's own tensors, which the simulation leaves uncharged: the optimizer's
#: ``.item()`` of its step counters (kept on the host unless capturable), the profiler's record
#: functions, a Python scalar lifted to a tensor.
HOST_ONLY = ("_local_scalar_dense", "lift_fresh", "_record_function_enter_new", "_record_function_exit")


def compare(out: Path) -> None:
    real = json.loads((out / "op-counts-measure.json").read_text())
    sim = json.loads((out / "op-counts-simulate.json").read_text())
    for case in real:
        if case == "meta" or case not in sim:
            continue
        r, s = (collections.Counter({k: v for k, v in c[case].items() if k.split("|")[1].split(".")[0] not in HOST_ONLY})
                for c in (real, sim))
        by_phase = {p: (sum(v for k, v in r.items() if k.startswith(p + "|")), sum(v for k, v in s.items() if k.startswith(p + "|")))
                    for p in ("forward", "backward", "recompute")}
        print(f"{case}: measured / simulated by phase {by_phase}")
        diff = {k: (r[k], s[k]) for k in set(r) | set(s) if r[k] != s[k]}
        for k, (a, b) in sorted(diff.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:12]:
            print(f"    {k:50s} measured {a:6d} simulated {b:6d}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["measure", "simulate", "compare"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", nargs="+", default=CASES)
    args = ap.parse_args()
    if args.mode == "compare":
        compare(args.out)
        return
    counts = measure(args.cases) if args.mode == "measure" else simulate(args.cases)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"op-counts-{args.mode}.json").write_text(json.dumps(
        {"meta": {"torch": torch.__version__, "command": "python3 " + " ".join(sys.argv)}, **counts}, indent=1) + "\n")


if __name__ == "__main__":
    main()
