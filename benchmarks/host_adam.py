"""The host's AdamW step under FSDP2's CPU offload, by tensor size, on the GPU's host.

    python3 benchmarks/host_adam.py --out DIR      # on the GPU machine

State offload (``memprof.strategies.StateOffload``: FSDP2 ``fully_shard``
with ``CPUOffloadPolicy`` on a one-rank process group) steps AdamW on the
host over the sharded parameters: DTensors whose local tensors live in host
memory. ``torch.optim.AdamW`` picks neither foreach nor fused for them (CPU
tensors, torch.optim.optimizer._default_to_fused_or_foreach), so each
parameter runs its own operators, each dispatched through DTensor's Python
subclass. For square bias-free linear layers of widths 128 to 8192, as many
as make about 64 M parameters (at least 8, at most 256 layers), this times
``optimizer.step()`` alone (median of 5 after 2; the gradients of one
backward kept): the seconds per tensor and per element of each size, from
which the time model's host AdamW constants are fitted
(``memprof.strategies.zero``). Writes ``host-adam.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

WIDTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
TOTAL = 64 * 2**20


def one(width: int) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    layers = min(max(TOTAL // width**2, 8), 256)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))).cuda()
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device="cuda")).float().square().mean().backward()
    torch.cuda.synchronize()
    times = []
    for i in range(7):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times[2:])
    del model, opt
    torch.cuda.empty_cache()
    return {"width": width, "tensors": layers, "elements": layers * width**2, "seconds": seconds,
            "seconds_per_tensor": seconds / layers, "seconds_per_element": seconds / (layers * width**2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29535", rank=0, world_size=1)
    rows = []
    for w in WIDTHS:
        rows.append(one(w))
        print(rows[-1], flush=True)
    dist.destroy_process_group()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "command": "python3 " + " ".join(sys.argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "host-adam.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
