"""The blocks CUDA's softmax and layer norm kernels take for their run, measured and simulated
side by side.

    python benchmarks/kernel_copies.py [--out FILE]     # on a GPU: measured, and simulated for the H200

Each case runs one softmax or layer norm operator on 4 MiB fp32 tensors (8 x 128 x 1024) and
reports how far the peak allocated rose above what was allocated before it: on
the GPU (torch.cuda.max_memory_allocated) and on the simulated H200
(memprof.kernel_copies). Without a GPU only the simulated column is filled.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from memprof.devices import get_gpu
from memprof.simulate import SimulatedAllocator
from memprof.virtual_cuda import VirtualCUDA

MiB = 2**20


def cases(device: str):
    ops = torch.ops.aten
    logits = torch.randn(8, 129, 1024, device=device)
    shifted = logits[:, :-1]  # 4 MiB, not contiguous
    y = shifted.contiguous().softmax(-1)
    g = torch.ones_like(y)
    features = torch.randn(8, 1024, 128, device=device).transpose(1, 2)  # wav2vec 2.0's: channels last by a view
    normed, mean, rstd = ops.native_layer_norm(features, [1024], None, None, 1e-5)
    return {
        "log_softmax of a non-contiguous input": lambda: shifted.log_softmax(-1),
        "log_softmax of a contiguous input": lambda: y.log_softmax(-1),
        "softmax backward": lambda: ops._softmax_backward_data(g, y, -1, torch.float32),
        "log_softmax backward": lambda: ops._log_softmax_backward_data(g, y, -1, torch.float32),
        "log_softmax backward, both transposed": lambda: ops._log_softmax_backward_data(g.mT, y.mT, -2, torch.float32),
        "layer_norm of a non-contiguous input": lambda: ops.native_layer_norm(features, [1024], None, None, 1e-5),
        "layer_norm of a contiguous input": lambda: ops.native_layer_norm(normed, [1024], None, None, 1e-5),
        "layer_norm backward, input not contiguous": lambda: ops.native_layer_norm_backward(
            g, features, [1024], mean, rstd, None, None, [True, False, False]),
        "layer_norm backward, input contiguous": lambda: ops.native_layer_norm_backward(
            g, normed, [1024], mean, rstd, None, None, [True, False, False]),
    }


def rises(device: str, read) -> dict[str, float]:
    out = {}
    for name, op in cases(device).items():
        before = read(False)
        op()
        out[name] = (read(True) - before) / MiB
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows: dict[str, dict] = {}
    if torch.cuda.is_available():
        def read(peak: bool) -> int:
            if peak:
                return torch.cuda.max_memory_allocated()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()

        for name, mib in rises("cuda", read).items():
            rows.setdefault(name, {})["measured_mib"] = mib
    alloc = SimulatedAllocator(get_gpu("H200-141GB"))

    def simulated(peak: bool) -> int:
        if peak:
            return alloc.read().peak_allocated
        alloc.reset_peak()
        return alloc.read().allocated

    with VirtualCUDA("H200-141GB", allocator=alloc):
        for name, mib in rises("cuda", simulated).items():
            rows.setdefault(name, {})["simulated_mib"] = mib
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for name, row in rows.items():
        print(f"{name:42s} " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
