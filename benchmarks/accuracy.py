"""Predicted vs measured peak memory over the accuracy suite (benchmarks/suite.py).

    python benchmarks/accuracy.py measure  [--out DIR] [--only MODEL/VARIANT ...]
    python benchmarks/accuracy.py simulate [--out DIR] [--target H200-141GB] [--measured FILE] [--only ...]

``measure`` runs each workload for real on the GPU: 3 steps, then the 4th
step's peak allocated and reserved (reset before it) and its time; results go
to ``measured.json``. ``simulate`` predicts the same steps with
``memprof.simulate`` (3 steps, the last one's peaks), on whatever machine it
runs, and compares with ``--measured``: ``simulated-<host>.json`` and a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import MODELS, VARIANTS, build  # noqa: E402


def measure_one(model: str, variant: str) -> dict:
    net, opt, step = build(model, variant, "cuda")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    res = {
        "model": model,
        "variant": variant,
        "params": sum(p.numel() for p in net.parameters()),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "step_seconds": seconds,
    }
    del net, opt, step
    gc.collect()
    torch.cuda.empty_cache()
    return res


def simulate_one(model: str, variant: str, target: str) -> dict:
    from memprof.simulate import simulate

    t = time.perf_counter()
    r = simulate(lambda: build(model, variant, "cuda"), target=target, steps=3)
    last = r.steps.iloc[-1]
    return {
        "model": model,
        "variant": variant,
        "peak_allocated": int(last["peak_allocated"]),
        "peak_reserved": int(last["peak_reserved"]),
        "seconds": time.perf_counter() - t,
        "peak_phase": r.peak.phase,
    }


def compare(sim: list[dict], measured_path: Path) -> list[dict]:
    measured = {(r["model"], r["variant"]): r for r in json.loads(measured_path.read_text())["runs"]}
    rows = []
    for s in sim:
        m = measured.get((s["model"], s["variant"]))
        if not m or "error" in m or "error" in s:
            continue
        rows.append(
            {
                **s,
                "measured_allocated": m["peak_allocated"],
                "measured_reserved": m["peak_reserved"],
                "error_allocated": s["peak_allocated"] / m["peak_allocated"] - 1,
                "error_reserved": s["peak_reserved"] / m["peak_reserved"] - 1,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    GiB = 2**30
    lines = [
        "| model | variant | measured alloc GiB | simulated | error | measured reserved GiB | simulated | error | sim s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['measured_allocated'] / GiB:.2f} | {r['peak_allocated'] / GiB:.2f} | "
            f"{100 * r['error_allocated']:+.1f} % | {r['measured_reserved'] / GiB:.2f} | {r['peak_reserved'] / GiB:.2f} | "
            f"{100 * r['error_reserved']:+.1f} % | {r['seconds']:.1f} |"
        )
    ea = sorted(abs(r["error_allocated"]) for r in rows)
    er = sorted(abs(r["error_reserved"]) for r in rows)
    if ea:
        lines.append("")
        lines.append(
            f"peak allocated: median |error| {100 * statistics.median(ea):.1f} %, worst {100 * ea[-1]:.1f} %; "
            f"peak reserved: median |error| {100 * statistics.median(er):.1f} %, worst {100 * er[-1]:.1f} % ({len(rows)} workloads)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["measure", "simulate"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--target", default="H200-141GB")
    ap.add_argument("--measured", type=Path, default=Path("benchmarks/results/accuracy-measured.json"))
    a = ap.parse_args()
    todo = [(m, v) for m in MODELS for v in VARIANTS if not a.only or f"{m}/{v}" in a.only]
    if a.mode == "simulate":
        host = "cuda" if torch.cuda.is_available() else "cpu"
        sim = []
        for m, v in todo:
            try:
                r = simulate_one(m, v, a.target)
            except Exception as exc:  # keep going: one failure should not hide the others
                r = {"model": m, "variant": v, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            sim.append(r)
            print(json.dumps(r), flush=True)
        rows = compare(sim, a.measured)
        meta = {"host": host, "torch": torch.__version__, "target": a.target, "command": " ".join(sys.argv)}
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"accuracy-simulated-{host}.json").write_text(json.dumps({"meta": meta, "runs": sim, "compared": rows}, indent=1))
        text = table(rows)
        (a.out / f"accuracy-simulated-{host}.md").write_text(text + "\n")
        print(text)
        return
    out = []
    for m, v in todo:
        try:
            r = measure_one(m, v)
        except torch.OutOfMemoryError as exc:
            r = {"model": m, "variant": v, "error": f"OOM: {str(exc)[:200]}"}
            gc.collect()
            torch.cuda.empty_cache()
        out.append(r)
        print(json.dumps(r), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    (a.out / "measured.json").write_text(json.dumps({"meta": meta, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
