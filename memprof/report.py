"""The Report: what memprof found, as data first and a rendering second.

Live tracking and (later) simulation produce this same type, so a prediction
and a measurement can be compared row by row.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import pandas as pd

from .categories import ALLOCATED, OUTSIDE_ALLOCATED, Category
from .units import GiB

__all__ = [
    "Breakdown",
    "Report",
    "compare",
    "Phase",
    "phase_kind",
    "phase_module",
    "MODULE_CATEGORIES",
    "MODULE_COLUMNS",
    "module_children",
    "OVER_STEP_COLUMNS",
    "STEP_COLUMNS",
]

# 2: phases as "forward <module>" (was "forward:<module>"); module rows at the
# peak, including their submodules, and over-the-step columns apart.
SCHEMA_VERSION = 2


class Phase(str, Enum):
    """What the training step was doing: the kinds of phase.

    A phase (``Breakdown.phase``, the timeline's ``phase`` column) is a kind's
    value, followed for the three kinds that run inside a module by a space and
    that module's path as in ``Report.modules``: ``"forward GPT.transformer.h.3.attn"``.
    Each sample closes an interval of the step and the interval is named by
    the phase it ran in; a step runs ``between steps``, ``forward ...``,
    ``loss``, ``backward ...``, ``after backward`` (repeated for each
    micro-batch) and ``optimizer step``, with ``zero_grad`` wherever it is
    called.
    """

    #: ``forward <module>``: the innermost module whose forward is running.
    FORWARD = "forward"
    #: ``recompute <module>``: a checkpointed module's forward, run again in backward.
    RECOMPUTE = "recompute"
    #: ``backward <module>``: the innermost module whose backward is running;
    #: ``backward`` alone: backward outside the model's modules (code that made its inputs).
    BACKWARD = "backward"
    #: After the model's forward returned, until backward reaches its outputs:
    #: the loss computed outside the model, its forward and its backward.
    LOSS = "loss"
    #: Backward is done; before the next micro-batch's forward or the
    #: optimizer step: gradient clipping, unscaling, the next micro-batch's data.
    AFTER_BACKWARD = "after backward"
    #: ``optimizer.step()``, from its start (after the closure, if it is given one) to its end.
    OPTIMIZER_STEP = "optimizer step"
    #: The optimizer's or the model's ``zero_grad()``.
    ZERO_GRAD = "zero_grad"
    #: After the optimizer step until the next forward (before the first one in
    #: the first step): data loading, logging, checkpoint saving.
    BETWEEN_STEPS = "between steps"

    def __str__(self) -> str:
        return self.value


_IN_MODULE = (Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD)


def phase_kind(phase: str) -> Phase | None:
    """The kind of a phase string (``"backward GPT.lm_head"`` -> ``Phase.BACKWARD``); None if it is none."""
    try:
        return Phase(phase)
    except ValueError:
        pass
    kind, _, module = phase.partition(" ")
    if module and kind in {k.value for k in _IN_MODULE}:
        return Phase(kind)
    return None


def phase_module(phase: str) -> str:
    """The module path of a ``forward``/``recompute``/``backward`` phase, else ``""``."""
    return phase.partition(" ")[2] if phase_kind(phase) in _IN_MODULE else ""


#: What a module can hold: every allocated category but temporaries and other
#: models, which no module of the tracked model claims. The module table's
#: columns of the same names.
MODULE_CATEGORIES: tuple[Category, ...] = tuple(
    c for c in ALLOCATED if c not in (Category.TEMPORARIES, Category.OTHER_MODELS))

#: The module table's columns that are not about the peak's moment but about
#: the whole reported step (every micro-batch, and recomputation).
OVER_STEP_COLUMNS = ["activations_saved_over_step", "forward_peak_delta", "backward_peak_delta"]

MODULE_COLUMNS = ["type", *(c.value for c in MODULE_CATEGORIES), *OVER_STEP_COLUMNS]
STEP_COLUMNS = ["step", "profiled", "peak_allocated", "peak_reserved", "allocated", "reserved", "seconds"]


@dataclass
class Breakdown:
    """Bytes per category at one moment (the peak of a step)."""

    step: int
    #: The phase in which that moment fell, e.g. ``backward GPT2LMHeadModel.lm_head``
    #: or ``optimizer step`` (see :class:`Phase`).
    phase: str
    #: Category value -> bytes. Every allocated category is present; the
    #: categories outside the allocator (fragmentation, non_pytorch) only
    #: where the device reports them.
    bytes: dict[str, int]

    @property
    def allocated(self) -> int:
        """Sum of the allocated categories: ``torch.cuda.memory_allocated()`` on CUDA."""
        return sum(self.bytes.get(c.value, 0) for c in ALLOCATED)

    @property
    def reserved(self) -> int | None:
        if Category.FRAGMENTATION.value not in self.bytes:
            return None
        return self.allocated + self.bytes[Category.FRAGMENTATION.value]

    def metrics(self) -> dict[str, float]:
        """For a logger: ``peak_allocated_GiB``, ``peak_reserved_GiB`` (where known) and
        ``<category>_GiB`` for each category, floats in GiB (2**30 bytes)."""
        out = {"peak_allocated_GiB": self.allocated / GiB}
        if self.reserved is not None:
            out["peak_reserved_GiB"] = self.reserved / GiB
        out.update({f"{category}_GiB": n / GiB for category, n in self.bytes.items()})
        return out

    def summary(self, step: str | None = None) -> str:
        """One line: the peak, where it fell (in ``step``, default ``"step <n>"``) and its categories."""
        return (f"peak {self.allocated / GiB:.3f} GiB allocated in {step or f'step {self.step}'} ({self.phase}); "
                + ", ".join(f"{c} {n / GiB:.3f} GiB" for c, n in self.bytes.items() if n))

    @property
    def named_fraction(self) -> float:
        """Share of the allocated bytes that a category other than temporaries explains."""
        total = self.allocated
        return 1.0 - self.bytes.get(Category.TEMPORARIES.value, 0) / total if total else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "bytes": dict(self.bytes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Breakdown":
        return cls(step=int(d["step"]), phase=str(d["phase"]), bytes={k: int(v) for k, v in d["bytes"].items()})


def module_children(modules: pd.DataFrame) -> dict[str, list[str]]:
    """Each row of a module table (``Report.modules``) -> its direct submodules' rows, in table order."""
    out: dict[str, list[str]] = {name: [] for name in modules.index}
    for name in modules.index:
        parent = name.rpartition(".")[0]
        if parent in out:
            out[parent].append(name)
    return out


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame(columns=columns)


@dataclass
class Report:
    """Where training memory went.

    ``peak`` is the breakdown at the highest peak among the profiled steps
    (the *reported step* is that peak's step); ``optimizer_state`` bytes per
    state name (Adam's ``exp_avg`` and ``exp_avg_sq`` apart) at that peak;
    ``other_models`` the bytes of each module outside the tracked
    model that the script keeps on the device, by the name the script holds it
    by (the ``other_models`` category); ``timeline`` the samples of the last profiled steps;
    ``steps`` one row per step (its ``seconds`` from the end of the step before, less the
    model's calls without gradients: a validation loop between steps is not the step's).

    ``modules`` has one row per module, indexed by its path (the root's class
    name, then ``named_modules()``'s name), parents before their children.
    A row includes its submodules, so the root row holds everything that
    any module holds. The columns named after a category
    (:data:`MODULE_CATEGORIES`) are the bytes live at the peak's moment: the
    root row's equal ``peak.bytes`` for those categories exactly, and the
    rows of a module's children add up to its own row less what its own code
    holds. Every live storage is attributed to one module, and counts in that
    module's row and its ancestors': parameters and buffers, and a
    parameter's gradient and optimizer state, to the module that registers
    them; an activation (a tensor saved for backward) to the innermost module
    running when it was first saved, so a tensor saved by two modules (a
    ReLU's output, saved by the ReLU and by the next Linear) belongs to the
    first; an activation gradient to the module whose backward produced it;
    inputs to the root. Temporaries have no module. The columns in
    :data:`OVER_STEP_COLUMNS` are about the whole reported step instead:
    ``activations_saved_over_step`` the bytes saved for backward while the
    module ran, every forward of the step added up (micro-batches,
    recomputation; a storage saved twice within one module's row counts
    once), and ``forward_peak_delta`` / ``backward_peak_delta`` the most its
    forward / backward raised allocated memory above where it began.
    Do not sum a column over all rows: a row already includes its submodules.
    """

    device: str
    peak: Breakdown | None = None
    optimizer_state: dict[str, int] = field(default_factory=dict)
    other_models: dict[str, int] = field(default_factory=dict)
    modules: pd.DataFrame = field(default_factory=lambda: _empty(MODULE_COLUMNS))
    timeline: pd.DataFrame = field(default_factory=lambda: _empty(["step", "seq", "phase", "allocated"]))
    steps: pd.DataFrame = field(default_factory=lambda: _empty(STEP_COLUMNS))
    #: ``"track"`` for a measurement; other producers name themselves.
    source: str = "track"
    meta: dict[str, Any] = field(default_factory=dict)

    # -- tables ---------------------------------------------------------------
    def to_dataframe(self) -> pd.DataFrame:
        """The peak breakdown as a table: category, bytes, GiB, share of allocated."""
        rows = []
        if self.peak is not None:
            total = self.peak.allocated
            for cat in (*ALLOCATED, *OUTSIDE_ALLOCATED):
                if cat.value in self.peak.bytes:
                    b = self.peak.bytes[cat.value]
                    share = b / total if total and cat in ALLOCATED else float("nan")
                    rows.append({"category": cat.value, "bytes": b, "GiB": b / GiB, "share": share})
        return pd.DataFrame(rows, columns=["category", "bytes", "GiB", "share"])

    # -- persistence ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "source": self.source,
            "device": self.device,
            "meta": self.meta,
            "peak": self.peak.to_dict() if self.peak else None,
            "optimizer_state": dict(self.optimizer_state),
            "other_models": dict(self.other_models),
            "modules": self.modules.reset_index(names="module").to_dict(orient="records"),
            "timeline": self.timeline.to_dict(orient="records"),
            "steps": self.steps.to_dict(orient="records"),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        if d.get("schema") != SCHEMA_VERSION:
            raise ValueError(
                f"report schema {d.get('schema')!r} is not supported (this memprof reads schema {SCHEMA_VERSION}); "
                "re-create the report with this version of memprof"
            )
        modules = pd.DataFrame(d["modules"], columns=["module", *MODULE_COLUMNS]).set_index("module")
        return cls(
            device=d["device"],
            peak=Breakdown.from_dict(d["peak"]) if d["peak"] else None,
            optimizer_state={k: int(v) for k, v in d["optimizer_state"].items()},
            # Reports saved before other models were kept name none.
            other_models={k: int(v) for k, v in d.get("other_models", {}).items()},
            modules=modules,
            timeline=pd.DataFrame(d["timeline"]),
            steps=pd.DataFrame(d["steps"], columns=STEP_COLUMNS),
            source=d.get("source", "track"),
            meta=d.get("meta", {}),
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically: a crash mid-write never leaves half a report."""
        return _atomic_write(path, lambda f: json.dump(self.to_dict(), f, indent=1, default=_json_default))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Report":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no report at {str(path)!r}: give the path that Report.save() wrote") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{str(path)!r} is not a memprof report (invalid JSON: {exc})") from None
        return cls.from_dict(data)

    def save_snapshot(self, path: str | os.PathLike) -> Path:
        """Write the peak in PyTorch's allocator-snapshot format (a pickle), each block named by its category
        and module, for ``torch.cuda._memory_viz`` and pytorch.org/memory_viz (atomically)."""
        import pickle

        from .snapshot import from_report

        data = pickle.dumps(from_report(self))
        return _atomic_write(path, lambda f: f.write(data), mode="wb")

    # -- rendering ------------------------------------------------------------
    def to_html(self) -> str:
        """One self-contained HTML page: categories, timeline chart, module tree."""
        from .html import report_html

        return report_html(self)

    def save_html(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_html` to ``path`` (atomically)."""
        page = self.to_html()
        return _atomic_write(path, lambda f: f.write(page))

    def __rich_console__(self, console, options):
        from .render import render_report

        yield from render_report(self)

    def __str__(self) -> str:
        from .render import report_text

        return report_text(self)


def _atomic_write(path: str | os.PathLike, write, mode: str = "w") -> Path:
    """Write through a temporary file and rename it: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        # mkstemp makes the file private (0600); a report is shared like any file the user writes.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _json_default(o: Any) -> Any:
    # numpy scalars and NaN-free floats from pandas records
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"cannot serialise {type(o).__name__} in a report")


def compare(predicted: Report, measured: Report) -> pd.DataFrame:
    """Predicted next to measured, category by category and module by module.

    One row per peak category (``("category", name)``), per step peak
    (``("step", "peak_allocated")``, of the last step of each), and per module
    and module column (``("module:<column>", module)``); columns
    ``predicted``, ``measured``, ``difference`` (bytes) and ``relative``
    (difference over measured).
    """
    rows: dict[tuple[str, str], tuple[float, float]] = {}
    if predicted.peak is not None and measured.peak is not None:
        for cat in (*ALLOCATED, *OUTSIDE_ALLOCATED):
            p, m = predicted.peak.bytes.get(cat.value), measured.peak.bytes.get(cat.value)
            if p is not None or m is not None:
                rows[("category", cat.value)] = (p or 0, m or 0)
        rows[("category", "allocated")] = (predicted.peak.allocated, measured.peak.allocated)
    for col in ("peak_allocated", "peak_reserved"):
        p, m = _last(predicted.steps, col), _last(measured.steps, col)
        if p is not None and m is not None:
            rows[("step", col)] = (p, m)
    common = predicted.modules.index.intersection(measured.modules.index)
    for col in MODULE_COLUMNS[1:]:
        for name in common:
            rows[(f"module:{col}", name)] = (predicted.modules.at[name, col], measured.modules.at[name, col])
    df = pd.DataFrame.from_dict(rows, orient="index", columns=["predicted", "measured"])
    df.index = pd.MultiIndex.from_tuples(df.index, names=["what", "name"])
    df["difference"] = df["predicted"] - df["measured"]
    df["relative"] = (df["difference"] / df["measured"].where(df["measured"] != 0)).astype(float)
    return df


def _last(steps: pd.DataFrame, col: str) -> float | None:
    if col not in steps or not len(steps) or pd.isna(steps[col].iloc[-1]):
        return None
    return float(steps[col].iloc[-1])
