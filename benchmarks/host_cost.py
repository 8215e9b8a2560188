"""The host's time per phase of a step that nothing but the host bounds, measured and simulated.

    python3 benchmarks/host_cost.py measure --out DIR             # on the GPU
    python3 benchmarks/host_cost.py compare --out DIR             # anywhere: simulate, then side by side

The time model charges the host a constant per operator and phase
(memprof.simulate.TimeModel); fitted to whole steps, where the device's time
is mixed in and the host's speed moves, its recomputation constant came out
right for GPT-2 and 21-28 % high for a Llama and BERT (step-time.md). Here
each suite model runs at a size so small that the host bounds every phase
(batch 1, 64 tokens; one image), with each of baseline, bf16, ckpt and
bf16+ckpt applied by memprof.strategies, and the host's own time of each
phase is taken without synchronising: the forward (the loss computed), the
backward (``loss.backward()`` returns once the engine has issued every
kernel, the recomputation's included), the optimizer (step and zero_grad).
Each is the minimum over ``--steps`` steps after 3 warm-up steps (the
host's noise only adds). One more step, untimed, counts per phase the
operators below autograd (as the simulated allocator sees them), the
module calls and, after the forward, the autograd graph's nodes.

``compare`` simulates each case (benchmarks/step_time.py's ``trace``) and
sums the host time the shipped TimeModel charges per phase, next to the
measured. Writes ``host-cost-measured.json`` and ``host-cost.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from op_counts import _phase as phase  # noqa: E402
from suite import workload  # noqa: E402

from memprof.advisor import default_plans  # noqa: E402

SIZES = {"gpt2": (1, 64), "llama": (1, 64), "bert": (1, 64), "vit_b_16": (1,), "resnet50": (1,)}
PLANS = ["baseline", "bf16", "ckpt", "bf16+ckpt"]
PHASES = ("forward", "backward", "recompute", "optimizer")


def _phase(in_optimizer: bool) -> str:
    return "optimizer" if in_optimizer else phase()


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.in_optimizer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[_phase(self.in_optimizer)] += 1
        return func(*args, **(kwargs or {}))


def _nodes(loss: torch.Tensor) -> int:
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
    return len(seen)


def _step(w, count: _Count | None = None) -> dict:
    amp = (torch.autocast("cuda", dtype=w.autocast_dtype) if w.autocast_dtype is not None
           else contextlib.nullcontext())
    t0 = time.perf_counter()
    with amp:
        loss = w.loss_fn(w.model, w.batch)
    t1 = time.perf_counter()
    nodes = _nodes(loss) if count is not None else 0
    t1b = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if count is not None:
        count.in_optimizer = True
    w.optimizer.step()
    w.optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    if count is not None:
        count.in_optimizer = False
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1b, "optimizer": t3 - t2, "step": t4 - t0 - (t1b - t1),
            "nodes": nodes}


def measure(out: Path, steps: int, models: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("measure runs on a CUDA GPU")
    rows = []
    for model in models:
        for plan in PLANS:
            w = workload(model, "cuda", SIZES[model])
            for s in default_plans()[plan]():
                s.apply(w)
            for _ in range(3):
                _step(w)
            timed = [_step(w) for _ in range(steps)]
            calls: collections.Counter = collections.Counter()
            count = _Count()
            handle = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda m, a: calls.update([_phase(count.in_optimizer)]))
            try:
                with count:
                    counted = _step(w, count)
            finally:
                handle.remove()
            row = {"model": model, "size": SIZES[model], "plan": plan,
                   **{k: min(t[k] for t in timed) for k in ("forward", "backward", "optimizer", "step")},
                   "median_step": sorted(t["step"] for t in timed)[len(timed) // 2],
                   "ops": dict(count.ops), "module_calls": dict(calls), "nodes": counted["nodes"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del w
            torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cpu": platform.processor(),
            "steps": steps, "command": "python3 " + " ".join(sys.argv)}
    (out / "host-cost-measured.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def _simulated(model: str, plan: str) -> dict:
    """The shipped TimeModel's host seconds and operators per phase of the simulated third step."""
    import numpy as np
    from torch.torch_version import TorchVersion

    from memprof.devices import get_gpu
    from memprof.simulate import TimeModel
    from step_time import trace

    tr = trace(model, SIZES[model], plan, get_gpu("H200-141GB"),
               synchronous_pack=TorchVersion(torch.__version__) < (2, 12))
    tm = TimeModel()
    conv, bwd, rec, ops = tr[:, 3] > 0, tr[:, 4] > 0, tr[:, 5] > 0, tr[:, 6]
    host = np.array([tm.host_seconds(c, b, r) for c, b, r in zip(conv, bwd, rec)]) * ops
    last_backward = np.flatnonzero(bwd).max()
    phase = np.where(rec, "recompute", np.where(bwd, "backward", "forward")).astype(object)
    phase[last_backward + 1:] = "optimizer"
    return {p: {"seconds": float(host[phase == p].sum()), "ops": int(ops[phase == p].sum())} for p in PHASES}


def compare(out: Path) -> None:
    measured = json.loads((out / "host-cost-measured.json").read_text())
    rows = []
    for r in measured["rows"]:
        sim = _simulated(r["model"], r["plan"])
        # The backward's host time holds the recomputation's (the engine runs it).
        row = {"model": r["model"], "plan": r["plan"],
               "forward_ms": (r["forward"] * 1e3, sim["forward"]["seconds"] * 1e3),
               "backward_ms": (r["backward"] * 1e3,
                               (sim["backward"]["seconds"] + sim["recompute"]["seconds"]) * 1e3),
               "optimizer_ms": (r["optimizer"] * 1e3, sim["optimizer"]["seconds"] * 1e3),
               "ops": {p: (r["ops"].get(p, 0), sim[p]["ops"]) for p in PHASES},
               "module_calls": r["module_calls"], "nodes": r["nodes"]}
        rows.append(row)
        print(f"{r['model']:9s} {r['plan']:10s} " + "  ".join(
            f"{k[:-3]} {row[k][0]:6.2f} / {row[k][1]:6.2f} ms" for k in row if k.endswith("_ms")), flush=True)
    (out / "host-cost.json").write_text(json.dumps(
        {"meta": {"measured": measured["meta"], "torch": torch.__version__,
                  "command": "python3 " + " ".join(sys.argv)}, "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["measure", "compare"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    a = ap.parse_args()
    measure(a.out, a.steps, a.models) if a.what == "measure" else compare(a.out)


if __name__ == "__main__":
    main()
