"""How fast cuBLAS multiplies matrices whose rows are not 16-byte aligned, by how they are aligned.

    python3 benchmarks/matmul_alignment.py --out DIR        # on a GPU: DIR/matmul-alignment.json

Tensor cores read rows in 16-byte pieces; a product with a dimension that is
not a multiple of 16 bytes runs on kernels that read narrower pieces (NVIDIA's
Matrix Multiplication Background guide, "Requirements to use Tensor Cores";
cuBLASLt picks its kernels by the operands' alignment). A vocabulary of 50257
(odd) and one of 30522 (even, not a multiple of 8) are the common cases. For
each precision (bf16, fp16, fp32 with TF32 allowed, fp32), three sizes, the
three layouts of a linear layer's products (forward ``x @ W.T``, the input's
gradient ``g @ W``, the weight's ``g.T @ x``), and each of M, K, N made
1, 2, 4 elements off a multiple of 8: the median of 5 products after 2,
timed with CUDA events, and the achieved rate as a share of the precision's
tensor-core rate (TF32: half the 16-bit one) and of the 16-bit rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from common import timed

#: (M, K, N) of an aligned product: a language model's head, a transformer's MLP, a square one.
SIZES = ((16384, 768, 30720), (8192, 4096, 11008), (4096, 4096, 4096))
PRECISIONS = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False), "tf32": (torch.float32, True),
              "fp32": (torch.float32, False)}


def product(layout: str, m: int, k: int, n: int, dtype: torch.dtype):
    """The product of an (m, k) and a (k, n) operand laid out as a linear layer's products lay them out."""
    if layout == "forward":  # x (m, k) @ W.T, W (n, k)
        a, b = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype).t()
    elif layout == "input_grad":  # g (m, k) @ W, W (k, n)
        a, b = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype)
    else:  # weight_grad: g.T @ x, g (k, m), x (k, n)
        a, b = torch.randn(k, m, device="cuda", dtype=dtype).t(), torch.randn(k, n, device="cuda", dtype=dtype)
    return lambda: torch.mm(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("matmul_alignment.py runs on a CUDA GPU")
    from memprof.devices import detect_gpu

    gpu = detect_gpu(0)
    half_rate = (gpu.bf16_tflops or gpu.fp16_tflops) * 1e12
    rows = []
    for name, (dtype, tf32) in PRECISIONS.items():
        torch.backends.cuda.matmul.allow_tf32 = tf32
        rate = {"tf32": gpu.tf32_tflops or gpu.bf16_tflops / 2, "fp32": gpu.fp32_tflops}.get(name, gpu.bf16_tflops)
        for size in SIZES:
            for layout in ("forward", "input_grad", "weight_grad"):
                for dim in (None, 0, 1, 2):
                    for off in ((0,) if dim is None else (1, 2, 4)):
                        mkn = [x - off if i == dim else x for i, x in enumerate(size)]
                        seconds = timed(product(layout, *mkn, dtype))
                        flops = 2 * math.prod(mkn)
                        align = math.gcd(8, *mkn)  # in elements
                        rows.append({"precision": name, "layout": layout, "m": mkn[0], "k": mkn[1], "n": mkn[2],
                                     "off_dim": "mkn"[dim] if dim is not None else None, "align_elements": align,
                                     "align_bytes": align * torch.empty(0, dtype=dtype).element_size(),
                                     "seconds": seconds, "tflops": flops / seconds / 1e12,
                                     "share": flops / seconds / (rate * 1e12), "share_of_16bit": flops / seconds / half_rate})
                        print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cublas": torch.version.cuda,
            "command": "python3 " + " ".join(sys.argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "matmul-alignment.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=0) + "\n")


if __name__ == "__main__":
    main()
