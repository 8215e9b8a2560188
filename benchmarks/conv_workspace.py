"""The workspace cuDNN takes for each convolution a training script runs, measured on a GPU.

    python3 benchmarks/conv_workspace.py record --out DIR --jobs 4 NAME...   # on a GPU: corpus entries' convolutions
    python3 benchmarks/conv_workspace.py grid --out DIR                      # on a GPU: a grid of convolutions

With ``torch.backends.cudnn.benchmark`` off, PyTorch runs the first plan of
cuDNN's heuristics that builds and runs, and takes that plan's workspace from
its caching allocator for the call (aten/src/ATen/native/cudnn/Conv_v8.cpp,
``run_conv_plan``); the workspace is given back when the call returns. Only
cuDNN knows a plan's workspace, so this measures it: each convolution (and
its backward) runs with the allocator's history on, and every block taken and
given back within the call is the call's own. ``record`` runs corpus entries
unmodified under a dispatch mode that does this for every convolution they
call (one line per distinct call in ``DIR/record.jsonl``); ``grid`` does it for a
grid of shapes, dtypes and layouts (``DIR/grid.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
_ops = torch.ops.aten
CONVOLUTIONS = {_ops.convolution.default: "convolution", _ops.convolution_backward.default: "convolution_backward"}


def describe(x):
    """An argument as JSON: a tensor by its shape, strides, dtype and offset."""
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "stride": list(x.stride()), "dtype": str(x.dtype).removeprefix("torch."),
                "offset": x.storage_offset()}
    if isinstance(x, (list, tuple)):
        return [describe(v) for v in x]
    if isinstance(x, torch.SymInt):
        return int(x)
    return x


def measured_call(func, args, kwargs):
    """Run ``func`` with the allocator's history on: its output, the blocks it took and gave
    back (in order), the blocks it kept, and the most its own blocks held at once."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=10000, stacks="python", context=None, clear_history=True)
    try:
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    taken: dict[int, int] = {}
    transient, live, peak = [], 0, 0
    for e in snapshot["device_traces"][torch.cuda.current_device()]:
        if e["action"] == "alloc":
            taken[e["addr"]] = e["size"]
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_requested" and e["addr"] in taken:
            transient.append(taken.pop(e["addr"]))
            live -= transient[-1]
    return out, transient, list(taken.values()), peak


