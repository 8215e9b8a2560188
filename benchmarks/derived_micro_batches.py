"""Micro-batches derived from the first one's events against running every one, on the suite's models.

    python benchmarks/derived_micro_batches.py [--out DIR] [--models gpt2 bert ...]

Every default plan for two ranks (precision x checkpointing x 1/2/4/8
micro-batches, offload, ZeRO) of each model, simulated on the H200 twice in
one process: as the advisor does (``memprof.advisor._Repeats``: an
accumulation step's later micro-batches replayed from events derived from
its first) and with every micro-batch run. Writes
``derived-micro-batches.json``: per model, the plans whose peak allocated,
peak reserved, seconds or busy seconds differ (none is the claim) and both
wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from suite import MODELS, workload  # noqa: E402

import memprof.advisor as advisor  # noqa: E402
from memprof.devices import get_gpu  # noqa: E402


def check(model: str, gpu) -> dict:
    plans = lambda: {n: f() for n, f in advisor.default_plans(2, gpu=gpu).items()}  # noqa: E731
    t = time.perf_counter()
    _, derived = advisor.simulate_plans(lambda: workload(model), plans(), gpu, jobs=1)
    seconds_derived = time.perf_counter() - t
    repeats = advisor._Repeats.__call__
    advisor._Repeats.__call__ = lambda self, i, n: 0  # every micro-batch runs
    try:
        t = time.perf_counter()
        _, full = advisor.simulate_plans(lambda: workload(model), plans(), gpu, jobs=1)
        seconds_full = time.perf_counter() - t
    finally:
        advisor._Repeats.__call__ = repeats
    fields = ("peak_allocated", "peak_reserved", "seconds", "device_seconds")
    ran = [n for n, p in full.items() if not isinstance(p, Exception)]
    differ = [n for n in ran if tuple(getattr(derived[n], f) for f in fields) != tuple(getattr(full[n], f) for f in fields)]
    row = {"model": model, "plans": len(ran), "differ": differ, "seconds_derived": round(seconds_derived, 2),
           "seconds_every_micro_batch": round(seconds_full, 2)}
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--models", nargs="+", default=[*MODELS, "bert"], choices=[*MODELS, "bert"])
    a = ap.parse_args()
    gpu = get_gpu("H200-141GB")
    rows = [check(m, gpu) for m in a.models]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "derived-micro-batches.json").write_text(json.dumps(
        {"meta": {"torch": torch.__version__, "command": "python " + " ".join(sys.argv)}, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
