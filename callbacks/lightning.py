"""``MemprofCallback``: :func:`memprof.track` around Lightning's training loop.

::

    from lightning import Trainer
    from memprof.callbacks import MemprofCallback

    memprof_cb = MemprofCallback(save_path="memprof.json")
    trainer = Trainer(callbacks=[memprof_cb])
    trainer.fit(model)
    memprof_cb.report.to_dataframe()

Lightning calls ``optimizer.step(closure)`` on a ``LightningOptimizer`` whose
torch optimizer runs forward and backward inside its ``step``; the tracker
ends a step at that optimizer's (global) step hooks, so one step of the report
is one optimizer step: ``len(report.steps) == trainer.global_step`` for a fit
from scratch with one optimizer, gradient accumulation included (plus one
partial row when validation runs after the last step; see the class).
"""

from __future__ import annotations

import logging
import os
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks.callback import Callback
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as exc:  # pragma: no cover - exercised with lightning hidden
    raise ImportError(
        "memprof.callbacks.MemprofCallback needs Lightning, which is not installed: "
        'pip install lightning (or pip install "memprof[lightning]")'
    ) from exc

from typing_extensions import override  # a dependency of torch and of Lightning

from memprof.advisor import parse_budget
from memprof.devices import get_gpu
from memprof.report import Report
from memprof.trainer_advice import TrainerAdvice

from .common import close_tracker, publish
from memprof.tracker import Tracker, active_tracker, track

__all__ = ["MemprofCallback"]

log = logging.getLogger(__name__)


