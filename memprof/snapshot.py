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
from .report import MODULE_COLUMNS, STEP_COLUMNS, Breakdown, Report, module_children

__all__ = ["load", "to_report", "from_report", "UNKNOWABLE"]

# The file name of the frame memprof writes on each block: its name is "<category> <module>".
_MEMPROF = "memprof"
_BASE = 0x7F0000000000  # where the written segment begins (any address would do)

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
    if files and files[0][0] == _MEMPROF:  # written by memprof: "<category> <module>"
        category, _, module = files[0][1].partition(" ")
        if category in {c.value for c in ALLOCATED}:
            return Category(category), module
    forward = next((f"{Path(fn).stem}:{name}" for fn, name in files
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
    # A row holds its submodules' bytes too, as in every memprof report.
    rows: dict[str, dict[str, int]] = {"snapshot": dict.fromkeys(MODULE_COLUMNS[1:], 0)}
    for size, frames in at.values():
        category, module = _category(frames)
        counts[category.value] += size
        if category.value not in rows["snapshot"]:
            continue  # temporaries have no module
        path = "snapshot"
        rows[path][category.value] += size
        for part in module.split(".") if module else ():
            path += "." + part
            rows.setdefault(path, dict.fromkeys(MODULE_COLUMNS[1:], 0))[category.value] += size
    names = sorted(rows, key=lambda n: n.split("."))
    table = pd.DataFrame([{"type": "", **rows[n]} for n in names], index=pd.Index(names, name="module"),
                         columns=MODULE_COLUMNS)
    steps = pd.DataFrame([(0, True, best, reserved_high, sum(s for s, _ in now.values()), reserved_now, None)],
                         columns=STEP_COLUMNS)
    return Report(device=f"cuda:{device}", peak=Breakdown(step=0, phase="snapshot trace", bytes=counts),
                  modules=table, steps=steps, source="snapshot",
                  meta={"trace_events": len(trace), "segments": len(segments), "unknowable": list(UNKNOWABLE)})


def from_report(report: Report) -> dict:
    """``report``'s peak in PyTorch's snapshot format, for ``torch.cuda._memory_viz`` and memory_viz.

    One segment holds a block per module and category (the bytes a module
    holds itself, without its submodules) and one for temporaries, each
    with one frame whose file is ``memprof`` and whose function is
    ``"<category> <module>"``; fragmentation is the segment's free block.
    The trace allocates the segment, then each block. :func:`to_report`
    reads the categories and modules back exactly."""
    if report.peak is None:
        raise ValueError("the report has no profiled step, so no peak to write; track at least one step")
    rows = report.modules
    children = module_children(rows)
    blocks: list[tuple[int, list[dict]]] = []
    for name in rows.index:
        for category in ALLOCATED:
            if category.value not in rows.columns:
                continue
            own = int(rows.at[name, category.value]) - sum(int(rows.at[c, category.value]) for c in children[name])
            if own > 0:
                blocks.append((own, [{"filename": _MEMPROF, "line": 0, "name": f"{category.value} {name}"}]))
    named = sum(size for size, _ in blocks)
    rest = report.peak.allocated - named  # temporaries, and whatever no module holds
    if rest > 0:
        blocks.append((rest, [{"filename": _MEMPROF, "line": 0, "name": Category.TEMPORARIES.value}]))
    free = report.peak.bytes.get(Category.FRAGMENTATION.value, 0)
    out, trace, addr = [], [], _BASE
    total = sum(size for size, _ in blocks) + free
    trace.append({"action": "segment_alloc", "addr": _BASE, "size": total, "stream": 0, "frames": [], "time_us": 0})
    for size, frames in blocks:
        out.append({"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                    "frames": frames})
        trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames,
                      "time_us": len(trace)})
        addr += size
    if free:
        out.append({"address": addr, "size": free, "requested_size": 0, "state": "inactive", "frames": []})
    allocated = total - free
    segment = {"device": 0, "address": _BASE, "total_size": total, "allocated_size": allocated,
               "active_size": allocated, "requested_size": allocated, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": out}
    return {"segments": [segment], "device_traces": [trace], "allocator_settings": {},
            "memprof": {"source": report.source, "phase": report.peak.phase, "step": report.peak.step}}
