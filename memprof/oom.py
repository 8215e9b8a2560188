"""What was live when the GPU (real or simulated) ran out of memory.

PyTorch's ``OutOfMemoryError`` names the size it tried to allocate and the
allocator's totals; it cannot say what held the memory. When that error
leaves a :func:`memprof.track` block, the tracker still knows every live
storage's category and module: :func:`save` writes that moment as a report
(``memprof-oom-<time>.json`` and ``.html``) and :func:`explain` says in one
paragraph what held the most and where. The error itself is re-raised
unchanged by the caller.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from .categories import ALLOCATED
from .report import Report, module_children
from .units import fmt_bytes

__all__ = ["concentration", "explain", "save"]

log = logging.getLogger(__name__)


def concentration(report: Report, category: str) -> tuple[str, int] | None:
    """The module where ``category``'s bytes gather: from the root, step into
    the child that holds the most of them while it holds more than half of its
    parent's; ``(module, bytes)``, or None when no module holds any."""
    rows = report.modules
    if category not in rows.columns or rows.empty:
        return None
    name = rows.index[0]  # the root
    held = int(rows.at[name, category])
    if held <= 0:
        return None
    children = module_children(rows)
    while True:
        best = max(children[name], key=lambda c: int(rows.at[c, category]), default=None)
        if best is None or 2 * int(rows.at[best, category]) <= held:
            return name, held
        name, held = best, int(rows.at[best, category])


def explain(report: Report, files: tuple[Path, Path] | None = None) -> str:
    """One paragraph: the error, what held the most memory at that moment and where, and what to try."""
    info = report.meta.get("out_of_memory", {})
    peak = report.peak
    counts = {c.value: peak.bytes.get(c.value, 0) for c in ALLOCATED} if peak is not None else {}
    total = sum(counts.values())
    largest = max(counts, key=counts.get, default=None)
    gpu = report.meta.get("target") or report.meta.get("gpu") or report.device
    text = f"out of memory on the {gpu}" + (" (simulated)" if report.source == "simulate" else "")
    if info.get("requested"):
        text += f" while allocating {fmt_bytes(info['requested'])}"
    if peak is not None:
        text += f", in step {peak.step} ({peak.phase}), with {fmt_bytes(total)} allocated"
    if info.get("capacity"):
        text += f" of {fmt_bytes(info['capacity'])} PyTorch can use"
    text += "."
    if largest and counts[largest]:
        text += f" The largest category was {largest} ({fmt_bytes(counts[largest])}, {100 * counts[largest] / total:.0f} %)"
        where = concentration(report, largest)
        if where is None:
            text += "."
        elif where[0] == report.modules.index[0]:
            text += f", spread over {where[0]}'s submodules."
        else:
            text += f", most of it in {where[0]} ({fmt_bytes(where[1])})."
    if files:
        text += f" The breakdown at that moment is in {' and '.join(map(str, files))}."
    text += (" `memprof advise` with this GPU as the budget lists the plans that fit"
             " (mixed precision, checkpointing, accumulation, offload, sharding).")
    return text


def save(report: Report, directory: str | os.PathLike = ".") -> tuple[Path, ...]:
    """Write ``report`` as ``memprof-oom-<time>.json`` and ``.html`` in ``directory``; returns their paths
    (the JSON's alone without plotly, which draws the page: the breakdown matters more than its page)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / time.strftime("memprof-oom-%Y%m%d-%H%M%S")
    n, path = 1, stem
    while path.with_suffix(".json").exists():  # two errors within a second keep both
        n += 1
        path = stem.with_name(f"{stem.name}-{n}")
    saved = report.save(path.with_suffix(".json"))
    try:
        return saved, report.save_html(path.with_suffix(".html"))
    except ImportError as exc:
        log.warning("%s; the breakdown is in %s", exc, saved)
        return (saved,)
