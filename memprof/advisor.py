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

import copy
import gc
import logging
import re
import statistics
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterator, NamedTuple, Sequence

import pandas as pd
import torch

from .caching import expandable_segments_configured
from .categories import Category
from .coupling import what_changes
from .devices import GPU, get_gpu
from .parallel import can_fork, default_jobs, run_forked
from .report import Report
from .simulate import kept_blocks, usable_bytes
from .units import fmt_bytes
from .workload import Workload, split_batch

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
        return usable_bytes(budget), budget
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
    return usable_bytes(gpu), gpu


def default_plans(world_size: int = 1, pure_bf16: bool = False, gpu: GPU | None = None) -> dict[str, PlanFactory]:
    """Single strategies and sensible combinations, by name (fresh strategy objects per call).

    Mixed precision is bf16 autocast, or fp16 autocast with a GradScaler on a
    ``gpu`` without bf16 (before Ampere: V100, T4). Pure bf16 weights (no fp32
    master copy) change what training computes, so those plans are offered
    only with ``pure_bf16=True``.
    """
    from memprof.strategies import Accumulation, ActivationOffload, Autocast, Checkpointing, PureBF16, StateOffload, ZeRO

    half = "fp16" if gpu is not None and not gpu.bf16 else "bf16"
    mixed = lambda: Autocast(half)  # noqa: E731
    plans: dict[str, PlanFactory] = {"baseline": list}
    for prec in (None, half, *(("pure_bf16",) if pure_bf16 and half == "bf16" else ())):
        for ckpt in (False, True):
            for k in (1, 2, 4, 8):
                parts = []
                if prec == half:
                    parts.append(mixed)
                elif prec == "pure_bf16":
                    parts.append(PureBF16)
                if ckpt:
                    parts.append(Checkpointing)
                if k > 1:
                    parts.append(lambda k=k: Accumulation(k))
                if parts:
                    plans[_name(p() for p in parts)] = lambda parts=tuple(parts): [p() for p in parts]
    for prec in (None, half):
        for offload in (ActivationOffload, StateOffload):
            parts = ([mixed] if prec else []) + [offload]
            plans[_name(p() for p in parts)] = lambda parts=tuple(parts): [p() for p in parts]
    if world_size > 1:
        for stage, offload in ((1, False), (2, False), (3, False), (3, True)):
            for extra in ([], [mixed], [mixed, Checkpointing]):
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
        return plan_table(self)


def simulate_plan(
    make_workload: Callable[[], Workload],
    plan: PlanFactory,
    gpu: GPU,
    *,
    steps: int = 2,
    baseline: Report | None = None,
):
    """Predict one plan: returns a ``memprof.strategies.Prediction`` (per rank)."""
    strategies = plan()
    _, preds = simulate_plans(make_workload, {"plan": strategies}, gpu, steps=steps, base=strategies, baseline=baseline)
    if isinstance(preds["plan"], Exception):
        raise preds["plan"]
    return preds["plan"]


def simulate_plans(
    make_workload: Callable[[], Workload],
    plans: dict[str, list],
    gpu: GPU,
    *,
    steps: int = 2,
    base: list | None = None,
    advance: Callable[[str], None] | None = None,
    baseline: Report | None = None,
    jobs: int | None = None,
) -> tuple[Report, dict]:
    """Simulate many plans on one build of the workload.

    The workload is built on the simulated ``gpu`` with the ``base``
    strategies applied for good and runs ``steps`` steps under
    :func:`memprof.track`: the base report. Then, for each plan, its other
    strategies are applied (:meth:`Workload.plan`), the device is brought
    back to its state after the build (:func:`_restart`), its steps run as a
    fresh simulation of the plan would run them (the second derived from the
    first's allocation events where it repeats it, repeated micro-batches run
    once: :class:`_Repeats`), and the strategies are undone. Each plan's
    bytes are those of its own simulation.

    Plans whose steps run the same on one rank (they differ only in what is
    accounted for afterwards, like ZeRO's sharding) share one step; those
    strategies adjust against ``baseline`` (default: the base report). A plan
    whose step raises ends the build; the plans after it get a new one.
    The plans run in ``jobs`` forked copies of the build (default: one per
    CPU this process may use, at most 8; :mod:`memprof.parallel`), or in
    this process with ``jobs=1``; the results are the same.
    Returns the base report and, per plan, a ``Prediction`` or the exception
    that stopped it.
    """
    from memprof.strategies import Prediction

    jobs = default_jobs() if jobs is None else jobs
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1 (1: every plan in this process), got {jobs!r}")
    base = list(base or [])
    preds: dict[str, Any] = {}
    pending = dict(plans)
    report = None
    while pending:
        first, results, failed = _session(make_workload, base, pending, gpu, steps, advance, jobs)
        report = report or first
        for name, outcome in {**results, **failed}.items():
            if isinstance(outcome, _Sampled):  # its steps' counters; the adjustment reads the report
                c = outcome.counters
                outcome = Prediction(c.peak_allocated, c.peak_reserved, c.seconds, outcome.report, device_seconds=c.busy)
            elif isinstance(outcome, tuple) and isinstance(outcome[0], Report):  # tracked: (report, counters)
                outcome = replace(Prediction.from_report(outcome[0]), seconds=outcome[1].seconds,
                                  device_seconds=outcome[1].busy)
            elif isinstance(outcome, tuple):
                outcome = Prediction(outcome.peak_allocated, outcome.peak_reserved, outcome.seconds,
                                     device_seconds=outcome.busy)
            preds[name] = outcome if isinstance(outcome, Exception) else _adjusted(
                outcome, plans[name], baseline or report, gpu)
            pending.pop(name)
    return report, preds


