"""The advisor end to end: every plan predicted, every plan that fits measured.

    python benchmarks/advise.py predict [--out DIR] [--models ...]   # any machine: simulate every plan for the H200
    python benchmarks/advise.py verify  [--out DIR] [--models ...]   # on the GPU: measure them
    python benchmarks/advise.py check   [--out DIR] [--verified A.json B.json]   # anywhere: errors and choices per budget
    python benchmarks/advise.py repeat --models gpt2 --plans P ...   # on the GPU: the same plans on fresh builds, 3 rounds
    python benchmarks/advise.py fresh --models gpt2 --plans P ...    # on the GPU: each plan in a process of its own

Four workloads, fp32 + AdamW as given: GPT-2 124M (16 x 1024), BERT-base
MLM (32 x 512), ViT-B/16 (batch 128) and the suite's Llama-style 0.5 B
decoder (4 x 2048); budgets of 12 and 24 GiB. ``verify`` measures (median
of 5 steps after 2, ``memprof.verify``) every plan predicted to need at most
1.25 x the larger budget, state offload included (one rank of a process
group). ``check`` takes, per budget, the plans whose *measured* peak
reserved fits it and reports the predicted step time's error on each
(median and worst), the plan the advisor recommends (``rerank``: fastest
predicted plan that fits with its margin) and how far its measured time is
from the fastest measured plan that fits, and from the fastest that fits
with the advisor's margin.

``verify`` measures a model's plans one after another in one process, as
``memprof.verify`` does; ``fresh`` measures each plan in a new process, as
a user's run starts. Peak reserved can differ between the two: the caching
allocator returns its segments to the driver between plans, and the
addresses the driver hands out next decide which of two equal free blocks
the allocator's best fit takes (``advise-fresh.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import HOST_BOUND, Advice, advise, default_plans, rerank, verify  # noqa: E402
from memprof.devices import get_gpu  # noqa: E402

MODELS = ("gpt2", "bert", "vit_b_16", "llama")
BUDGETS_GIB = (12, 24)
#: Plans predicted to need up to this much of the larger budget are measured:
#: a plan that fits when measured is never left out for a prediction a little high.
MEASURE_UP_TO = 1.25
TARGET = "H200-141GB"
MARGIN = 0.05  # the advisor's default (advise, rerank)


def predict(out: Path, models) -> None:
    path = out / "advise-predicted.json"
    tables = json.loads(path.read_text()) if path.exists() else {}
    for m in models:
        t = time.perf_counter()
        a = advise(lambda: workload(m), 10**15, target=TARGET, progress=False)  # every plan, ranked later per budget
        tables[m] = a.table.reset_index().to_dict(orient="records")
        print(f"{m}: {len(a.table)} plans simulated in {time.perf_counter() - t:.1f} s", flush=True)
    tables["meta"] = {"torch": torch.__version__, "command": "python " + " ".join(sys.argv)}
    path.write_text(json.dumps(tables, indent=1, default=float) + "\n")


def verify_all(out: Path, models) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # state offload runs FSDP2 on a process group of one rank
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    predicted = json.loads((out / "advise-predicted.json").read_text())
    path = out / "advise-verified.json"
    results = json.loads(path.read_text())["measured"] if path.exists() else {}
    gpu = get_gpu(TARGET)
    for m in models:
        table = pd.DataFrame(predicted[m]).set_index("plan")
        chosen = ["baseline", *[p for p in table.index if p != "baseline"
                                and table.at[p, "peak_reserved"] <= MEASURE_UP_TO * max(BUDGETS_GIB) * 2**30]]
        advice = Advice(10**15, gpu, 1, table, None, default_plans())
        measured = verify(lambda: workload(m), advice, plans=chosen, steps=5, warmup=2)
        print(m, "\n", measured.to_string(), flush=True)
        results[m] = measured.reset_index().to_dict(orient="records")
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpus": os.cpu_count(),
                "command": "python " + " ".join(sys.argv)}
        path.write_text(json.dumps({"meta": meta, "measured": results}, indent=1, default=float) + "\n")
    dist.destroy_process_group()


def repeat(out: Path, model: str, plans: list[str], rounds: int = 3) -> None:
    """``plans`` measured again on fresh builds in one process, in order, reversed, in order:
    how much a measured step moves by itself (``advise-noise-<model>.json``)."""
    from memprof.advisor import _measure

    factories, rows = default_plans(), []
    for r in range(rounds):
        for plan in plans if r % 2 == 0 else plans[::-1]:
            seconds = _measure(lambda: workload(model), factories[plan], steps=5, warmup=2)["seconds"]
            rows.append({"round": r, "plan": plan, "seconds": seconds})
            print(r, plan, round(seconds, 4), flush=True)
    (out / f"advise-noise-{model}.json").write_text(json.dumps(rows, indent=1) + "\n")


def fresh(out: Path, models, plans: list[str]) -> None:
    """Each of ``plans`` measured in a process of its own, next to its
    prediction and its measurement in ``verify``'s sequence (``advise-fresh.json``)."""
    import subprocess

    predicted = json.loads((out / "advise-predicted.json").read_text())
    in_sequence = json.loads((out / "advise-verified.json").read_text())["measured"]
    path = out / "advise-fresh.json"
    results = json.loads(path.read_text())["measured"] if path.exists() else {}
    for m in models:
        pred = {r["plan"]: r for r in predicted[m]}
        seq = {r["plan"]: r for r in in_sequence.get(m, [])}
        rows = []
        for plan in plans:
            r = subprocess.run([sys.executable, __file__, "one", "--models", m, "--plans", plan],
                               capture_output=True, text=True, check=True)
            got = json.loads(r.stdout.strip().splitlines()[-1])
            row = {"plan": plan, "predicted_peak_reserved": pred[plan]["peak_reserved"],
                   "measured_peak_reserved": got["peak_reserved"],
                   "in_sequence_peak_reserved": seq.get(plan, {}).get("measured_peak_reserved"),
                   "predicted_peak_allocated": pred[plan]["peak_allocated"], "measured_peak_allocated": got["peak_allocated"],
                   "measured_seconds": got["seconds"]}
            print(m, row, flush=True)
            rows.append(row)
        results[m] = rows
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}
        path.write_text(json.dumps({"meta": meta, "measured": results}, indent=1, default=float) + "\n")


