"""``memprof.advise``: simulate every plan, recommend the fastest that fits, verify it.

Each plan (a list of strategies from ``memprof.strategies``) is applied to a
fresh copy of the user's workload on the simulated target GPU and one or
more steps are simulated: memory from the caching-allocator model, time from
the per-kernel roofline (so recomputation, smaller micro-batches and PCIe
transfers cost what they cost). Sharding and state offload, which one process
cannot run, are then accounted for analytically by their strategies.
``verify`` applies the best plans for real on the local GPU and measures them
next to the prediction.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch

from .categories import Category
from .devices import GPU, get_gpu
from .report import Report
from .simulate import NON_PYTORCH_BYTES, simulate
from .units import fmt_bytes
from .workload import Workload

__all__ = ["Advice", "advise", "default_plans", "max_batch_size", "measure_steps", "parse_budget", "rank", "rerank", "best_of", "simulate_plan", "verify"]

log = logging.getLogger(__name__)

PlanFactory = Callable[[], list]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(budget: int | str | GPU) -> tuple[int, GPU | None]:
    """Bytes available to PyTorch, and the GPU if one was named.

    ``24GiB``, ``80GB`` (10^9), ``25769803776``, or a catalogue GPU (``rtx4090``,
    ``h100``): a GPU's budget is its memory less what CUDA's context and
    libraries take outside PyTorch.
    """
    if isinstance(budget, GPU):
        return budget.memory_bytes - NON_PYTORCH_BYTES, budget
    if isinstance(budget, int) and not isinstance(budget, bool):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        return budget, None
    text = str(budget).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?i?b)?", text, flags=re.IGNORECASE)
    if m:
        unit = (m.group(2) or "b").lower()
        value = int(float(m.group(1)) * _UNITS[unit])
        if value <= 0:
            raise ValueError(f"budget must be positive, got {text!r}")
        return value, None
    try:
        gpu = get_gpu(text)
    except ValueError as exc:
        raise ValueError(f"budget {text!r} is neither a size (e.g. 24GiB, 80GB) nor a GPU: {exc}") from None
    return gpu.memory_bytes - NON_PYTORCH_BYTES, gpu


def default_plans(world_size: int = 1, pure_bf16: bool = False) -> dict[str, PlanFactory]:
    """Single strategies and sensible combinations, by name (fresh strategy objects per call).

    Pure bf16 weights (no fp32 master copy) change what training computes, so
    those plans are offered only with ``pure_bf16=True``.
    """
    from memprof.strategies import Accumulation, ActivationOffload, Autocast, Checkpointing, PureBF16, StateOffload, ZeRO

    plans: dict[str, PlanFactory] = {"baseline": list}
    for prec in (None, "bf16", *(("pure_bf16",) if pure_bf16 else ())):
        for ckpt in (False, True):
            for k in (1, 2, 4, 8):
                parts = []
                if prec == "bf16":
                    parts.append(lambda: Autocast("bf16"))
                elif prec == "pure_bf16":
                    parts.append(PureBF16)
                if ckpt:
                    parts.append(Checkpointing)
                if k > 1:
                    parts.append(lambda k=k: Accumulation(k))
                if parts:
                    plans[_name(p() for p in parts)] = lambda parts=tuple(parts): [p() for p in parts]
    for prec in (None, "bf16"):
        parts = ([lambda: Autocast("bf16")] if prec else []) + [ActivationOffload]
        plans[_name(p() for p in parts)] = lambda parts=tuple(parts): [p() for p in parts]
        parts = ([lambda: Autocast("bf16")] if prec else []) + [StateOffload]
        plans[_name(p() for p in parts)] = lambda parts=tuple(parts): [p() for p in parts]
    if world_size > 1:
        for stage, offload in ((1, False), (2, False), (3, False), (3, True)):
            for extra in ([], [lambda: Autocast("bf16")], [lambda: Autocast("bf16"), Checkpointing]):
                parts = [*extra, lambda s=stage, o=offload: ZeRO(s, world_size, offload=o)]
                plans[_name(p() for p in parts)] = lambda parts=tuple(parts): [p() for p in parts]
    return plans


def _name(strategies) -> str:
    return "+".join(s.name for s in strategies) or "baseline"


@dataclass
class Advice:
    """The ranked plans: ``table`` has one row per plan, best first."""

    budget: int
    gpu: GPU
    world_size: int
    table: pd.DataFrame
    baseline: Report
    plans: dict[str, PlanFactory] = field(repr=False, default_factory=dict)

    @property
    def best(self) -> str | None:
        return best_of(self.table)

    def __rich__(self):
        from rich.table import Table

        t = Table(title=f"plans for {fmt_bytes(self.budget)} on {self.gpu.name}, {self.world_size} rank(s): fastest that fits first")
        for col in ("plan", "peak allocated", "peak reserved", "fits", "step time", "vs baseline", "why"):
            t.add_column(col, overflow="fold")
        for name, r in self.table.iterrows():
            t.add_row(
                str(name), fmt_bytes(r["peak_allocated"]), fmt_bytes(r["peak_reserved"]), "yes" if r["fits"] else "no",
                f"{1e3 * r['seconds']:.1f} ms", f"{100 * (r['slowdown'] - 1):+.0f} %", r["why"],
                style=None if r["fits"] else "dim",
            )
        return t


def simulate_plan(
    make_workload: Callable[[], Workload],
    plan: PlanFactory,
    gpu: GPU,
    *,
    steps: int = 2,
    baseline: Report | None = None,
):
    """Predict one plan: returns a ``memprof.strategies.Prediction`` (per rank)."""
    from memprof.strategies import Prediction
    from memprof.strategies.zero import fsdp_units

    strategies = plan()
    units = {}

    def setup():
        w = make_workload()
        units.update(fsdp_units(w.model))
        for s in strategies:
            s.apply_simulated(w)
        return w.model, w.optimizer, w.step

    report = simulate(setup, target=gpu, steps=steps)
    report.meta.update(units, plan=_name(strategies))
    pred = Prediction.from_report(report)
    for s in strategies:
        pred = s.adjust(pred, baseline or report, gpu)
    return pred


def advise(
    make_workload: Callable[[], Workload],
    budget: int | str | GPU,
    *,
    target: str | GPU | None = None,
    world_size: int = 1,
    plans: dict[str, PlanFactory] | None = None,
    margin: float = 0.05,
    steps: int = 2,
    progress: bool = True,
) -> Advice:
    """Rank plans for ``make_workload()`` under ``budget`` bytes of device memory per rank.

    ``make_workload`` must build a fresh :class:`Workload` each call (written for
    CUDA; it runs on the simulated ``target``, default: the budget's GPU, else
    an H100). A plan fits when its predicted peak reserved memory, plus
    ``margin`` of it for the simulation's error, is within the budget.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    nbytes, named = parse_budget(budget)
    gpu = get_gpu(target) if target is not None else (named or get_gpu("H100-80GB"))
    plans = plans or default_plans(world_size)
    if "baseline" not in plans:  # every plan is judged against the step as it is
        plans = {"baseline": list, **plans}
    rows = []
    baseline: Report | None = None
    base_pred = None
    with _progress(progress, len(plans)) as advance:
        for name, factory in plans.items():
            try:
                pred = simulate_plan(make_workload, factory, gpu, steps=steps, baseline=baseline)
            except Exception as exc:  # one plan that cannot run must not hide the others
                log.warning("plan %s could not be simulated: %s: %s", name, type(exc).__name__, exc)
                advance(name)
                continue
            if name == "baseline":
                baseline, base_pred = pred.report, pred
            rows.append((name, pred))
            advance(name)
    if base_pred is None:
        raise RuntimeError("the baseline step could not be simulated; see the warnings above")
    table = rank(rows, base_pred, baseline, nbytes, margin)
    return Advice(nbytes, gpu, world_size, table, baseline, plans)


