"""Predicted vs measured peak memory over the accuracy suite (benchmarks/suite.py).

    python benchmarks/accuracy.py measure [--out DIR] [--only MODEL/VARIANT ...]

``measure`` runs each workload for real on the GPU: 3 steps, then the 4th
step's peak allocated and reserved (reset before it) and its time; results go
to ``measured.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["measure"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    todo = [(m, v) for m in MODELS for v in VARIANTS if not a.only or f"{m}/{v}" in a.only]
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