def _session(make_workload, base: list, plans: dict[str, list], gpu: GPU, steps: int, advance=None, jobs: int = 1):
    """One build: the base report; per plan simulated, a report of its steps
    and the counters of one untracked (where an adjustment reads their
    samples) or its step's counters (:class:`memprof.simulate.StepCounters`);
    and the plans that failed. A process whose step fails midway stops (its
    build is unusable): the plans no process ran are left out."""
    from memprof.strategies.zero import fsdp_units

    from .simulate import SimulatedAllocator, _state_tensors
    from .tracker import track
    from .virtual_cuda import VirtualCUDA

    allocator = SimulatedAllocator(gpu)
    base_names = {s.name for s in base}
    rest = {name: [s for s in ss if s.name not in base_names] for name, ss in plans.items()}
    keys = {name: tuple(s.key for s in ss if s.simulated) for name, ss in rest.items()}
    # Strategies accounted for afterwards (sharding) read the samples of a steady step.
    sampled = {keys[name] for name, ss in rest.items() if not all(s.simulated for s in ss)}
    # One job per distinct one-rank step, the step as it is (key ()) first: the plans
    # sharing a step (they differ in what is accounted for afterwards) share its result.
    sharing: dict[tuple, list[str]] = {(): []}
    for name in rest:
        sharing.setdefault(keys[name], []).append(name)
    results: dict[tuple, Any] = {}
    failed: dict[str, Exception] = {}
    # Decided before the simulated CUDA stands in for the real one.
    forked = jobs > 1 and len(sharing) > 1 and can_fork()
    with VirtualCUDA(gpu, allocator=allocator) as device, ExitStack() as building:
        for s in base:  # what must hold before the build: the allocator's settings
            building.enter_context(s.building())
        with torch.device("meta"):
            w = make_workload()
        allocator.adopt(_state_tensors(w.model, w.optimizer))
        units = fsdp_units(w.model)
        for s in base:
            s.apply_simulated(w)
        w.repeats = _Repeats(allocator, w.model)
        optimizer_steps = _OptimizerSteps()
        built = copy.deepcopy(allocator.model), allocator.mark()

        def run(key: tuple) -> tuple[str, Any]:
            """One step from the build's state: ("ok", its result), ("failed", why),
            or ("broken", why) when it failed midway through a step (the build is unusable).
            The step as it is runs tracked: its report, counters and the simulation's notes."""
            if key == ():
                try:
                    return "ok", (*_tracked_steps(w, steps, track, allocator), dict(device.notes))
                except Exception as exc:
                    return "broken", exc
            with ExitStack() as undo:
                try:
                    undo.enter_context(w.plan(rest[sharing[key][0]], simulated=True))
                    split_batch(w.batch, w.micro_batches)  # a batch the micro-batches do not divide fails here
                    _restart(w, allocator, built)
                except Exception as exc:
                    return "failed", exc
                try:  # tracking costs time: only steps whose samples are read are tracked
                    if key in sampled:
                        return "ok", _sampled_steps(w, steps, track, allocator)
                    result = _plan_counters(w, allocator, steps, optimizer_steps)
                    if result is None:  # not derivable with a replayed optimizer step
                        _restart(w, allocator, built)
                        result = _plan_counters(w, allocator, steps)
                    return "ok", result
                except Exception as exc:
                    return "broken", exc

        def start(key: tuple) -> None:
            if sharing[key] and hasattr(advance, "now"):
                advance.now(sharing[key][0])

        # Forked, the step as it is runs in a process of its own too: a backward in this
        # process would leave its forked copies unable to run one (memprof.parallel).
        # Longest first (Graham's rule: the processes end together): the step as it is, then
        # the tracked steps, then by strategies combined (each adds work: recomputation,
        # micro-batches derived one by one). Results do not depend on the order.
        order = [()] + sorted((k for k in sharing if k), key=lambda k: (k in sampled, len(k)), reverse=True)
        outcomes = run_forked(run, order, jobs, start) if forked else _in_turn(run, order, start)
        # What the build made lives through every plan: kept out of the garbage collector's
        # full collections (a Hugging Face model's objects cost 0.1-0.2 s a collection), which
        # also spares a forked process copying the pages those collections would touch.
        gc.freeze()
        try:
            for key, status, value in outcomes:
                if key == ():
                    if status != "ok":
                        raise value
                    tracked, counters, notes = value
                    results[()] = tracked, counters
                    device.notes.update(notes)
                elif status == "ok":
                    results[key] = value
                else:
                    failed[sharing[key][0]] = value
                for name in sharing[key] if status == "ok" else sharing[key][:1]:
                    if advance is not None:
                        advance(name)
        finally:
            gc.unfreeze()
    if () not in results:
        raise RuntimeError("the step as it is could not be simulated: its process ended without an answer")
    report = results[()][0]
    report.source = "simulate"
    report.meta.update(units, target=gpu.name, host="cpu" if not torch.cuda.is_available() else "cuda",
                       plan=_name(base))
    if device.notes:
        report.meta["simulation_notes"] = dict(device.notes)
    return report, {name: results[keys[name]] for name in rest if keys[name] in results}, failed