class MemprofCallback(Callback):
    r"""Attribute training memory with :func:`memprof.track` while ``Trainer.fit`` trains.

    The tracker is entered at ``on_train_start`` (after the sanity check and
    after a checkpoint is restored, with the model on its device) and left at
    ``on_train_end``; if training raises, at ``on_exception``, so no hook
    remains whatever happens. ``report`` then holds the
    :class:`memprof.Report` of the latest fit that trained, on every rank.

    **Logged metrics** (rank zero, to every logger of the trainer, whenever a
    profiled step ends; floats, GiB = 2**30 bytes; ``/`` is the logger's group
    separator):

    - ``memprof/peak_allocated_GiB``: the peak of the step just profiled;
      ``memprof/peak_reserved_GiB`` where the device reports it;
    - ``memprof/<category>_GiB`` for each category at that peak
      (``parameters``, ``gradients``, ``optimizer_state``, ``activations``, ...).

    They are written with ``logger.log_metrics`` at the trainer's step of the
    profiled step, not through ``LightningModule.log``, whose step metrics are
    only written every ``log_every_n_steps`` and would drop most profiled steps.

    **Steps.** A step of the report ends at the optimizer's step. A forward of
    the module after the last optimizer step (typically the end-of-epoch
    validation) opens one more step, which the report keeps as a last,
    partial row: ``len(report.steps)`` is then ``trainer.global_step + 1``.

    Args:
        warmup: steps profiled in full at the start (see :func:`memprof.track`).
        every: profile every ``every``-th step after the warmup; ``0``: none.
        log_metrics: log the breakdown of profiled steps to the trainer's loggers.
        save_path: write the report there as JSON when training ends (or
            raises: the steps measured before an out-of-memory error are often
            what you want), atomically, on rank zero. Read it back with
            :meth:`memprof.Report.load`. An out-of-memory error also writes
            what was live at that moment (``memprof-oom-<time>.json`` and
            ``.html`` in the trainer's ``default_root_dir``, per rank under
            ``rank<N>`` with several) and logs it in one paragraph; the
            error reaches the caller unchanged.
        print_report: print the report with rich when training ends, on rank
            zero; otherwise a one-line summary goes to :mod:`logging`.
        advise: after the warm-up steps (at the end of the fit if it is
            shorter), rank the memory plans for this fit's step and print
            them, on rank zero, as ``Trainer`` settings and module code
            (``precision="bf16-mixed"``, ``accumulate_grad_batches=2`` with
            the DataLoader's ``batch_size`` halved, checkpointing in
            ``configure_model``, ``FSDPStrategy``/``DeepSpeedStrategy`` for
            several devices). The step is the module's own ``training_step``
            on one real batch, with the optimizer of ``configure_optimizers``,
            simulated on a meta copy of the module
            (:func:`memprof.trainer_advice.advise_step`): the fit's weights,
            gradients and optimizer are not touched. What the fit does
            already (its precision, its accumulation) is the baseline.
            ``advice`` then holds the :class:`~memprof.trainer_advice.TrainerAdvice`.
            Implied by ``budget``; needs ``budget`` or ``target``.
        budget: device memory per rank the plans must fit in (``"24GiB"``,
            bytes, or a GPU of the catalogue: its usable memory).
        target: the GPU simulated for the advice (default: the budget's GPU,
            else this machine's, else an H100).
    """

    def __init__(
        self,
        warmup: int = 3,
        every: int = 100,
        log_metrics: bool = True,
        save_path: str | os.PathLike | None = None,
        print_report: bool = True,
        advise: bool = False,
        budget: int | str | None = None,
        target: str | None = None,
    ) -> None:
        for arg, value in (("warmup", warmup), ("every", every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{arg} must be an integer >= 0, got {value!r}")
        if save_path is not None and not isinstance(save_path, (str, os.PathLike)):
            raise TypeError(f"save_path must be a path or None, got {type(save_path).__name__}")
        self.advise = advise or budget is not None
        if self.advise:
            if budget is None and target is None:
                raise ValueError('advise=True needs a budget or a target: MemprofCallback(budget="24GiB") or '
                                 'MemprofCallback(advise=True, target="h100")')
            parse_budget(budget if budget is not None else target)  # a bad value fails here, not mid-fit
            if target is not None:
                get_gpu(target)
        self.budget = budget if budget is not None else target
        self.target = target
        #: The advice of the latest fit that asked for it (``None`` before).
        self.advice: TrainerAdvice | None = None
        self._watch = None  # what the step does (its checkpointed blocks), while the advised step runs
        self.warmup = warmup
        self.every = every
        self.log_metrics = log_metrics
        self.save_path = save_path
        self.print_report = print_report
        #: The report of the latest fit that trained (``None`` before).
        self.report: Report | None = None
        self._tracker: Tracker | None = None
        self._step_offset = 0  # trainer.global_step when tracking began (a resumed fit)
        self._steps_seen = 0  # profiled steps before this one are logged already
        self._trained = False  # whether this fit started tracking

    # -- hooks -----------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._reset()

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._log_profiled_steps(trainer)
        self._maybe_advise(trainer, pl_module, batch)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._finish(trainer)

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._end_of_fit(trainer)

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._finish(trainer, exception)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._finish(trainer)  # a safety net: normally closed at on_train_end already

    # -- work ------------------------------------------------------------------
    def _reset(self) -> None:
        """Start a fit afresh; a tracker left open by an aborted fit is closed, unsaved."""
        self._close(None)
        self.advice = None
        self._steps_seen = 0
        self._trained = False

    def _start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close(None)
        self._step_offset = trainer.global_step
        self._steps_seen = 0
        # An out-of-memory error's breakdown goes where the trainer writes; one folder per rank.
        oom_dir = trainer.default_root_dir if trainer.world_size == 1 else os.path.join(
            trainer.default_root_dir, f"rank{trainer.global_rank}")
        if active_tracker() is not None:  # memprof track train.py, or a track() block around the fit
            rank_zero_warn("MemprofCallback: memprof is tracking this process already (memprof track, or a "
                           "memprof.track block around fit); the callback leaves the tracking and the report to it")
            self._trained = True  # (trained, but not by this callback's tracking: no "ran no training step")
            return
        tracker = track(pl_module, device=pl_module.device, warmup=self.warmup, every=self.every, oom_dir=oom_dir)
        tracker.__enter__()
        self._tracker = tracker
        self._trained = True
        if self.advise and self.advice is None:
            from memprof.script_advice import _Watch

            # Which blocks the module checkpoints already shows in its steps (a forward run again in backward).
            self._watch = _Watch(pl_module, trainer.optimizers[0]) if trainer.optimizers else None

    def _log_profiled_steps(self, trainer: "pl.Trainer") -> None:
        tracker = self._tracker
        peak = tracker.last_peak if tracker is not None else None
        if peak is None or peak.step < self._steps_seen:
            return  # no profiled step ended since the last call
        self._steps_seen = peak.step + 1
        if not self.log_metrics or not trainer.loggers or not trainer.is_global_zero:
            return
        metrics = peak.metrics()
        for logger in trainer.loggers:
            sep = logger.group_separator
            logger.log_metrics({f"memprof{sep}{k}": v for k, v in metrics.items()}, step=self._step_offset + peak.step)

    def _maybe_advise(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any) -> None:
        """Advise once per fit, at the end of the warm-up steps (or of a shorter fit)."""
        if self._watch is None or self._tracker is None:
            return
        if trainer.global_step - self._step_offset < max(1, min(self.warmup, trainer.estimated_stepping_batches)):
            return
        watch, self._watch = self._watch, None
        checkpointed = watch.close().checkpointed
        if not trainer.is_global_zero:
            return
        try:  # the fit goes on whatever happens here
            with self._tracker.paused():
                self.advice = self._advise(trainer, pl_module, batch, checkpointed)
        except Exception:
            log.exception("memprof: could not advise on this fit's step")
            return
        if self.advice is not None:
            from rich.console import Console

            Console().print(self.advice)

    def _advise(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                checkpointed: list[str]) -> TrainerAdvice | None:
        from memprof.trainer_advice import advise_step

        measured = self._tracker.report()
        peak = measured.peak
        seen = f"; measured {peak.summary(f'step {self._step_offset + peak.step}')}" if peak is not None else ""
        strategy = type(trainer.strategy).__name__
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            rank_zero_warn(f"MemprofCallback: no advice for a fit with manual optimization or several optimizers{seen}")
            return None
        if "FSDP" in strategy or "DeepSpeed" in strategy or "ModelParallel" in strategy:
            rank_zero_warn(f"MemprofCallback: the fit shards its model already ({strategy}){seen}; memprof advises "
                           "on the unsharded model of a single-device or DDP fit")
            return None
        return advise_step(
            pl_module, trainer.optimizers[0], batch, _training_loss, self.budget, door="lightning", target=self.target,
            world_size=trainer.world_size, autocast=_AUTOCAST.get(str(trainer.precision)),
            micro_batches=trainer.accumulate_grad_batches, checkpointed=checkpointed, shared=[trainer],
            measured=measured,
        )

    def _close(self, exception: BaseException | None) -> Report | None:
        """Leave the ``track`` block (hooks removed even if this raises); return its report."""
        tracker, self._tracker = self._tracker, None
        if self._watch is not None:  # the fit ended before the advice
            self._watch.close()
            self._watch = None
        return None if tracker is None else close_tracker(tracker, exception)

    def _finish(self, trainer: "pl.Trainer", exception: BaseException | None = None) -> None:
        if self._tracker is None:
            return
        self.report = report = self._close(exception)
        if not trainer.is_global_zero:
            return
        if exception is None:
            self._publish(report)
            return
        # Never let a failure here replace the exception that stopped training.
        try:
            log.warning(
                "memprof: training raised %s; the report covers the %d steps before it",
                type(exception).__name__,
                len(report.steps),
            )
            self._publish(report)
        except Exception:
            log.exception("memprof: could not save or print the report of the interrupted fit")

    def _end_of_fit(self, trainer: "pl.Trainer") -> None:
        self._finish(trainer)
        if not self._trained:
            rank_zero_warn(
                "MemprofCallback: this fit ran no training step (e.g. max_steps was already reached), so nothing "
                "was measured; `report` still holds the previous fit's report, if any."
            )

    def _publish(self, report: Report) -> None:
        publish(report, self.save_path, self.print_report, lambda k: f"step {self._step_offset + k}")


# Lightning's precision setting -> the autocast it runs the step under.
_AUTOCAST = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


def _training_loss(module: "pl.LightningModule", batch: Any) -> Any:
    """``training_step``'s loss, on the simulated copy of the module."""
    # The copy refers to the live trainer: what it logs would land in the fit's own results.
    module.log = module.log_dict = _ignore
    out = module.training_step(batch, 0)
    loss = out.get("loss") if isinstance(out, dict) else out
    if loss is None:
        raise TypeError("training_step returned no loss (None, or a dict without 'loss'): memprof advises on a step "
                        "whose training_step returns its loss")
    return loss


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
