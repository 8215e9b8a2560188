"""The advisor on an unmodified training script (``memprof advise train.py``).

A script's step is its own code, so plans cannot be composed from its parts
as :func:`memprof.advise` does with a :class:`~memprof.workload.Workload`.
Instead the script is run once per plan, on the simulated target GPU, and the
plan is applied to its model when the runner finds it:

* ``bf16``: the model's forward runs under ``torch.autocast("cuda", bfloat16)``
  (a loss computed outside the model stays as the script computes it);
* ``ckpt``: the repeated blocks' forwards go through ``torch.utils.checkpoint``;
* ``accumK``: each forward sees 1/K of every batch-sized input, which is the
  memory of one of K micro-batches; the step time is charged K times;
* ``offload_act``: what forward saves goes to host memory (simulated transfer);
* ``zeroS`` over N ranks: simulated on one rank, sharded analytically.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import pandas as pd
import torch
from torch import nn
from torch.utils._pytree import tree_map

from .advisor import best_of, parse_budget, rank
from .devices import GPU, get_gpu
from .report import Report
from .runner import ScriptError, observe_script
from .units import fmt_bytes
from .workload import Workload

__all__ = ["ScriptAdvice", "advise_script", "script_plans", "CODE_CHANGES"]

log = logging.getLogger(__name__)

#: What to write in the script (or set in Lightning / Hugging Face) for each part of a plan.
CODE_CHANGES = {
    "bf16": (
        "wrap the forward pass and the loss in `with torch.autocast('cuda', dtype=torch.bfloat16):` "
        "(Lightning: Trainer(precision='bf16-mixed'); Hugging Face: TrainingArguments(bf16=True))"
    ),
    "ckpt": (
        "checkpoint each repeated block: `block.forward = functools.partial(torch.utils.checkpoint.checkpoint, "
        "block.forward, use_reentrant=False)` for {blocks} (Hugging Face: model.gradient_checkpointing_enable())"
    ),
    "accum": (
        "split each batch into {k} micro-batches, divide each micro-batch's loss by {k}, call backward() on each "
        "and optimizer.step() once per {k} (Lightning: Trainer(accumulate_grad_batches={k}); "
        "Hugging Face: TrainingArguments(gradient_accumulation_steps={k}))"
    ),
    "offload_act": "run the forward pass under `with torch.autograd.graph.save_on_cpu(pin_memory=True):`",
    "zero": (
        "shard over {n} ranks: stage 1 with torch.distributed.optim.ZeroRedundancyOptimizer and DDP, stages 2/3 "
        "with torch.distributed.fsdp.fully_shard(block, reshard_after_forward=<stage == 3>) on each block and the "
        "model (Lightning: strategy='fsdp'; Hugging Face: fsdp='full_shard')"
    ),
}


def script_plans(world_size: int = 1) -> dict[str, list[str]]:
    """Plan name -> its parts, in the order they are applied."""
    plans: dict[str, list[str]] = {"baseline": []}
    for prec in ([], ["bf16"]):
        for ckpt in ([], ["ckpt"]):
            for accum in ([], ["accum2"], ["accum4"], ["accum8"]):
                parts = [*prec, *ckpt, *accum]
                if parts:
                    plans["+".join(parts)] = parts
        plans["+".join([*prec, "offload_act"])] = [*prec, "offload_act"]
    if world_size > 1:
        for stage in (1, 2, 3):
            for extra in ([], ["bf16"], ["bf16", "ckpt"]):
                parts = [*extra, f"zero{stage}"]
                plans["+".join(parts)] = parts
    return plans


def _apply(parts: Sequence[str], model: nn.Module, opt: torch.optim.Optimizer) -> None:
    from memprof.strategies import ActivationOffload, Checkpointing

    for part in parts:
        if part == "bf16":
            model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)
        elif part == "ckpt":
            Checkpointing().apply(Workload(model, opt, None, None))
        elif part.startswith("accum"):
            k = int(part[5:])
            model.register_forward_pre_hook(functools.partial(_micro_batch, k), with_kwargs=True)
        elif part == "offload_act":
            from .virtual_cuda import current

            w = Workload(model, opt, None, None)
            strategy = ActivationOffload()
            (strategy.apply_simulated if current() is not None else strategy.apply)(w)
            model.forward = _under(w.saved_tensors_hooks, model.forward)


def _under(make_context, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with make_context():
            return fn(*args, **kwargs)

    return wrapped


def _micro_batch(k: int, module: nn.Module, args: tuple, kwargs: dict):
    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] >= k and t.shape[0] % k == 0:
            return t[: t.shape[0] // k]
        return t

    return tree_map(cut, args), tree_map(cut, kwargs)


@dataclass
class ScriptAdvice:
    """What ``memprof advise`` found: the baseline report and the ranked plans."""

    script: str
    budget: int
    gpu: GPU
    world_size: int
    simulated: bool
    baseline: Report
    table: pd.DataFrame
    plans: dict[str, list[str]] = field(default_factory=dict)
    verified: pd.DataFrame | None = None

    @property
    def best(self) -> str | None:
        return best_of(self.table)

    def code_change(self, plan: str | None = None) -> list[str]:
        """The changes to make in the script for ``plan`` (default: the best)."""
        plan = plan or self.best
        if plan is None or plan == "baseline":
            return []
        blocks = self.baseline.meta.get("blocks") or ["the repeated blocks"]
        out = []
        for part in self.plans[plan]:
            if part.startswith("accum"):
                out.append(CODE_CHANGES["accum"].format(k=int(part[5:])))
            elif part.startswith("zero"):
                out.append(CODE_CHANGES["zero"].format(n=self.world_size))
            else:
                out.append(CODE_CHANGES[part].format(blocks=", ".join(blocks[:3]) + (", ..." if len(blocks) > 3 else "")))
        return out

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "script": self.script,
            "budget_bytes": self.budget,
            "target": self.gpu.name,
            "world_size": self.world_size,
            "simulated": self.simulated,
            "best": self.best,
            "code_change": self.code_change(),
            "plans": self.table.reset_index().to_dict(orient="records"),
            "verified": None if self.verified is None else self.verified.reset_index().to_dict(orient="records"),
            "baseline": self.baseline.to_dict(),
        }

    def __rich__(self):
        from rich.table import Table

        where = f"simulated {self.gpu.name}" if self.simulated else self.gpu.name
        t = Table(title=f"plans for {fmt_bytes(self.budget)} per rank ({where}, {self.world_size} rank(s)), fastest that fits first")
        for col in ("plan", "peak allocated", "peak reserved", "fits", "step time", "vs baseline"):
            t.add_column(col)
        for name, r in self.table.iterrows():
            t.add_row(str(name), fmt_bytes(r["peak_allocated"]), fmt_bytes(r["peak_reserved"]),
                      "yes" if r["fits"] else "no", f"{1e3 * r['seconds']:.1f} ms",
                      f"{100 * (r['slowdown'] - 1):+.0f} %", style=None if r["fits"] else "dim")
        return t


def _observe(path, args, steps, parts, gpu, simulate: bool, timeout, record: dict | None = None) -> Report:
    def on_model(model, opt):
        if record is not None:
            from memprof.strategies.zero import fsdp_units

            record.update(fsdp_units(model))
        _apply(parts, model, opt)
        # The untracked warm-up step ran without the plan: give back what it
        # cached, so the plan's reserved memory is its own.
        torch.cuda.empty_cache()

    return observe_script(
        path, args, steps=steps, warmup=1, timeout=timeout, on_model=on_model, target=gpu.name if simulate else None
    )


def _prediction(report: Report, parts: Sequence[str]):
    from memprof.strategies import Prediction

    # Each observed step ran one of K micro-batches: a real step runs K.
    k = 1
    for part in parts:
        if part.startswith("accum"):
            k *= int(part[5:])
    return Prediction.from_report(report, time_factor=k)


def advise_script(
    path: str,
    args: Sequence[str] = (),
    *,
    budget: int | str | GPU = "RTX4090-24GB",
    target: str | GPU | None = None,
    world_size: int = 1,
    steps: int = 2,
    margin: float = 0.05,
    timeout: float | None = None,
    progress: bool = True,
) -> ScriptAdvice:
    """Observe ``path`` and rank plans for it under ``budget`` (per rank).

    Simulated on ``target`` (default: the budget's GPU, else an RTX 4090) when
    no GPU is present or a target is named; measured on the local GPU otherwise
    (each plan is then run for real).
    """
    from memprof.strategies import ZeRO

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    nbytes, named = parse_budget(budget)
    simulate = target is not None or not torch.cuda.is_available()
    if target is not None:
        gpu = get_gpu(target)
    elif simulate:
        gpu = named or get_gpu("RTX4090-24GB")
    else:  # measured on this machine's GPU, whatever the budget names
        gpu = _local_gpu()
    record: dict = {}
    baseline = _observe(path, args, steps, [], gpu, simulate, timeout, record)
    if not simulate and not baseline.device.startswith("cuda"):
        raise ScriptError(
            f"the script trains on the {baseline.device}, not on this machine's GPU: memprof advises on CUDA training; "
            "run it the way it trains on a GPU (its device option after --), or add --target GPU to simulate one"
        )
    baseline.meta.update(record)
    base = _prediction(baseline, [])
    plans = script_plans(world_size)
    rows = [("baseline", base)]
    from .advisor import _progress

    with _progress(progress, len(plans) - 1) as advance:
        for name, parts in plans.items():
            if name == "baseline":
                continue
            runnable = [p for p in parts if not p.startswith("zero")]
            try:
                report = _observe(path, args, steps, runnable, gpu, simulate, timeout) if runnable else baseline
            except Exception as exc:  # a plan the script cannot run is left out, not fatal
                log.warning("plan %s could not run: %s", name, exc)
                advance(name)
                continue
            pred = _prediction(report, parts)
            for part in parts:
                if part.startswith("zero"):
                    pred = ZeRO(int(part[4:]), world_size).adjust(pred, baseline, gpu)
            rows.append((name, pred))
            advance(name)
    table = rank(rows, base, baseline, nbytes, margin)
    return ScriptAdvice(str(path), nbytes, gpu, world_size, simulate, baseline, table, plans)


def verify_script(advice: ScriptAdvice, args: Sequence[str] = (), *, top: int = 3, steps: int = 3) -> pd.DataFrame:
    """Run the best plans for real on the local GPU (the script's own step) and measure them."""
    if not torch.cuda.is_available():
        raise RuntimeError("--verify measures on a CUDA GPU and none is available here")
    names = ["baseline", *[n for n in advice.table.index[advice.table["fits"]] if n != "baseline"][:top]]
    rows = []
    for name in names:
        parts = [p for p in advice.plans[name] if not p.startswith("zero")]
        torch.cuda.empty_cache()
        try:
            r = _observe(advice.script, args, steps, parts, advice.gpu, False, None)
        except Exception as exc:
            rows.append({"plan": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        last = r.steps.iloc[-1]
        pred = advice.table.loc[name]
        rows.append({
            "plan": name,
            "predicted_peak_reserved": int(pred["peak_reserved"]),
            "measured_peak_reserved": int(last["peak_reserved"]),
            "predicted_peak_allocated": int(pred["peak_allocated"]),
            "measured_peak_allocated": int(last["peak_allocated"]),
            "fits_budget": int(last["peak_reserved"]) <= advice.budget,
        })
    advice.verified = pd.DataFrame(rows).set_index("plan")
    return advice.verified


def _local_gpu() -> GPU:
    from .devices import detect_gpu

    gpu = detect_gpu()
    if gpu is None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = GPU(props.name, props.total_memory, 2_000_000_000_000, True, None, None, 60.0, 32_000_000_000, None,
                  (props.major, props.minor))
    return gpu