def _in_turn(run, names: list, start) -> Iterator[tuple[Any, str, Any]]:
    """``run`` for each name in this process, until a build is broken."""
    for name in names:
        if start is not None:
            start(name)
        status, value = run(name)
        yield name, status, value
        if status == "broken":
            return


def _tracked_steps(w: Workload, steps: int, track, allocator) -> tuple[Report, Any]:
    """``steps`` steps under memprof.track: the report (its timeline the last
    step's samples), and the counters of one more step without tracking,
    whose seconds are the step's (the tracker's hooks make autograd issue
    more operators, which the training step it predicts would not)."""
    with track(w.model, w.optimizer, warmup=steps, every=1, timeline_steps=1, full=True) as prof:
        for _ in range(steps):
            w.step()
    start = allocator.mark()
    w.step()
    return prof.report(), allocator.since(start)


class _Sampled(NamedTuple):
    """A plan's steps' counters and the report whose samples its adjustment reads."""

    counters: Any
    report: Report


def _sampled_steps(w: Workload, steps: int, track, allocator) -> _Sampled:
    """A plan whose adjustment reads its samples: its counters as any plan's
    (:func:`_plan_counters`), and the report of one step more under memprof.track,
    from the state the first step leaves (the optimizer's state made). Half the
    steps, and a quarter of the tracked ones, of simulating it as the base."""
    counters = _plan_counters(w, allocator, steps)
    with track(w.model, w.optimizer, warmup=1, every=1, timeline_steps=1, full=True) as prof:
        w.step()
    return _Sampled(counters, prof.report())


def _plan_counters(w: Workload, allocator, steps: int, optimizer_steps: "_OptimizerSteps | None" = None):
    """A plan's steps without tracking: the last one's counters
    (:class:`memprof.simulate.StepCounters`); the steps after the first are derived from
    its allocation events (:func:`memprof.simulate.replay_step`) where they
    repeat it. With ``optimizer_steps`` the first step's optimizer step may
    be replayed from another plan's; a step then not derivable returns None
    (its optimizer holds no state to run a second step with)."""
    allocator.reset_peak()
    allocator.events, start = [], allocator.mark()
    try:
        with optimizer_steps.around(w.optimizer, allocator) if optimizer_steps else nullcontext([None]) as replayed:
            w.step()
    finally:
        events, allocator.events = allocator.events, None
    kept = replayed[0]
    derived = allocator.replay_step(events) if steps > 1 else None
    if steps == 1:
        derived = allocator.since(start)
    for h in kept or ():  # the replayed optimizer's state, which no tensor holds
        allocator.free(h)
    if derived is not None or kept is not None:
        return derived
    for _ in range(steps - 1):
        allocator.reset_peak()
        start = allocator.mark()
        w.step()
    return allocator.since(start)


class _OptimizerSteps:
    """An optimizer's first step, simulated once and replayed for the other plans (and batch sizes).

    The optimizer's step (every plan's last operators) asks the allocator for
    the same blocks in the same order whatever ran before it, given the same
    parameters and gradients (dtype, shape, strides), the same settings and
    no state yet: what differs between plans is the allocator's layout when it
    starts, which the replay meets as the step would. So the plans after the
    first replay its recorded events (:meth:`SimulatedAllocator.replay`)
    instead of running the step's operators, on one build or another.
    """

    def __init__(self) -> None:
        self._steps: dict[tuple, list[tuple]] = {}

    @staticmethod
    def key(optimizer: torch.optim.Optimizer) -> tuple | None:
        with torch._C.DisableTorchFunction():  # every property read would go through the simulated device's mode
            return _OptimizerSteps._key(optimizer)

    @staticmethod
    def _key(optimizer: torch.optim.Optimizer) -> tuple | None:
        if optimizer.state:
            return None
        key: list = [type(optimizer)]
        for group in optimizer.param_groups:
            key.append(tuple((k, repr(v)) for k, v in sorted(group.items()) if k != "params"))
            for p in group["params"]:
                g = p.grad
                if not p.is_meta or (g is not None and not g.is_meta):
                    return None  # the host's own tensors: real values the optimizer may read
                key.append((p.dtype, tuple(p.shape), p.stride(),
                            None if g is None else (g.dtype, tuple(g.shape), g.stride())))
        return tuple(key)

    @contextmanager
    def around(self, optimizer: torch.optim.Optimizer, a):
        """``optimizer.step`` replayed on the simulated allocator ``a`` where
        recorded, else run and recorded. Yields a list that holds, once the
        step was replayed, the handles of the replayed blocks still allocated
        (else it stays None)."""
        run = optimizer.step
        own = optimizer.__dict__.get("step")
        kept: list = [None]

        def step(*args, **kwargs):
            key = self.key(optimizer) if not args and not kwargs and a.trace is None else None
            if key is not None and key in self._steps:
                kept[0] = a.replay(self._steps[key])
                return None
            start, workspaces = len(a.events), dict(a._workspaces)
            out = run(*args, **kwargs)
            events = a.events[start:]
            if key is not None and a._workspaces == workspaces and kept_blocks(events) is not None:
                self._steps[key] = events
            return out

        optimizer.step = step
        try:
            yield kept
        finally:
            if own is None:
                del optimizer.step
            else:
                optimizer.step = own


