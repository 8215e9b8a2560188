"""What autocast's weight cache keeps through a forward under FSDP2, with and without CPU offload.

    torchrun --nproc-per-node 1 benchmarks/fsdp_cast_cache.py [--out benchmarks/results]

Autocast caches the low-precision copy of every float32 leaf parameter it casts
until the autocast region ends, so after a forward the cache holds one bf16
copy of every weight the forward used. FSDP2 gathers each block's parameters
for its forward and frees them after; whether the cached bf16 copies stay is
what this measures: bytes allocated after the forward, less before, for
8 Linear(4096, 4096) blocks (32 MiB of bf16 weights each), on one rank, with
the cache on and off, with and without ``CPUOffloadPolicy``, and without FSDP;
plain and with each block checkpointed (then the blocks save nothing, and
what stays is the cache). Also what a block's weight is during its forward
(autocast caches only float32 leaves that require grad and are not views).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

MiB = 2**20


def forward_keeps(fsdp: bool, offload: bool, cache: bool, ckpt: bool) -> tuple[int, dict]:
    import functools

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).cuda()
    if ckpt:  # the blocks keep nothing for backward: what stays is autocast's cache
        for block in model:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    seen = {}

    def look(module, args):
        w = module.weight
        seen.update(leaf=w.is_leaf, view=w._is_view(), requires_grad=w.requires_grad, type=type(w).__name__)

    model[3].register_forward_pre_hook(look)
    if fsdp:
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        for block in model:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
    x = torch.randn(8, 4096, device="cuda")
    for _ in range(2):  # the second forward is measured: FSDP's buffers exist by then
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache):
            out = model(x).float().sum()
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - before
        out.backward()
        model.zero_grad(set_to_none=True)
    del model, out
    torch.cuda.empty_cache()
    return kept, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rows = []
    for ckpt in (False, True):
        for fsdp, offload in ((False, False), (True, False), (True, True)):
            for cache in (True, False):
                kept, seen = forward_keeps(fsdp, offload, cache, ckpt)
                rows.append({"checkpointed": ckpt, "fsdp": fsdp, "offload": offload, "cache": cache,
                             "kept_after_forward_MiB": kept / MiB, "weight_in_forward": seen})
                print(rows[-1], flush=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fsdp-cast-cache.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