def one(model: str, plan: str) -> None:
    """One plan measured as ``verify`` measures it (median of 5 steps after 2), printed as JSON."""
    import torch.distributed as dist

    from memprof.advisor import _measure

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        print(json.dumps(_measure(lambda: workload(model), default_plans()[plan], steps=5, warmup=2)))
    finally:
        dist.destroy_process_group()


def check(out: Path, verified: list[Path] | None = None) -> pd.DataFrame:
    """Per model and budget: the time errors of the plans that fit as measured, and the advisor's choice.

    ``verified``: the measurements (default ``advise-verified.json``, checked into
    ``advise-check.json``; ``advise-verified-day4.json`` into ``advise-check-day4.json``); with
    several (days), each plan's step time is their mean and its peak their largest, checked into
    ``advise-check-mean.json`` (two days) or ``advise-check-mean-N-days.json``."""
    predicted = json.loads((out / "advise-predicted.json").read_text())
    paths = verified or [out / "advise-verified.json"]
    measured = _merged([json.loads(p.read_text())["measured"] for p in paths])
    rows, errors = [], []
    for m in MODELS:
        if m not in measured or m not in predicted:
            continue
        table = pd.DataFrame(predicted[m]).set_index("plan")
        meas = pd.DataFrame(measured[m]).set_index("plan").dropna(subset=["measured_seconds"])
        for b in BUDGETS_GIB:
            fits = meas[meas["measured_peak_reserved"] <= b * 2**30]
            if fits.empty:
                continue
            err = table.loc[fits.index, "seconds"] / fits["measured_seconds"] - 1
            share = table["device_share"] if "device_share" in table else pd.Series(float("nan"), index=table.index)
            errors += [{"model": m, "budget_GiB": b, "plan": p, "error": e, "device_share": share[p]} for p, e in err.items()]
            ranked = rerank(table, b * 2**30, MARGIN)
            recommended = next((p for p in ranked.index[ranked["fits"]]), None)
            fastest = fits["measured_seconds"].idxmin()
            # The advisor keeps a margin against its own error: the fastest plan that fits
            # with that margin when measured is the fastest it could have chosen.
            safe = fits[fits["measured_peak_reserved"] * (1 + MARGIN) <= b * 2**30]
            fastest_safe = safe["measured_seconds"].idxmin() if not safe.empty else None
            rows.append({
                "model": m, "budget_GiB": b, "plans_that_fit": len(fits),
                "median_abs_error": err.abs().median(), "worst_error": err[err.abs().idxmax()],
                "worst_plan": err.abs().idxmax(), "recommended": recommended,
                "recommended_fits": recommended in fits.index, "fastest_measured": fastest,
                "vs_fastest": (fits.at[recommended, "measured_seconds"] / fits.at[fastest, "measured_seconds"] - 1
                               if recommended in fits.index else float("nan")),
                "fastest_with_margin": fastest_safe,
                "vs_fastest_with_margin": (
                    fits.at[recommended, "measured_seconds"] / fits.at[fastest_safe, "measured_seconds"] - 1
                    if recommended in fits.index and fastest_safe else float("nan")),
            })
    summary = pd.DataFrame(rows)
    errs = pd.DataFrame(errors)
    every = errs.drop_duplicates(["model", "plan"])["error"]
    totals = {"plans": int(len(every)), "median_abs_error": float(every.abs().median()),
              "worst_abs_error": float(every.abs().max()), "within_15": int((every.abs() <= 0.15).sum()),
              "within_30": int((every.abs() <= 0.30).sum()),
              "choices_within_5_percent": int((summary["vs_fastest"] <= 0.05).sum()),
              "choices_within_5_percent_with_margin": int((summary["vs_fastest_with_margin"] <= 0.05).sum()),
              "cases": int(len(summary))}
    # The steps the advisor marks host-bound (memprof.advisor.HOST_BOUND) apart from the others.
    unique = errs.drop_duplicates(["model", "plan"])
    for bound, part in (("device_bound", unique[unique["device_share"] >= HOST_BOUND]),
                        ("host_bound", unique[unique["device_share"] < HOST_BOUND])):
        e = part["error"].abs()
        totals[bound] = {"plans": int(len(e)), "median_abs_error": float(e.median()) if len(e) else None,
                         "worst_abs_error": float(e.max()) if len(e) else None,
                         "within_15": int((e <= 0.15).sum()), "within_30": int((e <= 0.30).sum())}
    name = (f"advise-check-mean{'' if len(paths) == 2 else f'-{len(paths)}-days'}.json" if len(paths) > 1 else
            "advise-check" + paths[0].stem.removeprefix("advise-verified") + ".json")  # -day4: advise-check-day4.json
    (out / name).write_text(json.dumps(
        {"verified": [p.name for p in paths], "totals": totals, "cases": summary.to_dict(orient="records"),
         "errors": errors}, indent=1, default=float) + "\n")
    pd.set_option("display.width", 200)
    print(summary.to_string(float_format=lambda x: f"{x:.3f}"))
    print(totals)
    return summary


