"""Check memprof.caching's allocator model against the real CUDA caching allocator.

    python benchmarks/caching_check.py [--events N] [--seed S] [--fraction F] [--expandable]

Meant for a GPU machine, run as a fresh process with ``PYTORCH_CUDA_ALLOC_CONF``
(and ``PYTORCH_ALLOC_CONF``) unset: the script sets the configuration it checks
(``--expandable``: ``expandable_segments:True``, otherwise the default). Each scenario replays a random sequence of
``torch.empty(n, dtype=torch.uint8, device="cuda")`` allocations, frees (``del``),
``torch.cuda.empty_cache()`` and ``torch.cuda.reset_peak_memory_stats()`` on the
device and on :class:`memprof.caching.CachingAllocatorModel`, and compares
``memory_allocated``, ``memory_reserved``, their peaks and the number of
segments after every event. The first mismatch of a scenario is printed with
the events before it and both segment layouts; the exit status is 1 if any
scenario mismatched.

Scenarios:

* ``mixed``: sizes over the small pool, the 1-10 MiB range packed into 20 MiB
  segments and large own-segment requests;
* ``shapes``: a few repeated tensor-like sizes (equal-size free blocks, where
  the device's address order decides ties);
* ``capacity``: ``mixed`` under ``torch.cuda.set_per_process_memory_fraction(F)``,
  modelled as ``capacity = int(F * total)``: compares where
  ``torch.cuda.OutOfMemoryError`` and ``SimulatedOOM`` happen. Runs last, as the
  fraction stays set for the process. With ``--expandable`` the model's capacity is
  the device's physical memory (a page maps or not), so the device is filled
  instead: all but about 2 GiB of its free memory taken outside PyTorch
  (``cuMemAlloc``), and the capacity is what ``cudaMemGetInfo`` then calls free.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from memprof.caching import CachingAllocatorModel, SimulatedOOM  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20


def mixed_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.03:
        return 0
    if r < 0.50:
        return rng.randint(1, MiB)
    if r < 0.80:
        return rng.randint(MiB + 1, 10 * MiB)
    return rng.randint(10 * MiB, 96 * MiB)


_SHAPES = [4 * 768 * n for n in (1, 3, 4, 768, 1024, 3072, 2304, 16 * 1024, 16 * 1024 * 4, 50257)] + [
    2 * 16 * 1024 * 768,
    4 * 16 * 12 * 1024 * 1024 // 8,
]


def shape_size(rng: random.Random) -> int:
    return rng.choice(_SHAPES)


def device_counters() -> tuple[int, int, int, int, int]:
    s = torch.cuda.memory_stats()
    return (
        s.get("allocated_bytes.all.current", 0),
        s.get("reserved_bytes.all.current", 0),
        s.get("allocated_bytes.all.peak", 0),
        s.get("reserved_bytes.all.peak", 0),
        s.get("segment.all.current", 0),
    )


def model_counters(m: CachingAllocatorModel) -> tuple[int, int, int, int, int]:
    return (m.allocated, m.reserved, m.peak_allocated, m.peak_reserved, m.num_segments)


def device_layout() -> list[tuple[str, int, tuple]]:
    out = []
    for s in torch.cuda.memory_snapshot():
        blocks = tuple((b["size"], "a" if b["state"] == "active_allocated" else "i") for b in s["blocks"])
        out.append((s["segment_type"], s["total_size"], blocks, s["address"]))
    return [x[:3] for x in sorted(out, key=lambda x: x[3])]


def model_layout(m: CachingAllocatorModel) -> list[tuple[str, int, tuple]]:
    return [
        (s["segment_type"], s["total_size"], tuple((b["size"], b["state"][0]) for b in s["blocks"]))
        for s in m.snapshot()
    ]


def fresh_start() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    if alloc or reserved:
        sys.exit(
            f"the caching allocator is not empty (allocated {alloc}, reserved {reserved}): "
            "run this script as a fresh process"
        )


def run(name: str, sizes, events: int, seed: int, capacity: int | None = None, max_live: int = 300,
        expandable: bool = False) -> bool:
    fresh_start()
    rng = random.Random(seed)
    model = CachingAllocatorModel(capacity=capacity, expandable_segments=expandable)
    tensors: dict[int, torch.Tensor] = {}
    handles: list[int] = []  # model handles of live allocations
    history: deque[str] = deque(maxlen=12)
    ooms = 0
    ok = True
    for i in range(events):
        r = rng.random()
        if r < 0.003:
            what = "empty_cache()"
            torch.cuda.empty_cache()
            model.empty_cache()
        elif r < 0.006:
            what = "reset_peak_memory_stats()"
            torch.cuda.reset_peak_memory_stats()
            model.reset_peak()
        elif handles and (len(handles) >= max_live or r < 0.45):
            h = handles.pop(rng.randrange(len(handles)))
            what = f"free #{h} ({tensors[h].numel()} bytes)"
            del tensors[h]
            model.free(h)
        else:
            n = sizes(rng)
            what = f"malloc {n} bytes"
            real_oom = model_oom = False
            try:
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                real_oom = True
            try:
                h = model.malloc(n)
            except SimulatedOOM:
                model_oom = True
            if real_oom != model_oom:
                history.append(what)
                print(f"[{name}] MISMATCH at event {i}: {what}: device OOM {real_oom}, model OOM {model_oom}")
                ok = False
                break
            if real_oom:
                what += " -> OOM"
                ooms += 1
            else:
                tensors[h] = t
                del t  # the dict holds the only reference: `del tensors[h]` frees it
                handles.append(h)
                what += f" -> #{h}"
        history.append(what)
        real, mod = device_counters(), model_counters(model)
        if real != mod:
            names = ("allocated", "reserved", "peak_allocated", "peak_reserved", "segments")
            print(f"[{name}] MISMATCH after event {i}: {what}")
            for k, a, b in zip(names, real, mod):
                print(f"    {k:15s} device {a:>14d}  model {b:>14d}{'  <--' if a != b else ''}")
            ok = False
            break
    if not ok:
        print(f"[{name}] last events:")
        for line in history:
            print(f"    {line}")
        dev, mod = device_layout(), model_layout(model)
        print(f"[{name}] segments (type, size, blocks as (size, a=allocated/i=inactive)), by address:")
        for label, lay in (("device", dev), ("model", mod)):
            print(f"  {label}:")
            for seg in lay:
                print(f"    {seg[0]:5s} {seg[1]:>12d} {list(seg[2])}")
    else:
        same = sorted(device_layout()) == sorted(model_layout(model))
        print(
            f"[{name}] OK: {events} events, peak reserved {model.peak_reserved / MiB:.1f} MiB"
            f" (since last reset), {model.num_device_alloc} segments allocated, {ooms} OOMs;"
            f" final segment layouts {'match' if same else 'DIFFER (as multisets)'}"
        )
        ok = same
    del tensors
    return ok


def fill_device(leave: int) -> int:
    """Take all but about ``leave`` bytes of the device's free memory outside PyTorch (the driver's
    ``cuMemAlloc``, held until the process ends); returns what is then free."""
    import ctypes

    torch.empty(1, device="cuda")  # the primary context, current on this thread
    torch.cuda.empty_cache()
    cuda = ctypes.CDLL("libcuda.so.1")
    free = torch.cuda.mem_get_info()[0]
    ptr = ctypes.c_uint64()
    size = (free - leave) // (2 * MiB) * 2 * MiB
    if cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)) != 0:
        sys.exit(f"cuMemAlloc of {size} bytes failed")
    return torch.cuda.mem_get_info()[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fraction", type=float, default=None,
                   help="memory fraction of the capacity scenario (default: about 2 GiB of the device)")
    p.add_argument("--expandable", action="store_true", help="check expandable_segments:True")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
        if os.environ.get(var):
            sys.exit(f"{var} is set ({os.environ[var]!r}): the script sets the configuration it checks")
    if args.expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # read at CUDA's initialisation
    torch.cuda.init()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{'expandable_segments:True' if args.expandable else 'default configuration'}")
    ex = args.expandable
    ok = run("mixed", mixed_size, args.events, args.seed, expandable=ex)
    ok &= run("shapes", shape_size, args.events, args.seed + 1, expandable=ex)
    if ex:
        ok &= run("physical capacity", mixed_size, args.events, args.seed + 2, capacity=fill_device(2048 * MiB),
                  expandable=True)
        return 0 if ok else 1
    total = torch.cuda.mem_get_info()[1]
    fraction = args.fraction if args.fraction is not None else min(1.0, 2 * 1024 * MiB / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    # DeviceCachingAllocator::setMemoryFraction: fraction * cudaMemGetInfo's total, truncated.
    capacity = int(fraction * total)
    ok &= run(f"capacity {capacity / MiB:.0f} MiB", mixed_size, args.events, args.seed + 2, capacity=capacity)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
