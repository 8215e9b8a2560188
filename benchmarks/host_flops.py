"""How fast the host multiplies matrices, for an optimizer stepped on the host (state offload).

    python3 benchmarks/host_flops.py --out DIR            # on the machine whose host is priced: host-flops.json

With state offload (FSDP2's ``CPUOffloadPolicy``) the optimizer steps on the
host. AdamW's step is elementwise: its time is the bytes it reads and writes
(strategies/zero.py). An optimizer that multiplies matrices (Muon's
Newton-Schulz iterations, in bf16; Shampoo's and SOAP's preconditioners) is
bound by the host's matrix products instead. This measures them on the
shapes such a step multiplies (a GPT-2-sized block's weights, ``X @ X.mT``
and ``B @ X``), in fp32 and bf16, with one thread (torchrun's default per
rank) and with every thread, as TFLOP/s (median of 5 after 2); and
``torch.optim.Muon``'s whole step over a GPT-2-sized set of weight matrices,
next to its matrix products' count (``torch.utils.flop_counter``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

# A GPT-2 124M block's matrices (d = 768): attention's four, the MLP's two.
SHAPES = [(768, 768), (768, 3072), (3072, 768)]


def timed(fn, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rates(threads: int) -> dict:
    torch.set_num_threads(threads)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        rates = []
        for m, n in SHAPES:
            x = torch.randn(min(m, n), max(m, n), dtype=dtype)  # Newton-Schulz works on the wide side
            a = x @ x.mT
            flops = 2 * x.shape[0] * x.shape[0] * x.shape[1] * 2  # X X^T, then B X
            rates.append(flops / timed(lambda: (x @ x.mT, a @ x)))
        out[str(dtype).removeprefix("torch.")] = {"tflops_per_shape": [r / 1e12 for r in rates],
                                                 "tflops_median": statistics.median(rates) / 1e12}
    return out


def muon_step(threads: int, layers: int) -> dict:
    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(torch.randn(m, n)) for _ in range(layers) for m, n in SHAPES + [(768, 768)] * 3]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Muon(params, lr=0.02)
    opt.step()  # the momentum buffers, made once
    with FlopCounterMode(display=False) as counter:
        opt.step()
    seconds = timed(opt.step, repeats=3, warmup=1)
    flops = counter.get_total_flops()
    return {"parameters": sum(p.numel() for p in params), "flops": flops, "seconds": seconds,
            "tflops": flops / seconds / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=12)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    result = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cores": cores,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "matmul": {}, "muon": {}}
    try:
        result["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for threads in sorted({1, cores}):
        result["matmul"][threads] = matmul_rates(threads)
        if hasattr(torch.optim, "Muon"):
            result["muon"][threads] = muon_step(threads, a.layers)
        print(threads, json.dumps(result["matmul"][threads]), json.dumps(result["muon"].get(threads)), flush=True)
    (a.out / "host-flops.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