def _merged(days: list[dict]) -> dict:
    """Per model, the plans measured on every day: mean step time, largest peaks."""
    if len(days) == 1:
        return days[0]
    merged = {}
    for m in set.intersection(*(set(d) for d in days)):
        by_plan = [{r["plan"]: r for r in d[m] if r.get("measured_seconds") is not None} for d in days]
        merged[m] = [{"plan": p, "measured_seconds": sum(d[p]["measured_seconds"] for d in by_plan) / len(by_plan),
                      "measured_peak_reserved": max(d[p]["measured_peak_reserved"] for d in by_plan)}
                     for p in by_plan[0] if all(p in d for d in by_plan)]
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["predict", "verify", "check", "repeat", "fresh", "one"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--plans", nargs="+", default=[], help="for repeat and fresh: the plans to measure")
    ap.add_argument("--verified", nargs="+", type=Path, default=None,
                    help="for check: measurements of several days (their mean step time per plan)")
    a = ap.parse_args()
    if a.mode in ("repeat", "one") and (len(a.models) != 1 or not a.plans):
        ap.error(f"{a.mode} takes one model (--models gpt2) and the plans to measure (--plans bf16+accum4 ...)")
    if a.mode == "fresh" and not a.plans:
        ap.error("fresh takes the plans to measure (--plans accum4 ...)")
    a.out.mkdir(parents=True, exist_ok=True)
    {"predict": lambda: predict(a.out, a.models), "verify": lambda: verify_all(a.out, a.models),
     "check": lambda: check(a.out, a.verified), "repeat": lambda: repeat(a.out, a.models[0], a.plans),
     "fresh": lambda: fresh(a.out, a.models, a.plans), "one": lambda: one(a.models[0], a.plans[0])}[a.mode]()


if __name__ == "__main__":
    main()
