"""The advisor on a step that a trainer runs (Lightning, Hugging Face ``Trainer``).

A trainer owns the training loop, so the advisor cannot take turns on it as
it does on a script; but a trainer's step has the parts of a
:class:`~memprof.workload.Workload`: its model, its optimizer, one real
batch and how a loss is computed from it (``training_step``,
``compute_loss``). :func:`advise_step` copies the model onto the simulated
GPU (weights as meta tensors: nothing is materialised), builds the same
optimizer over the copy, sets what the fit already does (its mixed
precision, its micro-batches) as the baseline, and ranks every plan with
:func:`memprof.advise`. The live model, its optimizer and its gradients are
never touched. Each plan is then phrased in the trainer's own terms
(:class:`memprof.strategies.base.Door`): ``Trainer(precision=...)``,
``TrainingArguments(gradient_accumulation_steps=...)``, ...
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd
import torch
from torch import nn
from torch.utils._pytree import tree_map

from .advisor import CHANGES_MARK, Advice, advise, default_plans, parse_budget, plan_table
from .devices import GPU, get_gpu
from .report import Report
from .script_advice import ScriptFacts, tensor_shapes, what_is_done
from .units import fmt_bytes
from .workload import Workload

__all__ = ["TrainerAdvice", "advise_step", "step_facts"]

log = logging.getLogger(__name__)

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainerAdvice(Advice):
    """Ranked plans for a trainer's step, with each plan's settings in the trainer's terms."""

    door: str = "script"
    facts: ScriptFacts | None = None
    #: Plans left out because the fit does that already: plan -> why.
    skipped: dict[str, str] = field(default_factory=dict)
    #: What the fit measured of itself (the tracked report), when there is one.
    measured: Report | None = field(default=None, repr=False)
    applied: dict[str, list] = field(default_factory=dict, repr=False)

    def settings(self, plan: str | None = None) -> list[str]:
        """What to set for ``plan`` (default: the best), one line per strategy."""
        plan = plan or self.best
        if plan is None or plan == "baseline":
            return []
        return [s.code_change(self.facts, self.door) for s in self.applied.get(plan) or self.plans[plan]()]

    def to_dict(self) -> dict:
        return {
            "door": str(getattr(self.door, "value", self.door)),
            "budget_bytes": self.budget,
            "target": self.gpu.name,
            "world_size": self.world_size,
            "best": self.best,
            "settings": self.settings(),
            "skipped": dict(self.skipped),
            "plans": self.table.reset_index().to_dict(orient="records"),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_dict` as JSON to ``path`` (atomically)."""
        from .report import _atomic_write, _json_default

        return _atomic_write(path, lambda f: json.dump(self.to_dict(), f, indent=1, default=_json_default))

    def __rich__(self):
        from rich.console import Group
        from rich.text import Text

        parts: list[Any] = []
        if self.facts is not None:
            parts.append(Text("the fit does now: " + "; ".join(self.facts.lines()[:4])))
        if self.measured is not None and self.measured.peak is not None:
            peak = self.measured.peak
            # The trainer numbers its steps its own way: the phase says where, the callback's log says when.
            parts.append(Text(f"measured so far: peak {fmt_bytes(peak.allocated)} allocated ({peak.phase}) "
                              f"on {self.measured.device}"))
        parts.append(plan_table(self, where=f"simulated {self.gpu.name}"))
        reasons: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            parts.append(Text(f"left out {', '.join(names)}: {why}", style="dim"))
        fits = [p for p in self.table.index[self.table["fits"]] if p != "baseline"][:3]
        if self.best == "baseline":
            parts.append(Text("the step fits as it is; the plans below it trade speed for memory", style="bold"))
        elif not fits:
            parts.append(Text(f"no plan fits {fmt_bytes(self.budget)} per rank", style="bold red"))
        for plan in fits:
            parts.append(Text(f"{plan}:", style="bold"))
            parts += [Text(f"  {line}") for line in self.settings(plan)]
            changes = self.table.at[plan, "changes"] if "changes" in self.table else ""
            if changes:
                parts.append(Text(f"  {CHANGES_MARK} changes what training computes: {changes}", style="yellow"))
        return Group(*parts)


def step_facts(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, *, autocast: str | None,
               micro_batches: int, checkpointed: Iterable[str] = ()) -> ScriptFacts:
    """What a trainer's step does now, in the script door's terms (for the plans' wording)."""
    named = batch if isinstance(batch, dict) else {f"argument {i}": t for i, t in enumerate(
        batch if isinstance(batch, (list, tuple)) else [batch])}
    return ScriptFacts.of(model, optimizer, autocast=autocast, micro_batches=micro_batches,
                          checkpointed=list(checkpointed), batch=tensor_shapes(named))


def advise_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget: int | str | GPU,
    *,
    door: str = "script",
    target: str | GPU | None = None,
    world_size: int = 1,
    autocast: str | None = None,
    micro_batches: int = 1,
    checkpointed: Iterable[str] = (),
    shared: Iterable[Any] = (),
    measured: Report | None = None,
    margin: float = 0.05,
    progress: bool = False,
) -> TrainerAdvice:
    """Rank plans for one step of a trainer under ``budget`` per rank, on a simulated ``target``.

    ``batch``: one micro-batch as the trainer feeds it; ``loss_fn(model,
    batch)`` its loss (the trainer's own ``training_step``/``compute_loss``).
    ``autocast`` ("bf16", "fp16") and ``micro_batches``: what the fit does
    now, the baseline every plan is compared with; ``checkpointed``: blocks
    the fit checkpoints already. ``shared``: objects the model refers to that
    are not copied with it (its trainer). Target: the budget's GPU, else this
    machine's GPU, else an H100.
    """
    from memprof.strategies import Autocast, Checkpointing, find_blocks

    if autocast not in (None, *_AUTOCAST):
        raise ValueError(f"autocast {autocast!r} is not one of {[None, *_AUTOCAST]}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    _, named = parse_budget(budget)
    gpu = get_gpu(target) if target is not None else named or _local_gpu() or get_gpu("H100-80GB")
    facts = step_facts(model, optimizer, batch, autocast=autocast, micro_batches=micro_batches,
                       checkpointed=checkpointed)
    # The optimizer's parameters by their place in the model, to build it again over the copy.
    where = {p: i for i, p in enumerate(model.parameters())}
    missing = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p not in where]
    if missing:
        raise ValueError(f"the optimizer holds tensors that are not the model's parameters (shapes {missing[:3]}); "
                         "memprof advises on an optimizer over the model's own parameters")
    groups = [[where[p] for p in g["params"]] for g in optimizer.param_groups]
    full_batch = tree_map(lambda t: torch.cat([t.detach()] * micro_batches) if isinstance(t, torch.Tensor)
                          and t.dim() > 0 and micro_batches > 1 else t, batch)
    shared = list(shared)

    def make() -> Workload:
        # On the simulated GPU .to("cuda") keeps meta tensors; it moves what the module tracks as
        # its device (a LightningModule's self.device, used to make tensors in training_step).
        clone = simulated_copy(model, shared).to("cuda")
        params = list(clone.parameters())
        opt = _rebuild(optimizer, [[params[i] for i in g] for g in groups])
        b = tree_map(lambda t: t.detach().cpu().to("cuda") if isinstance(t, torch.Tensor) else t, full_batch)
        w = Workload(clone, opt, b, loss_fn, micro_batches=micro_batches)
        if autocast is not None:
            Autocast(autocast).apply(w)
        return w

    plans = default_plans(world_size, gpu=gpu)
    skipped = what_is_done({n: f() for n, f in plans.items()}, facts, model, "fit")
    if not find_blocks(model):
        skipped.update({n: "the model has no repeated blocks to checkpoint" for n, f in plans.items()
                        if any(isinstance(s, Checkpointing) for s in f())})
    plans = {n: f for n, f in plans.items() if n not in skipped}
    # A simulated dropout draws from the host's generator: the fit's own masks must not change.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        advice = advise(make, budget, target=gpu, world_size=world_size, plans=plans, margin=margin, progress=progress)
        applied = _applied(make, advice)
    return TrainerAdvice(advice.budget, advice.gpu, world_size, advice.table, advice.baseline, advice.plans,
                         door=door, facts=facts, skipped=skipped, measured=measured, applied=applied)


def simulated_copy(model: nn.Module, shared: Iterable[Any] = ()) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (on
    the simulated GPU, the device memory they stand for): nothing is
    materialised, and the live model is not touched. ``shared`` objects (a
    trainer the module refers to) are referred to, not copied."""
    # deepcopy's memo is keyed by id(): pre-seeding it is how a copy is told what to reuse or replace.
    memo: dict[int, Any] = {id(o): o for o in shared}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    # memprof's own hooks on the live model (its tracker's) stay with it; the model's own hooks are copied.
    for m in model.modules():
        for hooks in vars(m).values():
            if isinstance(hooks, dict) and any(_ours(h) for h in hooks.values()):
                memo[id(hooks)] = copy.deepcopy(type(hooks)((k, h) for k, h in hooks.items() if not _ours(h)), memo)
    return copy.deepcopy(model, memo)


def _ours(hook: Any) -> bool:
    fn = getattr(hook, "func", hook)  # a functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    return callable(hook) and getattr(fn, "__module__", "").split(".")[0] == "memprof"


def _rebuild(optimizer: torch.optim.Optimizer, groups: list[list[nn.Parameter]]) -> torch.optim.Optimizer:
    """The same optimizer, same settings per group, over other parameters (no state)."""
    from memprof.strategies.zero import optimizer_settings

    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ps}
                    for g, ps in zip(optimizer.param_groups, groups)]
    try:
        return type(optimizer)(param_groups, **optimizer_settings(optimizer))
    except TypeError as exc:
        raise TypeError(f"memprof could not build {type(optimizer).__name__} again over a copy of the model "
                        f"({exc}); advise on a torch.optim optimizer") from None


def _applied(make: Callable[[], Workload], advice: Advice) -> dict[str, list]:
    """Each plan's strategies applied to a copy of the model (on meta, not run), so
    their wording can name what they found (the block classes, the block names)."""
    from .virtual_cuda import VirtualCUDA

    out = {}
    with VirtualCUDA(advice.gpu), torch.device("meta"):
        w = make()
        for name in advice.table.index:
            strategies = advice.plans[name]()
            try:
                with w.plan(strategies, simulated=True):
                    pass
            except Exception as exc:  # the wording then names no block
                log.debug("plan %s could not be applied for its wording: %s", name, exc)
            out[name] = strategies
    return out


def _local_gpu() -> GPU | None:
    if not torch.cuda.is_available():
        return None
    from .script_advice import _local_gpu as local

    return local()