def _restart(w: Workload, allocator, built) -> None:
    """Bring the simulated device back to the state it had after the build,
    where a fresh run of the next plan starts: no gradients, no optimizer
    state, no cuBLAS workspace, only what the build cached, and the clocks
    at the build's end (so a plan's seconds, differences of the clocks, are
    the same floats whichever plans ran before it). ``built``: the
    allocator model's copy and :meth:`~memprof.simulate.SimulatedAllocator.mark`, taken after the build."""
    model, (clock, busy) = built
    w.optimizer.zero_grad(set_to_none=True)
    w.optimizer.state.clear()  # made again by the plan's first step, as in a fresh run
    allocator.host = allocator.device = clock
    allocator.busy = busy
    if not allocator.rewind(model):
        allocator.empty_cache()
        log.debug("the device holds tensors made after the build: a plan's reserved memory may differ from its own run")


class _Repeats:
    """``Workload.repeats`` on the simulated GPU: micro-batches replayed, not run.

    Micro-batches run the same operators on the same shapes, so they ask the
    allocator for the same blocks in the same order and cost the same time,
    but for what the first one does first: autograd's ``AccumulateGrad``
    takes each incoming gradient as the parameter's ``.grad`` (a ``detach``,
    nothing copied) where later micro-batches add it into ``.grad`` (an
    ``add_`` kernel) and free it; and the first matrix products take cuBLAS's
    workspaces. So the first micro-batch runs with a hook after each
    gradient's accumulation, and its events (:attr:`SimulatedAllocator.events`)
    become a later one's: each ``detach`` before such a hook becomes an
    ``add_`` and the free of the gradient's block, the workspaces are not
    taken again. Where that accounts for every block the first one keeps,
    the derived events replayed on the allocator as it stands
    (:meth:`SimulatedAllocator.replay`) are each later micro-batch's,
    exactly (tests/test_advisor.py): one micro-batch runs.

    Otherwise the second runs too and, where it frees only blocks it made and
    keeps none, its events are replayed for the others; else, once
    micro-batch ``i`` starts from the layout micro-batch ``j`` started from,
    micro-batches ``j .. i-1`` repeat with period ``i - j``: whole periods are
    skipped, their time charged to the simulated clock, and the remainder
    runs, so the step ends in the layout a full run ends in.
    """

    def __init__(self, allocator, model: torch.nn.Module) -> None:
        self.allocator, self.model = allocator, model
        self._seen: dict[tuple, int] = {}
        self._starts: dict[int, tuple[float, float]] = {}  # micro-batch -> (simulated time, busy seconds)
        self._recording: tuple[int, bool, dict] | None = None  # where its events start, whether ours, workspaces
        #: The first micro-batch's accumulations: (events before, the gradient's handle, the gradient).
        self._grads: list[tuple[int, int | None, torch.Tensor]] = []
        self._hooks: list = []

    def __call__(self, i: int, n: int) -> int:
        a = self.allocator
        if i == 0:
            self._seen.clear()
            self._starts.clear()
            if n > 1 and a.trace is None:  # a trace wants every operator run
                self._record()
                self._grads.clear()
                self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                               for p in self.model.parameters() if p.requires_grad]
        elif i == 1 and self._recording is not None:
            for h in self._hooks:
                h.remove()
            first, workspaces = self._recorded()
            later = self._later(first, workspaces)
            self._grads.clear()
            if later is not None:
                for _ in range(n - 1):
                    a.replay(later)
                return n - 1
            if n > 2:
                self._record()
        elif i == 2 and self._recording is not None:
            second, workspaces = self._recorded()
            if kept_blocks(second) == set() and a._workspaces == workspaces:
                for _ in range(n - 2):
                    a.replay(second)
                return n - 2
        layout, now = a.model.layout(), (a.seconds, a.busy)
        j = self._seen.get(layout)
        if j is None:
            self._seen[layout], self._starts[i] = i, now
            return 0
        period = i - j
        cycles = (n - i) // period
        (seconds, busy), start = now, self._starts[j]
        a.charge(cycles * (seconds - start[0]), cycles * (busy - start[1]))
        self._seen.clear()  # the layouts seen map to other micro-batch numbers from here
        self._starts.clear()
        return cycles * period

    def _record(self) -> None:
        a = self.allocator
        ours = a.events is None
        if ours:
            a.events = []
        self._recording = len(a.events), ours, dict(a._workspaces)

    def _recorded(self) -> tuple[list, dict]:
        """The events since :meth:`_record`, and the workspaces there were then."""
        (first, ours, workspaces), self._recording = self._recording, None
        events = self.allocator.events[first:]
        if ours:
            self.allocator.events = None
        return events, workspaces

    def _accumulated(self, p: torch.Tensor) -> None:
        a = self.allocator
        with torch._C.DisableTorchFunction():  # the simulated device's mode is on in backward
            self._grads.append((len(a.events) - self._recording[0], a.handle(p.grad), p.grad))

    def _later(self, first: list, workspaces: dict) -> list | None:
        """A later micro-batch's events from the first's, or None where they cannot be derived."""
        with torch._C.DisableTorchFunction():  # no tensor it reads is the script's to see
            return self._derived(first, workspaces)

    def _derived(self, first: list, workspaces: dict) -> list | None:
        a = self.allocator
        kept = kept_blocks(first)
        if kept is None:
            return None  # it frees a block from before it
        taken = {h for h in a._workspaces.values() if h not in workspaces.values()}
        kept -= taken
        at: dict[int, tuple] = {}  # the detach before an accumulation -> its add_ and the free
        for n, h, grad in self._grads:
            if h not in kept or n == 0 or first[n - 1][0] != "o":
                return None  # a gradient copied into .grad, or added into one (not the first's)
            kept.discard(h)
            add = a.kernel_event(torch.ops.aten.add_.Tensor, (grad, grad), backward=True)
            at[n - 1] = (add, ("f", h))
        if kept:
            return None  # a block kept for later (a cache): the micro-batches after it do not make it
        later = []
        for n, e in enumerate(first):
            if n in at:
                later += at[n]
            elif not (e[0] == "m" and e[1] in taken):
                later.append(e)
        return later


