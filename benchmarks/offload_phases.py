"""Where a state-offload step's time goes, phase by phase, on the GPU.

    python3 benchmarks/offload_phases.py --out DIR [--models gpt2 bert vit_b_16 llama]   # on the GPU

For each model of the advisor's benchmark (benchmarks/advise.py), the plans
``bf16`` and ``bf16+offload_states`` (FSDP2 with ``CPUOffloadPolicy`` on a
one-rank process group, AdamW on the host) built as ``memprof.verify``
builds them; after 2 warm-up steps, 5 steps with the device synchronized at
each phase's edge: forward (to the root module's output), backward and
zeroing (to the optimizer's step), and the optimizer's step. Synchronizing
keeps the phases from overlapping, so the phases' sum is a little more than
the step ``verify`` times. Also: the parameters' tensor count and element
count, and the step without the synchronizations. Writes
``offload-phases.json`` (and with ``--profile`` the host's operators of one
step by their own time, ``offload-phases-MODEL-PLAN.txt``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import default_plans, measure_steps  # noqa: E402

PLANS = ("bf16", "bf16+offload_states")


def phases(model: str, plan: str, steps: int = 5, warmup: int = 2, profile: Path | None = None) -> dict:
    strategies = default_plans()[plan]()
    w = workload(model)
    for s in strategies:
        s.apply(w)
    plain = measure_steps(w, steps, warmup)["seconds"]
    marks: dict[str, float] = {}

    def mark(name):
        def hook(*_):
            torch.cuda.synchronize()
            marks[name] = time.perf_counter()
        return hook

    handles = [w.model.register_forward_hook(mark("forward")),
               w.optimizer.register_step_pre_hook(mark("step")), w.optimizer.register_step_post_hook(mark("end"))]
    rows = []
    try:
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            w.step()
            torch.cuda.synchronize()
            end = time.perf_counter()
            if i >= warmup:
                rows.append({"forward": marks["forward"] - start, "backward": marks["step"] - marks["forward"],
                             "optimizer": marks["end"] - marks["step"], "total": end - start})
    finally:
        for h in handles:
            h.remove()
    if profile is not None:  # one more step: the host's operators by their own time
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            w.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (profile / f"offload-phases-{model}-{plan}.txt").write_text(table + "\n")
    params = [p for p in w.model.parameters() if p.requires_grad]
    out = {"model": model, "plan": plan, "tensors": len(params), "elements": sum(p.numel() for p in params),
           "step_seconds": plain, **{k: statistics.median(r[k] for r in rows) for k in rows[0]}}
    del w
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["gpt2", "bert", "vit_b_16", "llama"])
    ap.add_argument("--profile", action="store_true", help="also the host's operators of one step (torch.profiler)")
    a = ap.parse_args()
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29534", rank=0, world_size=1)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in a.models:
        for plan in PLANS:
            rows.append(phases(m, plan, profile=a.out if a.profile else None))
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    dist.destroy_process_group()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpus": os.cpu_count(),
            "omp_threads": torch.get_num_threads(), "command": "python3 " + " ".join(sys.argv)}
    (a.out / "offload-phases.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
