"""ZeRO-1/2/3 and state offload on several GPUs: each rank measured next to memprof's prediction.

    torchrun --nproc-per-node 2 benchmarks/zero.py measure [--models gpt2 llama] [--plans ...] [--track] [--out DIR]
    python benchmarks/zero.py predict --world-size 2 [--out DIR]   # any machine, no GPU needed
    python benchmarks/zero.py compare --world-size 2 [--out DIR]

GPT-2 124M (16 x 1024) and the suite's Llama-style 0.55 B decoder (4 x 2048),
fp32 + AdamW, each rank with its own batch. Plans: the single-GPU step
(``baseline``, every rank alone, and ``bf16+ckpt``); ZeRO-1
(``ZeroRedundancyOptimizer`` + DDP), ZeRO-2 and ZeRO-3 (FSDP2 ``fully_shard``)
in fp32 and with bf16 autocast + checkpointing, the latter also with FSDP2's
CPU offload; and plain DDP for reference. ``measure`` writes
``zero-measured-N.json`` (per rank: peak allocated and reserved after
warm-up, median step time); ``predict`` writes ``zero-predicted-N.json``
(``memprof.advisor.simulate_plan`` for an H200 and N ranks); ``compare``
writes ``zero-N.md``: per-rank measured (the largest over ranks) against
predicted, and the saving against the measured single-GPU step.

DDP leaves allocations behind that garbage collection does not free, which
would count in the next plan's peak: run each plan that uses DDP (``zero1``,
``ddp``) in a process of its own (``left_over`` in the JSON is what was
allocated before a plan's model was built; 64-66 MiB is cuBLAS's workspace).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

MODELS = ("gpt2", "llama")
GiB = 2**30


def plans(world: int) -> dict:
    from memprof.strategies import Autocast, Checkpointing, ZeRO

    def bf16_ckpt():
        return [Autocast("bf16"), Checkpointing()]

    out = {"baseline": list, "bf16+ckpt": bf16_ckpt}
    for stage in (1, 2, 3):
        out[f"zero{stage}x{world}"] = lambda s=stage: [ZeRO(s, world)]
        out[f"bf16+ckpt+zero{stage}x{world}"] = lambda s=stage: [*bf16_ckpt(), ZeRO(s, world)]
    for stage in (2, 3):
        out[f"bf16+ckpt+zero{stage}x{world}_offload"] = lambda s=stage: [*bf16_ckpt(), ZeRO(s, world, offload=True)]
    return out


def _ddp(w) -> None:
    from torch.nn.parallel import DistributedDataParallel

    w.model = DistributedDataParallel(w.model)


def _tracked_peak(w, steps: int) -> dict:
    """Where this rank's peak bytes went, by memprof."""
    import memprof

    try:
        with memprof.track(w.model, w.optimizer, warmup=steps) as prof:
            for _ in range(steps):
                w.step()
        r = prof.report()
        return {"tracked_peak": {"phase": r.peak.phase, "bytes": r.peak.bytes}}
    except Exception as exc:
        return {"track_error": f"{type(exc).__name__}: {exc}"[:500]}


def measure(models, names, out: Path, steps: int, warmup: int, track: bool) -> None:
    import torch.distributed as dist

    from memprof.advisor import measure_steps

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    results = {}
    for m in models:
        rows = {}
        for name, plan in {**plans(world), "ddp": None}.items():
            if names and name not in names:
                continue
            gc.collect()  # strategies leave reference cycles: free the last plan's model first
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated()
            w = workload(m)
            try:
                if plan is None:
                    _ddp(w)
                else:
                    for s in plan():
                        s.apply(w)
                row = {"left_over": left, **measure_steps(w, steps, warmup, before=dist.barrier)}
                if track:
                    row.update(_tracked_peak(w, steps))
            except Exception as exc:  # one plan that fails must not hide the others
                row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            del w
            per_rank = [None] * world
            dist.all_gather_object(per_rank, row)
            rows[name] = per_rank
            if rank == 0:
                print(m, name, json.dumps(per_rank), flush=True)
        results[m] = rows
    if rank == 0:
        meta = {"world_size": world, "torch": torch.__version__, "device": torch.cuda.get_device_name(), "steps": steps, "warmup": warmup}
        path = out / f"zero-measured-{world}.json"  # one model at a time adds to what is there
        old = json.loads(path.read_text())["results"] if path.exists() else {}
        merged = {m: {**old.get(m, {}), **rows} for m, rows in {**old, **results}.items()}
        path.write_text(json.dumps({"meta": meta, "results": merged}, indent=1))
    dist.destroy_process_group()