def _step_view(report: Report, step: int) -> Report:
    """``report`` cut to one step's row and samples (what a plan's prediction reads)."""
    return replace(
        report,
        steps=report.steps[report.steps["step"] == step].reset_index(drop=True),
        timeline=report.timeline[report.timeline["step"] == step].reset_index(drop=True),
    )


def _adjusted(pred, strategies: list, baseline: Report, gpu: GPU):
    """``pred`` after each strategy accounts for what one rank's simulation does not run."""
    for s in strategies:
        pred = s.adjust(pred, baseline, gpu)
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
    jobs: int | None = None,
) -> Advice:
    """Rank plans for ``make_workload()`` under ``budget`` bytes of device memory per rank.

    ``make_workload`` must build a fresh :class:`Workload` each call (written for
    CUDA; it runs on the simulated ``target``, default: the budget's GPU, else
    an H100). A plan fits when its predicted peak reserved memory, plus
    ``margin`` of it for the simulation's error, is within the budget.
    Plans are simulated on as few builds as their strategies allow
    (:func:`simulate_plans`): one, unless some cannot be undone (pure bf16),
    in ``jobs`` forked processes (default: one per CPU, at most 8; 1: in
    this process).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    nbytes, named = parse_budget(budget)
    gpu = get_gpu(target) if target is not None else (named or get_gpu("H100-80GB"))
    plans = plans or default_plans(world_size, gpu=gpu)
    if "baseline" not in plans:  # every plan is judged against the step as it is
        plans = {"baseline": list, **plans}
    preds: dict[str, Any] = {}
    changes: dict[str, str] = {}
    with _progress(progress, len(plans)) as advance:
        baseline = _simulate_groups(make_workload, plans, gpu, steps, advance, jobs, preds)
        if baseline is not None and not isinstance(preds["baseline"], Exception):
            changes = {name: plan_changes(plan(), baseline) for name, plan in plans.items()}
            # Plans whose allocated memory fits but whose reserved memory does not: again with
            # expandable segments, which may reserve less (not always: strategies/allocator.py).
            extra = fragmented(preds, nbytes, margin, {name for name, c in changes.items() if c})
            if extra:
                advance.more(len(extra))
                _simulate_groups(make_workload, {n: plans[p] for n, p in extra.items()}, gpu, steps, advance, jobs,
                                 preds, expandable=True)
                plans = {**plans, **{n: _with_expandable(plans[p]) for n, p in extra.items()}}
                changes.update({n: changes[p] for n, p in extra.items()})  # the segments change no operator
    # One line per reason: a batch that accumulation cannot split fails every accumulation plan alike.
    failed: dict[str, list[str]] = {}
    for name, pred in preds.items():
        if isinstance(pred, Exception):
            failed.setdefault(f"{type(pred).__name__}: {pred}", []).append(name)
    for why, names in failed.items():
        log.warning("plan%s %s could not be simulated: %s", "s" * (len(names) > 1), ", ".join(names), why)
    if baseline is None or isinstance(preds["baseline"], Exception):
        raise RuntimeError("the baseline step could not be simulated; see the warnings above")
    rows = [(name, preds[name]) for name in plans if not isinstance(preds[name], Exception)]
    table = rank(rows, preds["baseline"], baseline, nbytes, margin, changes)
    return Advice(nbytes, gpu, world_size, table, baseline, plans)


def _simulate_groups(make_workload, plans: dict[str, PlanFactory], gpu: GPU, steps: int, advance, jobs,
                     preds: dict, expandable: bool = False) -> Report | None:
    """Simulate ``plans`` into ``preds``, grouped by the strategies that cannot be undone: each
    group is one build (``expandable``: each with expandable segments added). Returns the report
    of the step as it is, where a group has no such strategy."""
    from memprof.strategies import ExpandableSegments

    built = {name: factory() + [ExpandableSegments()] * expandable for name, factory in plans.items()}
    groups: dict[tuple, dict[str, list]] = {}
    for name, strategies in built.items():
        groups.setdefault(tuple(s.name for s in strategies if not s.revertible), {})[name] = strategies
    baseline = None
    for fixed, group in groups.items():
        base = [s for s in next(iter(group.values())) if s.name in fixed]
        report, got = simulate_plans(make_workload, group, gpu, steps=steps, base=base, advance=advance, jobs=jobs)
        baseline = report if not fixed else baseline
        preds.update(got)
    return baseline


def fragmented(preds: dict, budget: int, margin: float, changing: Collection[str] = ()) -> dict[str, str]:
    """Plans that would fit by their allocated memory but not by their reserved memory, and
    would be faster than every plan that fits, where expandable segments are not on already:
    ``{"<plan>+expandable": "<plan>"}``. Slower ones could not change the advice, nor, where a
    plan that trains the same model fits, the ``changing`` plans (see :func:`rerank`)."""
    if expandable_segments_configured():
        return {}
    ok = {name: p for name, p in preds.items() if not isinstance(p, Exception)}
    fits = {name: p.seconds for name, p in ok.items() if p.peak_reserved * (1 + margin) <= budget}
    inf = float("inf")
    same = min((t for name, t in fits.items() if name not in changing), default=inf)
    # A plan that trains the same model must beat the fastest that fits and does; one that changes the
    # training, where none such fits, the fastest that fits (else it would rank after them anyway).
    bar = {name: (min(fits.values(), default=inf) if same == inf else -inf) if name in changing else same
           for name in ok}
    return {("expandable" if name == "baseline" else f"{name}+expandable"): name
            for name, p in ok.items()
            if "expandable" not in name.split("+") and p.seconds < bar[name]
            and p.peak_allocated * (1 + margin) <= budget < p.peak_reserved * (1 + margin)}


def _with_expandable(factory: PlanFactory) -> PlanFactory:
    from memprof.strategies import ExpandableSegments

    return lambda: [*factory(), ExpandableSegments()]


#: The share of the step's time a plan must save to rank above the step as it is: less is not worth a
#: change to the script, and less than the time model can tell apart (median errors of 4-8 % per
#: workload, benchmarks/results/step-time.md).
KEEP = 0.02


def best_of(table: pd.DataFrame) -> str | None:
    """The first plan of a ranked table that fits, or None."""
    fits = table[table["fits"]]
    return None if fits.empty else str(fits.index[0])


def plan_changes(strategies: list, baseline: Report) -> str:
    """What a plan's ``strategies`` change in what training computes (:meth:`Strategy.changes`),
    for the step of the ``baseline`` report; "" for nothing."""
    coupling = baseline.meta.get("sample_coupling") or {}
    return "; ".join(filter(None, (s.changes(coupling) for s in strategies)))


def recommendation_notes(table: pd.DataFrame) -> list[str]:
    """What the recommendation (the best plan of a ranked ``table``) leaves aside: that it changes
    what training computes, where no plan that fits trains the same model, else a faster plan that
    fits and changes it; and plans that fit close behind it where the host bounds a step
    (:data:`CLOSE_CALL`)."""
    best = best_of(table)
    if best is None:
        return []
    return [note for note in (_changes_note(table, best), _close_call_note(table, best)) if note]


def _changes_note(table: pd.DataFrame, best: str) -> str:
    if "changes" not in table:
        return ""
    changes = table["changes"].fillna("")
    if changes[best]:
        return f"{best} changes what training computes, and no plan that fits trains the same model: {changes[best]}"
    t = table[table["fits"] & changes.astype(bool) & (table["seconds"] < table.at[best, "seconds"])]
    if t.empty:
        return ""
    alt = str(t["seconds"].idxmin())
    return (f"{alt} is {100 * (1 - t.at[alt, 'seconds'] / table.at[best, 'seconds']):.0f} % faster than {best} and "
            f"fits, but changes what training computes: {changes[alt]}")


def _close_call_note(table: pd.DataFrame, best: str) -> str:
    if "device_share" not in table:
        return ""
    # Plans that change what training computes are no alternative to one that does not (rerank).
    changes = _changing(table)
    host = table["device_share"] < HOST_BOUND
    t = table[table["fits"] & (changes == changes[best]) & (host | host[best])
              & (table["seconds"] <= table.at[best, "seconds"] * (1 + CLOSE_CALL))]
    close = [str(p) for p in t.index if p != best][:3]
    if not close:
        return ""
    behind = ", ".join(f"{p} ({100 * (t.at[p, 'seconds'] / table.at[best, 'seconds'] - 1):.0f} % slower)" for p in close)
    return (f"{best} and {behind} are close, and the host bounds a step among them (*): which is faster follows "
            "the host's speed on the day; measure them on the GPU (memprof advise --verify, memprof.verify)")


def _changing(table: pd.DataFrame) -> pd.Series:
    """Per plan of ``table``, whether it changes what training computes (its ``changes`` column)."""
    return table["changes"].fillna("").astype(bool) if "changes" in table else pd.Series(False, table.index)


def rank(rows: list, base, baseline: Report, budget: int, margin: float,
         changes: dict[str, str] | None = None) -> pd.DataFrame:
    """Plans as a table, best first: those that fit by predicted step time, then the rest by size.

    ``rows``: ``(name, Prediction)`` pairs; ``base``: the baseline's Prediction; ``changes``: what
    each plan changes in what training computes, where it does (:func:`plan_changes`).
    """
    changes = changes or {}
    table = pd.DataFrame(
        [
            {
                "plan": name,
                "peak_allocated": p.peak_allocated,
                "peak_reserved": p.peak_reserved,
                "seconds": p.seconds,
                "slowdown": p.seconds / base.seconds if base.seconds else float("nan"),
                "device_share": p.device_seconds / p.seconds if p.device_seconds is not None and p.seconds else float("nan"),
                "why": _why(name, p, base, baseline),
                "changes": changes.get(name, ""),
            }
            for name, p in rows
        ]
    ).set_index("plan")
    return rerank(table, budget, margin)


def rerank(table: pd.DataFrame, budget: int, margin: float = 0.05) -> pd.DataFrame:
    """``table`` (predicted peaks and seconds per plan) ranked for ``budget``:
    a plan fits when its peak reserved plus ``margin`` of it is within the budget.
    Plans that fit and change what training computes (a ``changes`` column) rank after
    those that fit and do not: a plan trains the same model or it is no alternative."""
    t = table.drop(columns="fits", errors="ignore")
    t.insert(2, "fits", t["peak_reserved"] * (1 + margin) <= budget)  # after the peaks, as before
    # The step as it is ranks first among plans less than KEEP faster (to the microsecond: a plan
    # that changes nothing the step runs): no change beats a change that buys (next to) nothing.
    us = (t["seconds"] * 1e6).round()
    if "baseline" in t.index:
        us["baseline"] = round(t.at["baseline", "seconds"] * (1 - KEEP) * 1e6)
    other = _changing(t)
    key = pd.DataFrame({"other": other, "us": us, "change": t.index != "baseline"}, index=t.index)
    fits = key[t["fits"]].sort_values(["other", "us", "change"], kind="stable").index
    return pd.concat([t.loc[fits], t[~t["fits"]].sort_values("peak_reserved", kind="stable")])


def _why(name: str, p, base, baseline: Report) -> str:
    peak = baseline.peak
    total = peak.allocated or 1
    top = max((c for c in peak.bytes if c in {x.value for x in Category} and c not in ("fragmentation", "non_pytorch")),
              key=lambda c: peak.bytes[c])
    # Temporaries where they are the most (a large vocabulary's loss outside the model: its logits, their
    # fp32 copy and log-probabilities), said as what they are (else the reason read "optimizer_state are
    # 18 %" where 67 % was the loss).
    what = "temporaries (what no module saves: the loss's tensors, the model's output)" if (
        top == Category.TEMPORARIES.value) else top
    share = f"{what} are {100 * peak.bytes[top] / total:.0f} % of the baseline peak"
    if name == "baseline":
        return f"{share} ({fmt_bytes(peak.allocated)} allocated at {peak.phase})"
    if "expandable" in name.split("+"):
        return (f"{share}; with expandable segments {name} reserves {fmt_bytes(p.peak_reserved - p.peak_allocated)} "
                "more than it allocates at its peak")
    delta = base.peak_allocated - p.peak_allocated
    verb = "removes" if delta >= 0 else "adds"
    return f"{share}; {name} {verb} {fmt_bytes(abs(delta))} of peak allocated"


class _progress:
    """A progress bar over ``total`` plans on ``console`` (a rich Console; True: the
    default one; False or None: no bar). The object entered is called with
    each plan's name when it is done, and its ``now(name)`` when one starts."""

    def __init__(self, console, total: int) -> None:
        self.console, self.total = console, total
        self._bar = None

    def __enter__(self):
        if not self.console:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = None if self.console is True else self.console
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=console, transient=True)
        self._bar.__enter__()
        self._task = self._bar.add_task("plans", total=self.total)
        return self

    def __call__(self, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"plans (done: {name})")

    def now(self, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"plans (now: {name})")

    def more(self, n: int) -> None:
        """``n`` plans more than first counted."""
        self.total += n
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)


