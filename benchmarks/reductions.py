"""A CUDA reduction's staging memory: measured on the GPU, predicted by memprof.reductions.

    python3 benchmarks/reductions.py measure --out DIR     # on the GPU: reductions-measured.jsonl
    python3 benchmarks/reductions.py compare --out DIR     # anywhere: reductions-h200.json

65 reductions (sums over the rows of [rows, columns] tensors, means over the
height and width of images in both layouts, full sums and a norm past 32-bit
offsets, an amax), each timed alone: the peak of allocated memory while it
runs, over what was allocated before, less its output's bytes. ``compare``
predicts the same from the output's block rounding, the accumulation buffer
and the largest piece's staging buffer and semaphores (each block a multiple
of 512 bytes, as the caching allocator rounds them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

OPS = {
    "sum0": lambda t: t.sum(0), "mean_hw": lambda t: t.mean((-1, -2), keepdim=True), "sum_all": lambda t: t.sum(),
    "amax0": lambda t: t.amax(0), "norm_all": lambda t: torch.linalg.vector_norm(t),
}
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def cases() -> list[tuple[str, tuple, torch.dtype, str]]:
    out = [("sum0", (rows, cols), dt, "contiguous") for rows in (512, 4096, 25216, 65536, 200000)
           for cols in (64, 768, 3072, 50257) for dt in (torch.float32, torch.bfloat16)]
    out += [("mean_hw", shape, dt, fmt) for shape in ((128, 128, 32, 32), (64, 256, 14, 14), (32, 2048, 7, 7),
                                                      (256, 64, 56, 56), (8, 512, 64, 64))
            for dt in (torch.float16, torch.float32) for fmt in ("channels_last", "contiguous")]
    out += [("sum_all", (n,), torch.float32, "contiguous") for n in (1 << 20, 1 << 26, 3 * (1 << 28))]
    out += [("amax0", (8192, 4096), torch.bfloat16, "contiguous"), ("norm_all", (4096, 4096), torch.float32, "contiguous")]
    return out


def _input(shape, dtype, fmt, device) -> torch.Tensor:
    x = torch.randn(*shape, device=device, dtype=dtype) if device == "cuda" else torch.empty(*shape, dtype=dtype, device=device)
    return x.contiguous(memory_format=torch.channels_last) if fmt == "channels_last" else x


def measure(out: Path) -> None:
    with open(out / "reductions-measured.jsonl", "w") as f:
        for op, shape, dtype, fmt in cases():
            x = _input(shape, dtype, fmt, "cuda")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            y = OPS[op](x)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before - y.untyped_storage().nbytes()
            f.write(json.dumps({"op": op, "shape": shape, "dtype": str(dtype), "format": fmt, "staging": extra}) + "\n")
            del x, y


def compare(out: Path) -> None:
    from memprof.devices import get_gpu
    from memprof.reductions import staging_bytes

    aten = torch.ops.aten
    calls = {"sum0": lambda x: (aten.sum.dim_IntList, (x, [0])), "mean_hw": lambda x: (aten.mean.dim, (x, [-1, -2], True)),
             "sum_all": lambda x: (aten.sum.default, (x,)), "amax0": lambda x: (aten.amax.default, (x, [0])),
             "norm_all": lambda x: (aten.linalg_vector_norm.default, (x, 2))}
    gpu, rows = get_gpu("h200"), []

    def block(n: int) -> int:
        return -(-n // 512) * 512

    for line in (out / "reductions-measured.jsonl").read_text().splitlines():
        r = json.loads(line)
        func, args = calls[r["op"]](_input(r["shape"], DTYPES[r["dtype"]], r["format"], "meta"))
        y = func(*args)
        s = staging_bytes(func, args, y, gpu)
        n = y.untyped_storage().nbytes()
        predicted = (block(n) - n + (block(s.accumulation) if s.accumulation else 0)
                     + max((block(b) + block(m) for b, m in s.pieces), default=0))
        rows.append({**r, "predicted": predicted})
    same = sum(r["predicted"] == r["staging"] for r in rows)
    print(f"{same} of {len(rows)} predicted to the byte")
    (out / "reductions-h200.json").write_text(json.dumps(
        {"command": "python3 benchmarks/reductions.py measure/compare", "torch": torch.__version__,
         "same": same, "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["measure", "compare"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    (measure if args.mode == "measure" else compare)(args.out)


if __name__ == "__main__":
    sys.exit(main())