def best_of(table: pd.DataFrame) -> str | None:
    """The first plan of a ranked table that fits, or None."""
    fits = table[table["fits"]]
    return None if fits.empty else str(fits.index[0])


def rank(rows: list, base, baseline: Report, budget: int, margin: float) -> pd.DataFrame:
    """Plans as a table, best first: those that fit by predicted step time, then the rest by size.

    ``rows``: ``(name, Prediction)`` pairs; ``base``: the baseline's Prediction.
    """
    table = pd.DataFrame(
        [
            {
                "plan": name,
                "peak_allocated": p.peak_allocated,
                "peak_reserved": p.peak_reserved,
                "seconds": p.seconds,
                "slowdown": p.seconds / base.seconds if base.seconds else float("nan"),
                "why": _why(name, p, base, baseline),
            }
            for name, p in rows
        ]
    ).set_index("plan")
    return rerank(table, budget, margin)


def rerank(table: pd.DataFrame, budget: int, margin: float = 0.05) -> pd.DataFrame:
    """``table`` (predicted peaks and seconds per plan) ranked for ``budget``:
    a plan fits when its peak reserved plus ``margin`` of it is within the budget."""
    t = table.drop(columns="fits", errors="ignore")
    t.insert(2, "fits", t["peak_reserved"] * (1 + margin) <= budget)  # after the peaks, as before
    return pd.concat([t[t["fits"]].sort_values("seconds"), t[~t["fits"]].sort_values("peak_reserved")])


