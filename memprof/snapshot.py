"""Read an allocator snapshot a user recorded without memprof, safely, and attribute it.

PyTorch writes snapshots with ``torch.cuda.memory._record_memory_history()``
and ``torch.cuda.memory._dump_snapshot(path)``: a pickle of plain
containers (``segments`` with their ``blocks``, ``device_traces`` with every
``alloc`` and ``free_completed`` and the Python frames that made it). People
share these files, and unpickling a file can run any code it names, so
:func:`load` admits only what the format uses: dicts, lists, tuples,
strings, bytes, numbers, booleans and None. A file that names anything else
(a class, a function to call) is refused before anything runs.

:func:`to_report` replays the trace to find the peak of allocated memory
and names each block live there by the frames that allocated it, as far as
frames can tell (``meta["unknowable"]`` says what they cannot).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pandas as pd

from .categories import ALLOCATED, Category
from .report import MODULE_COLUMNS, STEP_COLUMNS, Breakdown, Report

__all__ = ["load", "to_report", "UNKNOWABLE"]

#: What a snapshot's frames cannot tell apart, said in every report made from one.
UNKNOWABLE = (
    "buffers are counted as parameters",
    "gradients of activations are counted as gradients",
    "inputs and temporaries alive at the peak are counted as temporaries",
    "optimizer temporaries alive at the peak are counted as optimizer state",
    "modules are the Python functions whose forward allocated the block (file and function), not module paths",
)


class _Refused(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Admits the containers and scalars pickle builds by itself; refuses every global."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"it names {module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"it refers to an outside object ({pid!r})")


def load(path: str | os.PathLike) -> dict:
    """The snapshot at ``path`` (``torch.cuda.memory._dump_snapshot``'s pickle), loaded without running anything in it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no snapshot at {str(path)!r}") from None
    try:
        snap = _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise ValueError(
            f"{str(path)!r} was refused: {exc}. A memory snapshot holds only plain containers and numbers, so this file "
            "is not one, or it was made to run code when loaded; memprof loads nothing else from it"
        ) from None
    except Exception as exc:  # truncated or not a pickle at all
        raise ValueError(f"{str(path)!r} is not a memory snapshot ({type(exc).__name__}: {exc})") from None
    if not isinstance(snap, dict) or "segments" not in snap:
        raise ValueError(
            f"{str(path)!r} is a pickle but not a memory snapshot (no 'segments'); write one with "
            "torch.cuda.memory._dump_snapshot(path) after torch.cuda.memory._record_memory_history()"
        )
    return snap


def _category(frames: list[dict]) -> tuple[Category, str]:
    """A block's category and module from the frames that allocated it (innermost first)."""
    files = [(str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", ""))) for f in frames]
    forward = next((f"{Path(fn).name}:{name}" for fn, name in files
                    if name == "forward" and "/torch/" not in fn), "")
    if any("/torch/optim/" in fn for fn, _ in files):
        return Category.OPTIMIZER_STATE, forward
    if any(name in ("backward", "_engine_run_backward", "run_backward") for _, name in files):
        return Category.GRADIENTS, forward
    if any(fn.endswith("torch/nn/modules/module.py") and name in ("_apply", "to", "cuda", "convert") for fn, name in files):
        return Category.PARAMETERS, forward
    if forward or any(name == "forward" for _, name in files):
        return Category.ACTIVATIONS, forward
    return Category.TEMPORARIES, ""


def to_report(snapshot: dict, device: int = 0) -> Report:
    """A :class:`Report` of ``snapshot`` (from :func:`load`): the peak of allocated memory over its trace
    on ``device``, and each block live at the peak by category and allocating forward."""
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    now = {b["address"]: (b["size"], b.get("frames", []))
           for s in segments for b in s.get("blocks", []) if b.get("state") == "active_allocated"}
    reserved_now = sum(int(s["total_size"]) for s in segments)
    # Replay the trace backwards from the snapshot's live blocks to where it began, then forwards to its peaks.
    live, reserved = dict(now), reserved_now
    for e in reversed(trace):
        action = e.get("action")
        if action == "alloc":
            live.pop(e["addr"], None)
        elif action == "free_completed":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif action in ("segment_alloc", "segment_map"):
            reserved -= e["size"]
        elif action in ("segment_free", "segment_unmap"):
            reserved += e["size"]
    allocated = sum(size for size, _ in live.values())
    best, at, reserved_at, reserved_high = allocated, dict(live), reserved, reserved
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            allocated += e["size"]
        elif action == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"])[0]
        elif action in ("segment_alloc", "segment_map"):
            reserved += e["size"]
            reserved_high = max(reserved_high, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
        if allocated > best:
            best, at, reserved_at = allocated, dict(live), reserved
    counts = {c.value: 0 for c in ALLOCATED}
    counts[Category.FRAGMENTATION.value] = max(reserved_at - best, 0)
    modules: dict[str, dict[str, int]] = {}
    for size, frames in at.values():
        category, module = _category(frames)
        counts[category.value] += size
        if module:
            row = modules.setdefault(module, dict.fromkeys(MODULE_COLUMNS[1:], 0))
            if category.value in row:
                row[category.value] += size
    root = dict.fromkeys(MODULE_COLUMNS[1:], 0)
    for category in ALLOCATED:
        if category.value in root:
            root[category.value] = counts[category.value]
    rows = {"snapshot": root, **{f"snapshot.{m}": r for m, r in sorted(modules.items())}}
    table = pd.DataFrame([{"type": "" if n == "snapshot" else "forward", **r} for n, r in rows.items()],
                         index=pd.Index(list(rows), name="module"), columns=MODULE_COLUMNS)
    steps = pd.DataFrame([(0, True, best, reserved_high, sum(s for s, _ in now.values()), reserved_now, None)],
                         columns=STEP_COLUMNS)
    return Report(device=f"cuda:{device}", peak=Breakdown(step=0, phase="snapshot trace", bytes=counts),
                  modules=table, steps=steps, source="snapshot",
                  meta={"trace_events": len(trace), "segments": len(segments), "unknowable": list(UNKNOWABLE)})