#: Below this share of its step with the device busy, a plan's step is host-bound: the host
#: issuing kernels sets its pace, and the host's speed moves its measured time by up to 2x
#: between runs on the same machine (benchmarks/results/step-time.md), where a device-bound
#: step's moves by 2 %.
HOST_BOUND = 0.9
HOST_BOUND_NOTE = ("host-bound: the host issuing kernels, not the GPU, sets the pace (the GPU is idle for more than a "
                   "tenth of the step), so the host's speed moves this time, by up to 2x between runs")


#: Plans that fit within this of the recommended one's step time, where the host bounds a step
#: among them, are named next to it: two such plans' measured ratio moved by up to 16 % from its
#: prediction between days on the H200 (the Llama's bf16+ckpt over bf16+accum2, predicted 0.95,
#: measured 0.80, 0.87 and 1.09; benchmarks/results/README.md, the fifth day), so the prediction
#: cannot order plans closer than this.
CLOSE_CALL = 0.15


#: Marks a plan that changes what training computes (its ``changes``) in the plans' table.
CHANGES_MARK = "†"


def step_time(row) -> str:
    """A plan's predicted step time for display, ``*`` marking a host-bound step (:data:`HOST_BOUND`)."""
    return f"{1e3 * row['seconds']:.1f} ms" + ("*" if row.get("device_share", 1.0) < HOST_BOUND else "")