def predict(models, out: Path, world: int) -> None:
    from memprof.advisor import simulate_plan
    from memprof.devices import get_gpu

    gpu = get_gpu("H200-141GB")
    results = {}
    for m in models:
        base = None
        rows = {}
        for name, plan in plans(world).items():
            t = time.perf_counter()
            p = simulate_plan(lambda: workload(m), plan, gpu, baseline=base)
            if name == "baseline":
                base = p.report
            rows[name] = {"peak_allocated": p.peak_allocated, "peak_reserved": p.peak_reserved, "seconds": p.seconds}
            print(m, name, f"{p.peak_allocated / GiB:.2f} GiB allocated, {time.perf_counter() - t:.1f} s", flush=True)
        results[m] = rows
    (out / f"zero-predicted-{world}.json").write_text(json.dumps({"world_size": world, "target": gpu.name, "results": results}, indent=1))


def compare(out: Path, world: int) -> str:
    import pandas as pd

    measured = json.loads((out / f"zero-measured-{world}.json").read_text())["results"]
    predicted = json.loads((out / f"zero-predicted-{world}.json").read_text())["results"]
    lines = []
    for m, rows in measured.items():
        table = []
        base = max(r["peak_allocated"] for r in rows["baseline"])
        for name, ranks in rows.items():
            if any("error" in r for r in ranks):
                table.append({"plan": name, "error": next(r["error"] for r in ranks if "error" in r)})
                continue
            meas = {k: max(r[k] for r in ranks) for k in ("peak_allocated", "peak_reserved", "seconds")}
            row = {"plan": name, "measured alloc GiB": meas["peak_allocated"] / GiB, "measured reserved GiB": meas["peak_reserved"] / GiB,
                   "measured ms": 1e3 * meas["seconds"], "measured saving GiB": (base - meas["peak_allocated"]) / GiB}
            if name in predicted[m]:
                p = predicted[m][name]
                row.update({"predicted alloc GiB": p["peak_allocated"] / GiB, "alloc error %": 100 * (p["peak_allocated"] / meas["peak_allocated"] - 1),
                            "predicted reserved GiB": p["peak_reserved"] / GiB, "reserved error %": 100 * (p["peak_reserved"] / meas["peak_reserved"] - 1),
                            "predicted saving GiB": (predicted[m]["baseline"]["peak_allocated"] - p["peak_allocated"]) / GiB,
                            "predicted ms": 1e3 * p["seconds"]})
            table.append(row)
        lines += [f"## {m}, {world} ranks", "", _markdown(pd.DataFrame(table)), ""]
    text = "\n".join(lines)
    (out / f"zero-{world}.md").write_text(text)
    return text


def _markdown(df) -> str:
    cells = [[c for c in df.columns]] + [["" if v != v else f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in df.itertuples(index=False)]
    return "\n".join("| " + " | ".join(r) + " |" for r in [cells[0], ["---"] * len(df.columns), *cells[1:]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["measure", "predict", "compare"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--plans", nargs="+", help="measure: only these plans (default: all, and plain DDP)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--track", action="store_true", help="measure: also record memprof's breakdown of each rank's peak")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "measure":
        measure(a.models, a.plans, a.out, a.steps, a.warmup, a.track)
    elif a.mode == "predict":
        predict(a.models, a.out, a.world_size)
    else:
        print(compare(a.out, a.world_size))


if __name__ == "__main__":
    main()