def record_line(func, args, out, transient, kept, peak) -> dict:
    return {"op": CONVOLUTIONS[func], "args": describe(list(args)), "out": describe(out),
            "workspace": transient, "kept": kept, "peak": peak,
            "benchmark": torch.backends.cudnn.benchmark, "allow_tf32": torch.backends.cudnn.allow_tf32,
            "deterministic": torch.backends.cudnn.deterministic, "cudnn": torch.backends.cudnn.version(),
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


class Recorder(TorchDispatchMode):
    """Measures every distinct convolution call once and writes it to ``path``."""

    def __init__(self, path: Path, seconds: float, calls: int):
        super().__init__()
        self.path, self.seconds, self.calls = path, seconds, calls
        self.seen: set[str] = set()
        self.count, self.first = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in CONVOLUTIONS or not args[1].is_cuda:
            return func(*args, **kwargs)
        self.first = self.first or time.perf_counter()
        self.count += 1
        key = json.dumps([CONVOLUTIONS[func], describe(list(args)), torch.backends.cudnn.benchmark])
        if key in self.seen:
            out = func(*args, **kwargs)
        else:
            self.seen.add(key)
            out, *measured = measured_call(func, args, kwargs)
            with self.path.open("a") as f:
                f.write(json.dumps(record_line(func, args, out, *measured)) + "\n")
        if self.count >= self.calls or time.perf_counter() - self.first > self.seconds:
            os._exit(0)  # enough seen: the script's own end does not matter here
        return out


def run_entry(name: str, out: Path, seconds: float, calls: int) -> None:
    """Run corpus entry ``name`` as its users do, under a :class:`Recorder`."""
    sys.path.insert(0, str(HERE))
    from corpus import CORPUS, SCRIPTS
    folder, script, argv, _ = CORPUS[name]
    os.chdir(SCRIPTS / folder)
    sys.path.insert(0, os.getcwd())
    sys.argv = [script, *argv]
    mode = Recorder(out / f"{name}.jsonl", seconds, calls)
    mode.__enter__()  # for the whole script, the engine's threads included
    runpy.run_path(script, run_name="__main__")


def record(args: argparse.Namespace) -> None:
    """Each entry in its own process; their lines gathered in ``DIR/record.jsonl``, each with its entry's name."""
    args.out.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> tuple[str, list[str]]:
        part = args.out / f"{name}.jsonl"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "_entry", name, "--out", str(args.out.resolve()),
               "--seconds", str(args.seconds), "--calls", str(args.calls)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        lines = part.read_text().splitlines() if part.exists() else []
        part.unlink(missing_ok=True)
        tail = "" if run.returncode == 0 else " " + (run.stdout + run.stderr)[-300:]
        return f"{name}: rc={run.returncode}, {len(lines)} distinct calls{tail}", lines

    with ThreadPoolExecutor(args.jobs) as pool, (args.out / "record.jsonl").open("w") as f:
        for (summary, lines), name in zip(pool.map(one, args.names), args.names):
            print(summary, flush=True)
            f.writelines(json.dumps({"entry": name, **json.loads(line)}) + "\n" for line in lines)


def grid_cases():
    """Shapes, dtypes and layouts around those training scripts use: (input, weight, conv params, dtype, layout)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for layout in ("contiguous", "channels_last"):
            for n, c, hw, k, kernel, stride, padding in (
                    (64, 3, 224, 64, 7, 2, 3), (64, 64, 56, 64, 3, 1, 1), (64, 64, 56, 256, 1, 1, 0),
                    (64, 256, 28, 128, 3, 2, 1), (256, 3, 64, 128, 4, 2, 1), (256, 128, 32, 256, 4, 2, 1),
                    (256, 256, 16, 512, 4, 2, 1), (32, 128, 64, 128, 3, 1, 1), (32, 512, 8, 512, 3, 1, 1),
                    (2048, 4, 84, 32, 8, 4, 0), (2048, 32, 20, 64, 4, 2, 0), (16, 64, 128, 64, 3, 1, 1)):
                yield (n, c, hw, hw), (k, c, kernel, kernel), (stride, padding, 1, False, 1), dtype, layout
            # transposed (a generator's upsampling): weight is (in, out, k, k)
            for n, c, hw, k in ((256, 512, 4, 256), (256, 256, 8, 128), (256, 128, 16, 64), (256, 64, 32, 3)):
                yield (n, c, hw, hw), (c, k, 4, 4), (2, 1, 1, True, 1), dtype, layout
            # depthwise and grouped
            yield (64, 256, 28, 28), (256, 1, 3, 3), (1, 1, 1, False, 256), dtype, layout
            yield (64, 256, 28, 28), (256, 8, 3, 3), (1, 1, 1, False, 32), dtype, layout
        # 1-d (audio) and 3-d (video), contiguous only
        yield (64, 80, 3000), (256, 80, 3), (1, 1, 1, False, 1), dtype, "contiguous"
        yield (32, 256, 1500), (256, 256, 5), (2, 2, 1, False, 1), dtype, "contiguous"
        yield (8, 3, 16, 112, 112), (64, 3, 3, 7, 7), (1, 1, 1, False, 1), dtype, "contiguous"
        yield (8, 64, 8, 56, 56), (64, 64, 3, 3, 3), (1, 1, 1, False, 1), dtype, "contiguous"


def grid(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "grid.jsonl"
    path.unlink(missing_ok=True)
    for shape, wshape, (stride, padding, dilation, transposed, groups), dtype, layout in grid_cases():
        d = len(shape) - 2
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
        w = torch.randn(wshape, device="cuda", dtype=dtype).to(memory_format=fmt) * 0.01
        conv = (x, w, None, [stride] * d, [padding] * d, [dilation] * d, transposed, [0] * d, groups)
        try:
            for _ in range(2):  # the first call builds the plan; the second runs the cached one
                y, *measured = measured_call(_ops.convolution.default, conv, {})
            line = record_line(_ops.convolution.default, conv, y, *measured)
            back = (torch.randn_like(y), x, w, [wshape[0]], [stride] * d, [padding] * d, [dilation] * d,
                    transposed, [0] * d, groups, [True, True, False])
            for _ in range(2):
                g, *measured = measured_call(_ops.convolution_backward.default, back, {})
            lines = [line, record_line(_ops.convolution_backward.default, back, g, *measured)]
        except torch.OutOfMemoryError as e:
            lines = [{"args": describe(list(conv)), "error": str(e)[:200]}]
        with path.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        del x, w
        torch.cuda.empty_cache()
    print(f"{path}: {path.read_text().count(chr(10))} lines")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("names", nargs="+")
    r.add_argument("--jobs", type=int, default=4)
    r.add_argument("--timeout", type=float, default=300)
    e = sub.add_parser("_entry")
    e.add_argument("name")
    for s in (r, e):
        s.add_argument("--out", type=Path, required=True)
        s.add_argument("--seconds", type=float, default=45.0, help="stop this long after the first convolution")
        s.add_argument("--calls", type=int, default=3000, help="stop after this many convolution calls")
    g = sub.add_parser("grid")
    g.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.cmd == "record":
        record(args)
    elif args.cmd == "_entry":
        run_entry(args.name, args.out, args.seconds, args.calls)
    else:
        grid(args)


if __name__ == "__main__":
    main()
