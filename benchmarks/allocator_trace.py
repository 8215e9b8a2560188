"""Where a script's peak reserved memory comes from: the allocator's events, on the GPU and simulated.

    python3 benchmarks/allocator_trace.py record OUT.pkl SCRIPT [ARGS...]      # on a GPU
    CUDA_VISIBLE_DEVICES= python3 benchmarks/allocator_trace.py simulate OUT.pkl SCRIPT [ARGS...]
    python3 benchmarks/allocator_trace.py compare NAME=REAL.pkl,SIMULATED.pkl ...

``record`` runs a corpus script unmodified from its folder with PyTorch's
allocator history on (``torch.cuda.memory._record_memory_history``) and keeps
each event (``alloc``, ``free_completed``, ``segment_alloc``, ...), its size,
stream and the script's own line that made it. ``simulate`` runs ``memprof
track --target h200`` on the same script and keeps the simulated allocator's
requests and new segments alike. ``compare`` replays each real trace through
:class:`memprof.caching.CachingAllocatorModel` (does the allocator model turn
the GPU's own requests into the GPU's reserved memory?) and prints the
segments each side made in turn, with the request that made them: where the
two lists part is where the simulated requests differ from the GPU's.
"""

from __future__ import annotations

import argparse
import os
import pickle
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MiB = 2**20
GiB = 2**30


def _line(folder: str, frames) -> str:
    """The script's own frame nearest the request ("?" for autograd's thread)."""
    for filename, line, name in frames:
        if filename.startswith(folder):
            return f"{os.path.basename(filename)}:{line}:{name}"
    return "?"


def _run_script(script: str, args: list[str]) -> None:
    os.chdir(os.path.dirname(script))
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        pass


def record(out: str, script: str, args: list[str]) -> None:
    import torch

    script = os.path.abspath(script)
    torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
    _run_script(script, args)
    folder = os.path.dirname(script)
    events = [(e["action"], e["addr"], e["size"], e["stream"],
               _line(folder, ((f["filename"], f["line"], f["name"]) for f in e.get("frames", []))))
              for e in torch.cuda.memory._snapshot()["device_traces"][0]]
    stats = torch.cuda.memory_stats()
    with open(out, "wb") as f:
        pickle.dump({"events": events, "peak_reserved": stats["reserved_bytes.all.peak"],
                     "peak_allocated": stats["allocated_bytes.all.peak"]}, f)


def simulate(out: str, script: str, args: list[str]) -> None:
    from memprof import caching, cli

    script = os.path.abspath(script)
    folder = os.path.dirname(script)
    events: list[tuple] = []
    model = caching.CachingAllocatorModel
    malloc, free = model.malloc, model.free

    def where() -> str:
        frame, frames = sys._getframe(2), []
        while frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        return _line(folder, frames)

    def traced_malloc(self, nbytes: int, stream: int = 0) -> int:
        before = self.reserved
        handle = malloc(self, nbytes, stream)
        if self.reserved != before:
            events.append(("segment_alloc", 0, self.reserved - before, stream, where()))
        events.append(("alloc", handle, nbytes, stream, where()))
        return handle

    def traced_free(self, handle: int) -> None:
        events.append(("free_completed", handle, 0, 0, ""))
        free(self, handle)

    model.malloc, model.free = traced_malloc, traced_free
    os.chdir(folder)
    try:
        cli.main(["track", script, "--target", "h200", "--json", out + ".json", "--", *args])
    except SystemExit:
        pass
    finally:
        model.malloc, model.free = malloc, free
    with open(out, "wb") as f:
        pickle.dump({"events": events}, f)


def replay(events: list[tuple]) -> tuple[int, int]:
    """The real requests through the allocator model: its peak reserved and allocated."""
    from memprof.caching import CachingAllocatorModel

    model, handles = CachingAllocatorModel(), {}
    for action, addr, size, stream, _ in events:
        if action == "alloc":
            handles[addr] = model.malloc(size, stream)
        elif action == "free_completed" and addr in handles:
            model.free(handles.pop(addr))
        elif action == "segment_free":  # the script's empty_cache (or an out-of-memory retry)
            model.empty_cache()
    return model.peak_reserved, model.peak_allocated


def _segments(events: list[tuple]) -> list[tuple[int, int, str]]:
    """Each new segment with the request that made it (the next ``alloc``)."""
    out = []
    for i, e in enumerate(events):
        if e[0] == "segment_alloc":
            request = next((x for x in events[i + 1:i + 6] if x[0] == "alloc"), None)
            out.append((e[2], request[2] if request else 0, request[4] if request else e[4]))
    return out


def compare(pairs: list[str]) -> None:
    for pair in pairs:
        name, files = pair.split("=", 1)
        real_file, sim_file = files.split(",")
        real = pickle.load(open(real_file, "rb"))
        sim = pickle.load(open(sim_file, "rb"))
        replayed, _ = replay(real["events"])
        sim_reserved = sum(e[2] for e in sim["events"] if e[0] == "segment_alloc")
        print(f"## {name}: GPU peak reserved {real['peak_reserved'] / GiB:.3f} GiB, its requests replayed "
              f"through the allocator model {replayed / GiB:.3f} GiB, simulated {sim_reserved / GiB:.3f} GiB")
        a, b = _segments(real["events"]), _segments(sim["events"])
        for i in range(max(len(a), len(b))):
            left = f"{a[i][0] / MiB:8.1f} {a[i][1] / MiB:9.2f} {a[i][2][:36]:36s}" if i < len(a) else " " * 56
            right = f"{b[i][0] / MiB:8.1f} {b[i][1] / MiB:9.2f} {b[i][2][:36]}" if i < len(b) else ""
            print(f"{i:3d} {left} | {right}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("record", "simulate"):
        p = sub.add_parser(cmd)
        p.add_argument("out")
        p.add_argument("script")
        p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("compare")
    p.add_argument("pairs", nargs="+", help="NAME=REAL.pkl,SIMULATED.pkl")
    args = parser.parse_args()
    if args.cmd == "compare":
        compare(args.pairs)
    else:
        (record if args.cmd == "record" else simulate)(args.out, args.script, args.args)


if __name__ == "__main__":
    main()