def _why(name: str, p, base, baseline: Report) -> str:
    peak = baseline.peak
    total = peak.allocated or 1
    top = max((c for c in peak.bytes if c in {x.value for x in Category} and c != Category.TEMPORARIES.value
               and c not in ("fragmentation", "non_pytorch")), key=lambda c: peak.bytes[c])
    share = f"{top} are {100 * peak.bytes[top] / total:.0f} % of the baseline peak"
    if name == "baseline":
        return f"{share} ({fmt_bytes(peak.allocated)} allocated at {peak.phase})"
    delta = base.peak_allocated - p.peak_allocated
    verb = "removes" if delta >= 0 else "adds"
    return f"{share}; {name} {verb} {fmt_bytes(abs(delta))} of peak allocated"


class _progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda name: None
        from rich.progress import Progress

        self._p = Progress(transient=True)
        self._p.__enter__()
        task = self._p.add_task("simulating plans", total=self.total)
        return lambda name: self._p.update(task, advance=1, description=f"simulated {name}")

    def __exit__(self, *exc):
        if self.enabled:
            self._p.__exit__(*exc)


def max_batch_size(
    make_workload: Callable[[int], Workload],
    budget: int | str | GPU,
    plan: PlanFactory = list,
    *,
    target: str | GPU | None = None,
    margin: float = 0.05,
    limit: int = 1 << 16,
) -> int:
    """The largest batch size whose plan fits ``budget``, by simulation (no OOM provoked).

    ``make_workload(batch_size)`` builds the workload for a batch size. With
    ``Accumulation(k)`` in the plan only multiples of k are tried. Returns 0
    when even the smallest batch does not fit.
    """
    from memprof.strategies import Accumulation

    nbytes, named = parse_budget(budget)
    gpu = get_gpu(target) if target is not None else (named or get_gpu("H100-80GB"))
    # Micro-batches split the batch evenly: search multiples of their number.
    unit = 1
    for s in plan():
        if isinstance(s, Accumulation):
            unit *= s.k

    def fits(n: int) -> bool:  # n units of batch
        p = simulate_plan(lambda: make_workload(n * unit), plan, gpu)
        return p.peak_reserved * (1 + margin) <= nbytes

    top = limit // unit
    if top < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def verify(
    make_workload: Callable[[], Workload],
    advice: Advice,
    *,
    plans: Sequence[str] | None = None,
    top: int = 3,
    steps: int = 5,
    warmup: int = 2,
) -> pd.DataFrame:
    """Apply plans for real on the local GPU and measure them next to the prediction.

    By default the baseline and the ``top`` fastest plans that fit. Columns:
    predicted and measured peak allocated/reserved and step time (median of
    ``steps``), and the measured saving against the measured baseline. A plan
    that runs out of memory is reported as such.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("verify() measures on a CUDA GPU and none is available; advise() alone works without one")
    names = list(plans) if plans is not None else ["baseline", *[n for n in advice.table.index[advice.table["fits"]] if n != "baseline"][:top]]
    rows = []
    base = None
    for name in names:
        pred = advice.table.loc[name]
        try:
            measured = _measure(make_workload, advice.plans[name], steps, warmup)
        except torch.OutOfMemoryError:
            rows.append({"plan": name, "error": "out of memory"})
            torch.cuda.empty_cache()
            continue
        if name == "baseline":
            base = measured
        rows.append(
            {
                "plan": name,
                "predicted_peak_allocated": int(pred["peak_allocated"]),
                "measured_peak_allocated": measured["peak_allocated"],
                "predicted_peak_reserved": int(pred["peak_reserved"]),
                "measured_peak_reserved": measured["peak_reserved"],
                "predicted_seconds": float(pred["seconds"]),
                "measured_seconds": measured["seconds"],
                "fits_budget": measured["peak_reserved"] <= advice.budget,
            }
        )
    df = pd.DataFrame(rows).set_index("plan")
    if base is not None and "measured_peak_reserved" in df:
        df["measured_saving"] = base["peak_reserved"] - df["measured_peak_reserved"]
        df["allocated_error"] = df["predicted_peak_allocated"] / df["measured_peak_allocated"] - 1
    return df


def _measure(make_workload, plan: PlanFactory, steps: int, warmup: int) -> dict:
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    w = make_workload()
    for s in plan():
        s.apply(w)
    out = measure_steps(w, steps, warmup)
    del w
    gc.collect()
    torch.cuda.empty_cache()
    return out


def measure_steps(workload: Workload, steps: int, warmup: int, before: Callable[[], None] | None = None) -> dict:
    """Peak allocated and reserved CUDA memory over ``steps`` steps after
    ``warmup`` ones, and the median step time; ``before`` runs once the
    warm-up is done (a barrier, with several ranks)."""
    for _ in range(warmup):
        workload.step()
    torch.cuda.synchronize()
    if before is not None:
        before()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        workload.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "seconds": statistics.median(times),
    }
