"""How long CUDA's factorizations and triangular solves take, and which dtypes they take.

    python3 benchmarks/linalg_time.py --out DIR        # on a GPU: DIR/linalg-time.json

For an n x n symmetric positive-definite matrix (n = 4096, 8192, 16384) in float32 and
float64: ``torch.linalg.cholesky`` (n^3 / 3 flops), ``torch.linalg.solve_triangular``
with n right-hand sides (n^3), ``torch.cholesky_solve`` with n right-hand sides
(2 n^3), each the median of 5 runs after 2, timed with CUDA events; the achieved
TFLOP/s next to the GPU's. Then each of them on a bfloat16 and a float16 matrix:
the error CUDA raises, if any (memprof's simulated GPU raises for 16-bit inputs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rows = []
    for dtype in (torch.float32, torch.float64):
        for n in (4096, 8192, 16384):
            x = torch.randn(n, n // 4, device="cuda", dtype=dtype)
            spd = x @ x.T + n * torch.eye(n, device="cuda", dtype=dtype)
            factor = torch.linalg.cholesky(spd)
            rhs = torch.randn(n, n, device="cuda", dtype=dtype)
            for op, fn, flops in (
                ("cholesky", lambda: torch.linalg.cholesky(spd), n**3 / 3),
                ("solve_triangular", lambda: torch.linalg.solve_triangular(factor, rhs, upper=False), n**3),
                ("cholesky_solve", lambda: torch.cholesky_solve(rhs, factor), 2 * n**3),
            ):
                seconds = timed(fn)
                rows.append({"op": op, "n": n, "dtype": str(dtype).removeprefix("torch."), "seconds": seconds,
                             "tflops": flops / seconds / 1e12})
                print(rows[-1], flush=True)
            del x, spd, factor, rhs
            torch.cuda.empty_cache()
    half = []
    for dtype in (torch.bfloat16, torch.float16):
        m = torch.eye(64, device="cuda", dtype=dtype)
        for op, fn in (("cholesky", lambda: torch.linalg.cholesky(m)),
                       ("solve_triangular", lambda: torch.linalg.solve_triangular(m, m, upper=False)),
                       ("cholesky_solve", lambda: torch.cholesky_solve(m, m))):
            try:
                fn()
                torch.cuda.synchronize()
                error = None
            except RuntimeError as exc:
                error = str(exc).splitlines()[0]
            half.append({"op": op, "dtype": str(dtype).removeprefix("torch."), "error": error})
            print(half[-1], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "linalg-time.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "timings": rows, "16-bit": half}, indent=1) + "\n")


if __name__ == "__main__":
    main()
