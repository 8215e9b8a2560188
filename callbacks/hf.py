"""``MemprofTrainerCallback``: :func:`memprof.track` around Hugging Face ``Trainer.train``.

::

    from transformers import Trainer
    from memprof.callbacks import MemprofTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    memprof_cb = MemprofTrainerCallback(trainer, budget="24GiB")   # budget: also advise
    trainer.add_callback(memprof_cb)
    trainer.train()
    memprof_cb.report.to_dataframe()     # also in <output_dir>/memprof.json
    memprof_cb.advice.settings()         # ['TrainingArguments(gradient_accumulation_steps=2, ...)']

The callback takes its trainer at construction: a ``TrainerCallback`` is not
given the trainer, and the metrics go through ``trainer.log`` so that they
reach ``state.log_history`` and every reporting integration (W&B,
TensorBoard, MLflow, ...). It therefore cannot be passed in
``Trainer(callbacks=[...])``, where the trainer does not exist yet.

One step of the report is one optimizer step (``gradient_accumulation_steps``
micro-batches): the tracker ends a step at the optimizer's step hook. Step
``k`` of the report is the trainer's global step ``offset + k + 1``, where
``offset`` is the global step this ``train()`` began at (0, or the step of a
checkpoint it resumed from): Hugging Face numbers a step once it is done.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised with transformers hidden
    raise ImportError(
        "memprof.callbacks.MemprofTrainerCallback needs Hugging Face transformers, which is not installed: "
        'pip install transformers (or pip install "memprof[hf]")'
    ) from exc

import torch
from torch import nn

from memprof.advisor import parse_budget
from memprof.devices import GPU, get_gpu
from memprof.report import Report
from memprof.tracker import Tracker, active_tracker, track

from .common import close_tracker, publish

if TYPE_CHECKING:
    from memprof.trainer_advice import TrainerAdvice

__all__ = ["MemprofTrainerCallback"]

log = logging.getLogger(__name__)

REPORT_FILE = "memprof.json"
ADVICE_FILE = "memprof-advice.json"


class MemprofTrainerCallback(TrainerCallback):
    r"""Attribute training memory with :func:`memprof.track` while ``Trainer.train`` trains.

    The tracker is entered at ``on_train_begin`` (after a checkpoint is
    restored and the model is prepared on its device) and left after the last
    training step (``on_step_end`` of the step at which the trainer stops),
    so that the evaluation, saving and logging after it are not a step of
    the report; ``report`` then holds the :class:`memprof.Report` of the
    latest ``train()`` that trained, on every rank.

    **When ``train()`` raises.** Hugging Face's callbacks have no hook for a
    failed ``train()``, so the constructor wraps ``trainer.train`` on that
    trainer instance (its class is untouched): when it raises, the tracker is
    left at once with the error, so no hook remains, an out-of-memory error
    writes what was live at that moment (``memprof-oom-<time>.json`` and
    ``.html`` in ``args.output_dir``, per rank under ``rank<N>`` with
    several) and logs it in one paragraph, the report of the steps before the
    error is saved and printed as at the end of training, and the error
    reaches the caller unchanged. A tracker still open at the next
    ``on_train_begin`` (``auto_find_batch_size`` retries a smaller batch
    inside ``train()`` after an out-of-memory error) is closed there, and its
    steps are dropped.

    **Logged metrics** (rank zero, through ``trainer.log``, so they land in
    ``trainer.state.log_history`` and every reporting integration, whenever
    a profiled step ends; floats, GiB = 2**30 bytes), at the global step of
    the profiled step:

    - ``memprof/peak_allocated_GiB``: the peak of the step just profiled;
      ``memprof/peak_reserved_GiB`` where the device reports it;
    - ``memprof/<category>_GiB`` for each category at that peak
      (``parameters``, ``gradients``, ``optimizer_state``, ``activations``, ...).

    Logging them does not change whether the trainer logs its own loss at
    that step.

    **Evaluation** is not a training step: an evaluation loop that runs
    between two training steps falls into the next step of the report (its
    forwards run without gradients, so they save no activations, but a
    larger evaluation batch can still raise that step's peak), and the
    evaluation after the last step is not tracked. If a callback after this
    one stops training in ``on_step_end``, or one stops it in
    ``on_evaluate``, the tracker is left at ``on_train_end`` instead, and
    an evaluation before that adds a last, partial row to the report.

    **Advice** (``advise=True`` or a ``budget``): after the ``warmup``
    steps of this ``train()`` (or at its last step if it is shorter), rank
    zero ranks memory plans for this step on a simulated ``target`` GPU
    (:func:`memprof.trainer_advice.advise_step`) and prints them as
    ``TrainingArguments`` settings (``bf16=True``,
    ``gradient_accumulation_steps`` with ``per_device_train_batch_size``,
    ``activation_checkpointing=True``, ``fsdp=``/``deepspeed=`` with offload
    for several ranks). The step is ``trainer.compute_loss`` on the keyword
    arguments of the model's first training forward in that step (one real
    micro-batch) with the run's optimizer, simulated on a meta copy of the
    model: the run's weights, gradients, optimizer and random state are not
    touched, and the tracker is paused meanwhile. What the run does already
    (``bf16``/``fp16``, ``gradient_accumulation_steps``, checkpointed
    layers) is the baseline. The advice is kept in ``advice`` and saved as
    ``<output_dir>/memprof-advice.json``. It takes a few seconds to a
    minute, during which the other ranks wait at their next collective.
    A run that shards its model already (FSDP, DeepSpeed) gets no advice,
    only a logged warning with what was measured: memprof advises on the
    unsharded model of a single-device or DDP run. Advice that fails is
    logged and training goes on.

    Args:
        trainer: the ``transformers.Trainer`` this callback is added to
            (``trainer.add_callback(MemprofTrainerCallback(trainer))``).
        warmup: steps profiled in full at the start (see :func:`memprof.track`).
        every: profile every ``every``-th step after the warmup; ``0``: none.
        log_metrics: log the breakdown of profiled steps through ``trainer.log``.
        save_report: write the report to ``<args.output_dir>/memprof.json``
            when training ends (or raises), atomically, on rank zero. Read it
            back with :meth:`memprof.Report.load`.
        print_report: print the report with rich when training ends, on rank
            zero; otherwise a one-line summary goes to :mod:`logging`.
        advise: rank memory plans for this run after the warm-up (above).
            Implied by ``budget``; needs ``budget`` or ``target``.
        budget: device memory per rank the plans must fit in (``"24GiB"``,
            bytes, or a GPU of the catalogue: its usable memory).
        target: the GPU simulated for the advice (default: the budget's GPU,
            else this machine's, else an H100); alone, its memory is the budget.
    """

    def __init__(
        self,
        trainer: Trainer | None = None,
        *,
        warmup: int = 3,
        every: int = 100,
        log_metrics: bool = True,
        save_report: bool = True,
        print_report: bool = True,
        advise: bool = False,
        budget: int | str | GPU | None = None,
        target: str | GPU | None = None,
    ) -> None:
        if trainer is None:
            # Also what Trainer(callbacks=[MemprofTrainerCallback]) ends in: HF instantiates a class without arguments.
            raise TypeError(
                "MemprofTrainerCallback needs the Trainer it logs through: build the Trainer first, then "
                "trainer.add_callback(MemprofTrainerCallback(trainer)); it cannot go in Trainer(callbacks=[...]), "
                "where the trainer does not exist yet"
            )
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"trainer must be a transformers.Trainer, got {type(trainer).__name__}; "
                "pass the Trainer you add this callback to: trainer.add_callback(MemprofTrainerCallback(trainer))"
            )
        for arg, value in (("warmup", warmup), ("every", every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{arg} must be an integer >= 0, got {value!r}")
        self.advise = bool(advise) or budget is not None
        if self.advise:
            if budget is None and target is None:
                raise ValueError(
                    'advise=True needs a budget or a target: MemprofTrainerCallback(trainer, budget="24GiB") or '
                    'MemprofTrainerCallback(trainer, advise=True, target="h100")'
                )
            # A bad value fails here, at setup, not after the warm-up steps.
            parse_budget(budget if budget is not None else target)
            if target is not None:
                get_gpu(target)
        self.trainer = trainer
        self.warmup = warmup
        self.every = every
        self.log_metrics = log_metrics
        self.save_report = save_report
        self.print_report = print_report
        self.budget = budget if budget is not None else target
        self.target = target
        #: The report of the latest ``train()`` that trained (``None`` before).
        self.report: Report | None = None
        #: The advice of the latest ``train()`` that asked for it (``None`` before, or on ranks other than zero).
        self.advice: TrainerAdvice | None = None
        self._tracker: Tracker | None = None
        self._unpublished: Report | None = None  # closed after the last step, saved and printed at on_train_end
        self._step_offset = 0  # state.global_step when tracking began (a resumed run)
        self._steps_seen = 0  # profiled steps before this one are logged already
        self._advise_pending = False
        self._capture: Any = None  # the forward pre-hook that takes the advised step's batch
        self._batch: tuple[tuple, dict] | None = None
        self._inputs: dict | None = None  # what compute_loss was given in the advised step
        _close_when_train_raises(trainer, self)

    # -- hooks -----------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state is not self.trainer.state:
            raise RuntimeError(
                "this MemprofTrainerCallback was built for another Trainer than the one training: pass the trainer you "
                "add it to: trainer.add_callback(MemprofTrainerCallback(trainer))"
            )
        if self._tracker is not None:  # an attempt of this train() that raised (auto_find_batch_size)
            log.info("memprof: closing the tracker of an interrupted training attempt; its steps are dropped")
            self._close(None)
        self._unpublished = None
        if self.advise:
            self.advice = None
        self._start(args, state, kwargs["model"], kwargs.get("optimizer"))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if (self._advise_pending and self._tracker is not None and state.is_world_process_zero
                and state.global_step - self._step_offset == self._advise_at(state) - 1):
            self._take_batch(kwargs["model"])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self._tracker is None:
            return
        self._log_profiled_step(state, control)
        if self._advise_pending and state.global_step - self._step_offset >= self._advise_at(state):
            self._advise_pending = False
            self._advise(args, state, kwargs["model"], kwargs.get("optimizer"))
        if control.should_training_stop or state.global_step >= state.max_steps:
            # The last step: what follows (the final evaluation, saving) is not a training step.
            self._unpublished = self._close(None)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if self._tracker is not None:  # training stopped where on_step_end could not see it
            self._unpublished = self._close(None)
        report, self._unpublished = self._unpublished, None
        if report is None:
            return
        if len(report.steps) == 0:
            log.warning(
                "memprof: this train() ran no training step (e.g. max_steps was already reached), so nothing was "
                "measured; `report` still holds the previous report, if any"
            )
            return
        self.report = report
        if state.is_world_process_zero:
            self._publish(report)

    # -- work ------------------------------------------------------------------
    def _start(self, args: TrainingArguments, state: TrainerState, model: nn.Module, optimizer: Any) -> None:
        self._step_offset = state.global_step
        self._steps_seen = 0
        self._advise_pending = self.advise
        # An out-of-memory error's breakdown goes where the trainer writes; one folder per rank.
        oom_dir = args.output_dir if args.world_size == 1 else os.path.join(args.output_dir, f"rank{args.process_index}")
        if active_tracker() is not None:  # memprof track train.py, or a track() block around train()
            log.warning("memprof: memprof is tracking this process already (memprof track, or a memprof.track block "
                        "around train()); MemprofTrainerCallback leaves the tracking and the report to it")
            self._advise_pending = False
            return
        opt = _torch_optimizer(optimizer)
        tracker = track(model, opt, device=args.device, warmup=self.warmup, every=self.every, oom_dir=oom_dir)
        tracker.__enter__()
        self._tracker = tracker

    def _advise_at(self, state: TrainerState) -> int:
        """Steps of this train() after which to advise: the warm-up, or all of a shorter run (at least one)."""
        return max(1, min(self.warmup, state.max_steps - self._step_offset))

    def _log_profiled_step(self, state: TrainerState, control: TrainerControl) -> None:
        peak = self._tracker.last_peak
        if peak is None or peak.step < self._steps_seen:
            return  # no profiled step ended since the last call
        self._steps_seen = peak.step + 1
        if not self.log_metrics or not state.is_world_process_zero:
            return
        metrics = {f"memprof/{name}": value for name, value in peak.metrics().items()}
        # trainer.log runs the callbacks' on_log, whose handler clears control.should_log: the
        # trainer's own logging of this step (decided in on_step_end, before us) must still happen.
        should_log = control.should_log
        self.trainer.log(metrics)
        control.should_log = control.should_log or should_log

    def _close(self, exception: BaseException | None) -> Report | None:
        """Leave the ``track`` block (hooks removed even if this raises); return its report."""
        self._remove_capture()
        self._batch = self._inputs = None
        tracker, self._tracker = self._tracker, None
        return None if tracker is None else close_tracker(tracker, exception)

    def _train_raised(self, exception: BaseException) -> None:
        """``trainer.train`` raised: leave the tracker and publish what was measured; never raises."""
        try:
            if self._tracker is not None:
                report = self._close(exception)
            else:  # closed after the last step; the error came later (evaluation, saving)
                report, self._unpublished = self._unpublished, None
            if report is None:
                return
            if len(report.steps) == 0:  # the first step failed: an out-of-memory error's breakdown is in its files
                log.warning("memprof: training raised %s before any step ended; nothing was measured",
                            type(exception).__name__)
                return
            self.report = report
            if self.trainer.state.is_world_process_zero:
                log.warning(
                    "memprof: training raised %s; the report covers the %d steps before it",
                    type(exception).__name__,
                    len(report.steps),
                )
                self._publish(report)
        except Exception:  # the error that stopped training is what the caller must see
            log.exception("memprof: could not close the tracker or save the report of the interrupted training")

    def _publish(self, report: Report) -> None:
        path = Path(self.trainer.args.output_dir) / REPORT_FILE if self.save_report else None
        publish(report, path, self.print_report, lambda k: f"global step {self._step_offset + k + 1}")

    # -- advice ----------------------------------------------------------------
    def _take_batch(self, model: nn.Module) -> None:
        """Keep the keyword arguments of the model's next training forward (``compute_loss``'s
        ``model(**inputs)``), and the inputs ``compute_loss`` was given: a subclass's own loss may
        take some out first (``labels = inputs.pop("labels")``, as Hugging Face's docs show)."""
        self._remove_capture()
        trainer = self.trainer
        compute_loss = trainer.compute_loss

        def take_inputs(model: nn.Module, inputs: dict, *args: Any, **kwargs: Any) -> Any:
            if self._inputs is None and model.training and torch.is_grad_enabled():
                self._inputs = dict(inputs)
            return compute_loss(model, inputs, *args, **kwargs)

        def take(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # Evaluation forwards (model.eval(), no grad) are not the training step's.
            if self._batch is None and module.training and torch.is_grad_enabled():
                self._batch = (args, dict(kwargs))
                self._remove_capture()

        self._capture = (model.register_forward_pre_hook(take, with_kwargs=True), vars(trainer).get("compute_loss"))
        vars(trainer)["compute_loss"] = take_inputs  # the instance's, over its class's

    def _remove_capture(self) -> None:
        capture, self._capture = self._capture, None
        if capture is not None:
            handle, own = capture
            handle.remove()
            if own is None:
                vars(self.trainer).pop("compute_loss", None)
            else:
                vars(self.trainer)["compute_loss"] = own

    def _advise(self, args: TrainingArguments, state: TrainerState, model: nn.Module, optimizer: Any) -> None:
        self._remove_capture()
        (batch, self._batch), (given, self._inputs) = (self._batch, None), (self._inputs, None)
        if not state.is_world_process_zero:
            return
        measured = self._tracker.report()
        peak = measured.peak
        seen = (f"measured so far: {peak.summary(f'global step {self._step_offset + peak.step + 1}')}"
                if peak is not None else "nothing measured yet")
        sharded = _sharded(self.trainer, args, model)
        if sharded:
            log.warning("memprof: no advice: the model is sharded already (%s), and memprof advises on the unsharded "
                        "model of a single-device or DDP run; %s", sharded, seen)
            return
        if batch is None or batch[0]:
            log.warning("memprof: no advice: %s; memprof advises on a step whose compute_loss calls model(**inputs); %s",
                        "no training forward of the model ran in the advised step" if batch is None
                        else "the model's forward was called with positional arguments", seen)
            return
        opt = _torch_optimizer(optimizer)
        if opt is None:
            log.warning("memprof: no advice: the optimizer (%s) is not a torch.optim.Optimizer; %s",
                        type(optimizer).__name__, seen)
            return
        # The count of the whole accumulated batch's tokens: the simulated steps use compute_loss's mean instead.
        inputs = {k: v for k, v in (given if given is not None else batch[1]).items() if k != "num_items_in_batch"}
        try:  # the run goes on whatever happens here
            advice = self._simulate(args, model, opt, inputs, measured)
        except Exception:
            log.exception("memprof: could not advise on this run's step; training goes on")
            return
        self.advice = advice
        from rich.console import Console

        Console().print(advice)
        try:
            path = advice.save(Path(args.output_dir) / ADVICE_FILE)
            log.info("memprof: advice saved to %s", path)
        except (OSError, TypeError, ValueError) as exc:
            log.warning("memprof: could not save the advice to %s: %s", args.output_dir, exc)

    def _simulate(self, args: TrainingArguments, model: nn.Module, optimizer: torch.optim.Optimizer,
                  inputs: dict, measured: Report) -> "TrainerAdvice":
        from memprof.strategies import find_blocks
        from memprof.trainer_advice import advise_step

        trainer = self.trainer
        blocks = find_blocks(model)
        # HF flags each checkpointed layer (every_n_layers may leave some out); older
        # models flag only their container, which then checkpoints every layer.
        checkpointed = [n for n, m in blocks if getattr(m, "gradient_checkpointing", False) is True]
        if not checkpointed and (_checkpointing_requested(args) or any(
                getattr(m, "gradient_checkpointing", False) is True for m in model.modules())):
            checkpointed = [n for n, _ in blocks]
        with self._tracker.paused():
            return advise_step(
                # A fresh dict each call: the subclass's compute_loss may pop from it.
                model, optimizer, inputs, lambda m, batch: trainer.compute_loss(m, dict(batch)), self.budget,
                door="hf", target=self.target, world_size=args.world_size,
                autocast="bf16" if args.bf16 else "fp16" if args.fp16 else None,
                micro_batches=args.gradient_accumulation_steps, checkpointed=checkpointed, shared=[trainer],
                measured=measured,
            )


def _close_when_train_raises(trainer: Trainer, callback: MemprofTrainerCallback) -> None:
    """Wrap ``trainer.train`` (this instance's attribute only) so that an error leaves no tracker open."""
    train = trainer.train

    @functools.wraps(train)
    def train_closing_memprof(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            callback._train_raised(exc)
            raise

    trainer.train = train_closing_memprof


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that steps, also inside accelerate's ``AcceleratedOptimizer`` (its
    ``optimizer``); None for another wrapper (DeepSpeed's), which the tracker then finds by itself."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        return None
    return optimizer


def _checkpointing_requested(args: TrainingArguments) -> bool:
    # activation_checkpointing is the newer name of gradient_checkpointing (transformers 5); either may be there.
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))


def _sharded(trainer: Trainer, args: TrainingArguments, model: nn.Module) -> str:
    """How the run shards its model already, or ``""``."""
    if getattr(trainer, "is_deepspeed_enabled", False) or args.deepspeed:
        return "DeepSpeed"
    if getattr(trainer, "is_fsdp_enabled", False) or args.fsdp:
        return "FSDP"
    if any(getattr(p, "device_mesh", None) is not None for p in model.parameters()):
        return "DTensor parameters"
    return ""

