"""ZeRO-1/2/3 and state offload on several GPUs: each rank measured next to memprof's prediction.

    torchrun --nproc-per-node 2 benchmarks/zero.py measure [--models ...] [--plans ...] [--track DIR] [--out DIR]
    python benchmarks/zero.py predict --world-size 2 [--out DIR]   # any machine, no GPU needed
    python benchmarks/zero.py compare --world-size 2 [--out DIR]

GPT-2 124M (16 x 1024) and the suite's Llama-style 0.55 B decoder (4 x 2048),
and two models outside the suite (``OUTSIDE``), fp32 + AdamW, each rank with
its own batch. Plans: the single-GPU step
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
from suite import workload as suite_workload  # noqa: E402

SUITE = ("gpt2", "llama")
# Models the suite does not contain: a Qwen2.5-0.5B-shaped decoder (grouped-
# query attention, tied embeddings, a 152k vocabulary), also with Hugging
# Face's own gradient checkpointing (``qwen-hfckpt``), and a Pythia-410M-shaped
# GPT-NeoX (parallel residual, partial rotary embedding).
OUTSIDE = ("qwen", "qwen-hfckpt", "neox")
MODELS = SUITE + OUTSIDE
GiB = 2**30


def plans(world: int, model: str = "") -> dict:
    """Plan name -> strategies. A model that checkpoints itself gets bf16
    autocast alone where the others get bf16 + memprof's checkpointing."""
    from memprof.strategies import Autocast, Checkpointing, ZeRO

    own = model.endswith("hfckpt")
    tag = "bf16" if own else "bf16+ckpt"

    def mixed():
        return [Autocast("bf16")] + ([] if own else [Checkpointing()])

    out = {"baseline": list, tag: mixed}
    for stage in (1, 2, 3):
        out[f"zero{stage}x{world}"] = lambda s=stage: [ZeRO(s, world)]
        out[f"{tag}+zero{stage}x{world}"] = lambda s=stage: [*mixed(), ZeRO(s, world)]
    for stage in (2, 3):
        out[f"{tag}+zero{stage}x{world}_offload"] = lambda s=stage: [*mixed(), ZeRO(s, world, offload=True)]
    return out


def workload(model: str, device: str = "cuda"):
    """``model`` (suite or outside it), fp32, AdamW, as a memprof Workload."""
    if model in SUITE:
        return suite_workload(model, device)
    import transformers

    from memprof.workload import Workload

    torch.manual_seed(0)
    if model.startswith("qwen"):
        cfg = transformers.Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=2048)
        net, (batch, seq) = transformers.Qwen2ForCausalLM(cfg), (4, 1024)
    else:
        cfg = transformers.GPTNeoXConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
            vocab_size=50304, rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=2048)
        net, (batch, seq) = transformers.GPTNeoXForCausalLM(cfg), (8, 1024)
    if model.endswith("hfckpt"):
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net = net.to(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    return Workload(net, torch.optim.AdamW(net.parameters(), lr=1e-4), dict(input_ids=ids, labels=ids), lambda m, d: m(**d).loss)


def _ddp(w) -> None:
    from torch.nn.parallel import DistributedDataParallel

    w.model = DistributedDataParallel(w.model)


def _tracked_peak(w, steps: int, save: Path | None = None) -> dict:
    """Where this rank's peak bytes went, by memprof; the whole report saved to ``save``."""
    import memprof

    try:
        with memprof.track(w.model, w.optimizer, warmup=steps, full=True) as prof:
            for _ in range(steps):
                w.step()
        r = prof.report()
        if save is not None:
            r.save(save)
        return {"tracked_peak": {"phase": r.peak.phase, "bytes": r.peak.bytes}}
    except Exception as exc:
        return {"track_error": f"{type(exc).__name__}: {exc}"[:500]}


def measure(models, names, out: Path, steps: int, warmup: int, track: Path | None) -> None:
    import torch.distributed as dist

    from memprof.advisor import measure_steps

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    results = {}
    for m in models:
        rows = {}
        for name, plan in {**plans(world, m), "ddp": None}.items():
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
                if track is not None:
                    row.update(_tracked_peak(w, steps, track / f"{m}-{name.replace('+', '_')}-rank{rank}.json"))
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
        for name, plan in plans(world, m).items():
            t = time.perf_counter()
            p = simulate_plan(lambda: workload(m), plan, gpu, baseline=base)
            if name == "baseline":
                base = p.report
            rows[name] = {"peak_allocated": p.peak_allocated, "peak_reserved": p.peak_reserved, "seconds": p.seconds}
            print(m, name, f"{p.peak_allocated / GiB:.2f} GiB allocated, {time.perf_counter() - t:.1f} s", flush=True)
        results[m] = rows
    path = out / f"zero-predicted-{world}.json"  # one model at a time replaces its own rows
    old = json.loads(path.read_text())["results"] if path.exists() else {}
    path.write_text(json.dumps({"world_size": world, "target": gpu.name, "results": {**old, **results}}, indent=1))


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
    ap.add_argument("--track", type=Path, metavar="DIR", help="measure: also track each plan with memprof; its reports go to DIR")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.track is not None:
        a.track.mkdir(parents=True, exist_ok=True)
    if a.mode == "measure":
        measure(a.models, a.plans, a.out, a.steps, a.warmup, a.track)
    elif a.mode == "predict":
        predict(a.models, a.out, a.world_size)
    else:
        print(compare(a.out, a.world_size))


if __name__ == "__main__":
    main()