def plan_table(advice: "Advice", table: pd.DataFrame | None = None, where: str | None = None):
    """The ranked plans as a rich table that fits 80 columns: plan names whole,
    peak reserved (what must fit), the saving against the baseline, the step time."""
    from rich import box
    from rich.table import Table

    table = advice.table if table is None else table
    base = advice.table.loc["baseline"] if "baseline" in advice.table.index else None
    where = where or advice.gpu.name
    caption = ("fastest that fits first (the step as it is before plans less than 2 % faster); saves: peak "
               "reserved below the baseline (the step as it is)")
    if "device_share" in table and (table["device_share"] < HOST_BOUND).any():
        caption += f"\n* {HOST_BOUND_NOTE}"
    changing = _changing(table)
    if changing.any():
        caption += (f"\n{CHANGES_MARK} changes what training computes, so ranked after the plans that fit and do not: "
                    + what_changes(advice.baseline.meta.get("sample_coupling") or {}, "K") + " (K: its micro-batches)")
    t = Table(title=f"plans for {fmt_bytes(advice.budget)} per rank on {where}, {advice.world_size} rank(s)",
              caption=caption, title_justify="left",
              caption_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False)
    t.add_column("plan", no_wrap=True)
    for col in ("peak\nreserved", "saves\nvs now", "fits", "step\ntime", "vs\nnow"):
        t.add_column(col, justify="right", no_wrap=True)
    for name, r in table.iterrows():
        saved = "" if base is None or name == "baseline" else (
            f"{fmt_bytes(base['peak_reserved'] - r['peak_reserved'])} "
            f"{100 * (1 - r['peak_reserved'] / base['peak_reserved']):.0f}%")
        t.add_row(str(name) + f" {CHANGES_MARK}" * bool(changing[name]), fmt_bytes(r["peak_reserved"]), saved,
                  "yes" if r["fits"] else "no", step_time(r), f"{100 * (r['slowdown'] - 1):+.0f}%",
                  style=None if r["fits"] else "dim")
    return t


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
    when even the smallest batch does not fit. The search simulates each
    batch size untracked, the answer once more in full.
    """
    from memprof.strategies import Accumulation

    nbytes, named = parse_budget(budget)
    gpu = get_gpu(target) if target is not None else (named or get_gpu("H100-80GB"))
    # Micro-batches split the batch evenly: search multiples of their number.
    unit = 1
    for s in plan():
        if isinstance(s, Accumulation):
            unit *= s.k

    optimizer_steps = _OptimizerSteps()  # the parameters and gradients are the same at every batch size

    def fits(n: int, confirm: bool = False) -> bool:  # n units of batch
        make = lambda: make_workload(n * unit)  # noqa: E731
        reserved = (simulate_plan(make, plan, gpu).peak_reserved if confirm
                    else _peak_reserved(make, plan, gpu, optimizer_steps))
        return reserved * (1 + margin) <= nbytes

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
    while lo > 0 and not fits(lo, confirm=True):  # the answer, simulated in full with memprof.track
        log.warning("batch %d fits untracked but not in the full simulation; trying %d", lo * unit, (lo - 1) * unit)
        lo -= 1
    return lo * unit


def _peak_reserved(make_workload: Callable[[], Workload], plan: PlanFactory, gpu: GPU,
                   optimizer_steps: _OptimizerSteps | None = None) -> int:
    """A plan's predicted peak reserved bytes, as :func:`simulate_plan` gives them, without
    tracking: one step, the second derived from its events (:func:`_plan_counters`)."""
    from .simulate import SimulatedAllocator, _state_tensors
    from .virtual_cuda import VirtualCUDA

    strategies = plan()
    if not all(s.simulated for s in strategies):  # sharding adjusts the samples of a tracked step
        return simulate_plan(make_workload, lambda: strategies, gpu).peak_reserved
    allocator = SimulatedAllocator(gpu)
    with VirtualCUDA(gpu, allocator=allocator):
        with torch.device("meta"):
            w = make_workload()
        allocator.adopt(_state_tensors(w.model, w.optimizer))
        for s in strategies:
            s.apply_simulated(w)
        w.repeats = _Repeats(allocator, w.model)
        counters = _plan_counters(w, allocator, 2, optimizer_steps)
    return _peak_reserved(make_workload, plan, gpu) if counters is None else counters[1]


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
    ``steps``; ``measured_spread``: the slowest less the fastest of them, over
    the median; ``predicted_device_share``: below :data:`HOST_BOUND` the host
    bounds the step, and its measured time moves with the host's speed), and
    the measured saving against the measured baseline. A plan
    that runs out of memory is reported as such.

    The plans run one after another in this process, each on a fresh build
    with the cache emptied before it. Peak reserved can still differ from a
    run of the plan in a new process: the addresses the driver hands out
    for new segments decide which of two equal free blocks the caching
    allocator's best fit takes (GPT-2 124M with 4 micro-batches: 9.54 GiB
    after ten other plans, 8.74 GiB in a process of its own;
    benchmarks/results/README.md).
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
                "predicted_device_share": float(pred.get("device_share", float("nan"))),
                "measured_seconds": measured["seconds"],
                "measured_spread": measured["spread"],
                "fits_budget": measured["peak_reserved"] <= advice.budget,
            }
        )
    df = pd.DataFrame(rows).set_index("plan")
    if "measured_seconds" in df:
        df["time_error"] = df["predicted_seconds"] / df["measured_seconds"] - 1
    if base is not None and "measured_peak_reserved" in df:
        df["measured_saving"] = base["peak_reserved"] - df["measured_peak_reserved"]
        df["allocated_error"] = df["predicted_peak_allocated"] / df["measured_peak_allocated"] - 1
    return df


def _measure(make_workload, plan: PlanFactory, steps: int, warmup: int) -> dict:
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    strategies = plan()
    with ExitStack() as building:
        for s in strategies:  # the allocator's settings, before the build
            building.enter_context(s.building())
        w = make_workload()
        for s in strategies:
            s.apply(w)
        out = measure_steps(w, steps, warmup)
        del w
        gc.collect()
        torch.cuda.empty_cache()
    return out


def measure_steps(workload: Workload, steps: int, warmup: int, before: Callable[[], None] | None = None) -> dict:
    """Peak allocated and reserved CUDA memory over ``steps`` steps after
    ``warmup`` ones, the median step time and the steps' spread (slowest
    less fastest, over the median: where the host bounds a step it moves by
    itself); ``before`` runs once the warm-up is done (a barrier, with
    several ranks)."""
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
        "spread": _spread(times),
    }


def _spread(times: Sequence[float]) -> float:
    """How much measured step times move by themselves: (slowest - fastest) / median."""
    return (max(times) - min(times)) / statistics.median(times) if times else float("nan")
