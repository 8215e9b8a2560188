"""The caching allocator's reserved memory per stream, at each optimizer step of a training script.

    python3 benchmarks/stream_pools.py OUT.jsonl SCRIPT [ARGS...]                       # on a GPU
    memprof track benchmarks/stream_pools.py --target h200 -- OUT.jsonl SCRIPT [ARGS...]  # simulated

Runs SCRIPT unmodified (``runpy``) with a global optimizer step hook that
writes, after each step, one JSON line: the step, ``max_memory_reserved``,
``memory_reserved``, and the reserved bytes of the segments of each stream
(``torch.cuda.memory_snapshot()``'s ``stream``: 0 is the default stream), so
that a side stream's pool (a prefetcher's batches) can be compared between
the device and the simulation.
"""

from __future__ import annotations

import json
import runpy
import sys
from collections import defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def main() -> None:
    out, script, *args = sys.argv[1:]
    steps = [0]

    def hook(optimizer, *_):
        per_stream: dict[str, int] = defaultdict(int)
        for seg in torch.cuda.memory_snapshot():
            per_stream["default" if seg.get("stream", 0) == 0 else "side"] += seg["total_size"]
        with open(out, "a") as f:
            f.write(json.dumps({"step": steps[0], "max_reserved": torch.cuda.max_memory_reserved(),
                                "reserved": torch.cuda.memory_reserved(), **per_stream}) + "\n")
        steps[0] += 1

    handle = register_optimizer_step_post_hook(hook)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        handle.remove()


if __name__ == "__main__":
    main()
