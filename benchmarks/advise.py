"""The advisor end to end: predicted plans, then the recommended ones measured.

    python benchmarks/advise.py predict [--out DIR]   # any machine: simulate every plan for the H200
    python benchmarks/advise.py verify  [--out DIR]   # on the GPU: measure what predict recommended

For GPT-2 124M (16 x 1024), ViT-B/16 (batch 128) and the suite's Llama-style
0.55 B decoder (4 x 2048), fp32 + AdamW as given, with budgets of 12, 24 and
40 GiB. ``verify`` measures, for each model, the baseline and the three
fastest plans that fit each budget, and checks: measured peak reserved within
the budget; measured peak allocated within 5 % of the prediction; the
recommended plan's measured step time within 10 % of the fastest verified
plan that fits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from suite import workload  # noqa: E402

from memprof.advisor import Advice, advise, default_plans, rerank, verify  # noqa: E402
from memprof.devices import get_gpu  # noqa: E402

MODELS = ("gpt2", "vit_b_16", "llama")
BUDGETS_GIB = (12, 24, 40)
TOP = 3


def predict(out: Path) -> None:
    tables = {}
    for m in MODELS:
        t = time.perf_counter()
        a = advise(lambda: workload(m), 10**15, target="H200-141GB", progress=False)  # every plan, ranked later per budget
        tables[m] = a.table.reset_index().to_dict(orient="records")
        print(f"{m}: {len(a.table)} plans simulated in {time.perf_counter() - t:.1f} s", flush=True)
    (out / "advise-predicted.json").write_text(json.dumps(tables, indent=1, default=float))


def verify_all(out: Path) -> None:
    predicted = json.loads((out / "advise-predicted.json").read_text())
    gpu = get_gpu("H200-141GB")
    results = {}
    for m in MODELS:
        table = pd.DataFrame(predicted[m]).set_index("plan")
        chosen = ["baseline"]
        for b in BUDGETS_GIB:
            r = rerank(table, b * 2**30)
            chosen += [p for p in r.index[r["fits"]][:TOP] if p not in chosen]
        advice = Advice(10**15, gpu, 1, table, None, default_plans())
        measured = verify(lambda: workload(m), advice, plans=chosen, steps=3, warmup=2)
        print(m, "\n", measured.to_string(), flush=True)
        results[m] = measured.reset_index().to_dict(orient="records")
    checks = []
    for m in MODELS:
        meas = pd.DataFrame(results[m]).set_index("plan")
        table = pd.DataFrame(predicted[m]).set_index("plan")
        for b in BUDGETS_GIB:
            r = rerank(table, b * 2**30)
            fits = [p for p in r.index[r["fits"]][:TOP] if p in meas.index and "measured_peak_reserved" in meas and pd.notna(meas.at[p, "measured_peak_reserved"])]
            if not fits:
                checks.append({"model": m, "budget_GiB": b, "recommended": None})
                continue
            best = fits[0]
            ok_fit = [p for p in fits if meas.at[p, "measured_peak_reserved"] <= b * 2**30]
            fastest = min(meas.loc[ok_fit, "measured_seconds"]) if ok_fit else float("nan")
            checks.append({
                "model": m, "budget_GiB": b, "recommended": best,
                "measured_reserved_GiB": meas.at[best, "measured_peak_reserved"] / 2**30,
                "fits": bool(meas.at[best, "measured_peak_reserved"] <= b * 2**30),
                "allocated_error": float(meas.at[best, "measured_peak_allocated"] and
                                         meas.at[best, "predicted_peak_allocated"] / meas.at[best, "measured_peak_allocated"] - 1),
                "measured_ms": 1e3 * meas.at[best, "measured_seconds"],
                "vs_fastest_verified": meas.at[best, "measured_seconds"] / fastest - 1,
            })
    (out / "advise-verified.json").write_text(json.dumps({"measured": results, "checks": checks}, indent=1, default=float))
    print(pd.DataFrame(checks).to_string())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["predict", "verify"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    predict(a.out) if a.mode == "predict" else verify_all(a.out)


if __name__ == "__main__":
    main()
