"""Observe an unmodified training script: ``memprof track train.py`` without editing ``train.py``.

The script runs in this process as ``python SCRIPT ARGS`` would run it
(``sys.argv = [SCRIPT, *ARGS]``, ``__name__ == "__main__"``, the script's
directory first on ``sys.path``, the working directory unchanged). Two
process-wide PyTorch hooks find what to measure:

* a module forward pre-hook remembers the *outermost* modules called (those
  called while no other module's forward runs), with a depth counter kept by a
  forward hook that runs even when a forward raises;
* an optimizer step post-hook sees the first optimizer step. The model is the
  outermost module holding most of that optimizer's parameters (the most
  recently called one on a tie), so a loss module called after the model, or a
  checkpointed block re-run in backward, is not taken for it.

Tracking (:func:`memprof.track` with every step profiled) starts when that
step's ``optimizer.step()`` returns: the step hooks cannot register more step
hooks while PyTorch iterates over them, so a one-shot profile function
(``sys.setprofile``) waits for the call to return. After ``steps`` tracked
steps a hook raises a private ``BaseException``, which a script's
``except Exception`` does not swallow, and the script stops there.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import weakref
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .frames import script_modules
from .hooks import transformed
from .report import Report
from .manual_steps import GradientWatch
from .tracker import _wrapped, Tracker, _uncompiled, track

__all__ = ["ScriptError", "observe_script", "raised"]

log = logging.getLogger(__name__)

_OPTIMIZER_FILE = sys.modules[register_optimizer_step_post_hook.__module__].__file__


class ScriptError(Exception):
    """The script could not be observed; the message says why and what to change.

    ``report`` holds what was measured before the failure (e.g. the steps before
    an out-of-memory error), or None when no step was tracked.
    """

    def __init__(self, message: str, report: Report | None = None) -> None:
        super().__init__(message)
        self.report = report


class _Stop(BaseException):
    """Raised from a hook to end the script. ``error``: why observing failed, or None when done."""

    def __init__(self, error: str | None = None, *, timed_out: bool = False) -> None:
        super().__init__(error)
        self.error, self.timed_out = error, timed_out


class _Observer:
    """The hooks that find the model and optimizer, start tracking and stop the script."""

    def __init__(self, steps: int, warmup: int, timeout: float | None, on_model=None, simulated: bool = False,
                 on_step=None, early: bool = False) -> None:
        self.steps, self.warmup = steps, warmup
        self.simulated = simulated
        # Track the steps before the model is known too (the first outermost
        # module is taken for it), only to explain an out-of-memory error there.
        self.early = early
        self._early: Tracker | None = None
        self.on_model, self.on_step = on_model, on_step
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.optimizer_steps = 0  # optimizer steps seen before tracking began
        # Before any optimizer steps: each outermost module's gradients, to see a loop that updates
        # the parameters itself (memprof.manual_steps), and the steps seen of such a loop.
        self._watches: weakref.WeakKeyDictionary[nn.Module, GradientWatch] = weakref.WeakKeyDictionary()
        self.manual_steps = 0
        self.tracker: Tracker | None = None
        self._seen_step = 0  # the tracker's step count when an optimizer step last ended one
        self.error: str | None = None  # a failure inside a hook, raised at the next one
        self._depth = 0
        self._seq = itertools.count()
        self._outermost: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self.spawned = 0  # processes the script started with torch.multiprocessing.spawn (a real GPU's run)
        self._pending: tuple[nn.Module, list[torch.optim.Optimizer]] | None = None
        # What the tracker follows: the models and their optimizers, in the order they step.
        self._trained: list[tuple[nn.Module, torch.optim.Optimizer]] = []
        self._root: nn.Module | None = None  # several models as one (the tracker holds it weakly)
        self._tracking = ExitStack()  # the tracker and its step hook: closed to start again
        self._previous_profile: Any = None
        self._profiling = False
        self._in_backward: list[torch.optim.Optimizer] = []  # optimizers stepped in the running backward
        self._deferred = False  # a step that ended inside backward waits for its end
        # Optimizers whose step runs (between their pre- and post-hooks), outermost first.
        self._stepping: list[torch.optim.Optimizer] = []
        self._stack = ExitStack()  # every hook and the tracker: closed in one place
        self.oom_files: tuple[Path, ...] | None = None  # an out-of-memory error's breakdown

    # -- lifetime --------------------------------------------------------------
    def install(self) -> None:
        self._stack.callback(self._restore_profile)
        self._stack.callback(self._tracking.close)
        self._stack.callback(self._unwatch)
        for handle in (
            register_module_forward_pre_hook(self._on_forward_pre),
            register_module_forward_hook(self._on_forward, always_call=True),
            # As Python even in a compiled optimizer step (see memprof.tracker).
            register_optimizer_step_pre_hook(torch.compiler.disable(self._on_step_pre)),
            register_optimizer_step_post_hook(torch.compiler.disable(self._on_step)),
        ):
            self._stack.callback(handle.remove)

    def close(self) -> None:
        """Exit the tracker and remove every hook (in reverse order of installation)."""
        self._stack.close()

    # -- hooks -----------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise _Stop(self.error)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _Stop(timed_out=True)

    def _on_forward_pre(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():  # inlined in a compiled region: the calls around it count
            return
        self._check()
        if self._depth == 0:
            self._outermost[module] = next(self._seq)
            if self.early and self._early is None and self.tracker is None and self._pending is None:
                self._watch_early(module, args)
            if self.optimizer_steps == 0 and not self._stepping and self.tracker is None and self._pending is None:
                self._depth += 1  # the forward hook takes it off again, also if tracking cannot start
                self._watch_manual(module, args)
                return
        self._depth += 1

    def _watch_manual(self, module: nn.Module, args: tuple) -> None:
        """Count the steps of a model trained without an optimizer (memprof.manual_steps),
        each seen where the model's next forward begins; tracking starts in the forward
        after the ``warmup``-th (the second at least)."""
        watch = self._watches.get(module)
        if watch is None:
            # A lazy module's parameters materialise in this forward (its own pre-hook runs after this one):
            # watched from the next forward, once they exist and take gradient hooks.
            if not any(nn.parameter.is_lazy(p) for p in module.parameters()):
                self._watches[module] = GradientWatch(module)
            return
        if not watch.stepped():
            return
        self.manual_steps += 1
        # Two at least: one forward and backward before training (a check that the loss goes
        # down, then zero_grad) is not taken for a loop without an optimizer.
        if self.manual_steps < max(self.warmup, 2):
            return
        self._unwatch()
        if self.simulated and not any(p.is_meta for p in module.parameters()):
            raise _Stop(_not_moved(module))
        self._trained = [(module, None)]
        self._pending = (module, [])
        self._start(args)

    def _unwatch(self) -> None:
        for watch in self._watches.values():
            watch.remove()
        self._watches.clear()

    def _watch_early(self, module: nn.Module, args: tuple) -> None:
        self.early = False  # once
        try:
            self._early = track(module, warmup=2**62, every=1, timeline_steps=1, history=1, full=True)._enter_in_forward(
                module, args)
        except Exception as exc:  # a best effort: the steps are tracked as usual once the model is found
            log.debug("no early tracking of %s: %s", type(module).__name__, exc)
            return
        self._stack.callback(self._end_early)

    def _end_early(self) -> None:
        if self._early is not None:
            early, self._early = self._early, None
            early.__exit__(_Stop, _Stop(), None)

    def record_oom(self, error: BaseException) -> tuple[Path, ...] | None:
        """Let the tracker in charge (the early one before the model is known) record ``error``; its files."""
        tracker = self.tracker or self._early
        if tracker is None:
            return None
        tracker.record_oom(error)
        return tracker.oom_files

    def _on_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self._depth = max(self._depth - 1, 0)

    def _on_step_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        # Forwards inside an optimizer's step are its closure's (L-BFGS evaluates the loss up to
        # max_eval times a step, zeroing the gradients each time): not steps of a loop without one.
        # (A step left by an exception the script caught ends where the same optimizer steps again.)
        self._stepping = _before(self._stepping, opt) + [opt]

    def _on_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._stepping = _before(self._stepping, opt)
        if transformed():  # captured in a CUDA graph: not run now
            return
        if self._stepping:
            # Inside another optimizer's step: a wrapper's base optimizer (timm's Lookahead, SAM's
            # base_optimizer), stepped by the wrapper, whose own step is the training step.
            return
        self._check()
        if torch._C._current_graph_task_id() != -1:
            # Stepped inside backward, as each gradient is made (torchtune's optimizer in backward,
            # one optimizer per parameter, stepped by post-accumulate-grad hooks): all of one
            # backward's optimizers are one step, taken where the backward ends.
            if not self._in_backward:
                _after_backward(sys._getframe(1), self._stepped_in_backward)
            self._in_backward.append(opt)
            return
        if self._pending is not None:
            return
        if self.tracker is not None:
            self._another_optimizer(opt)
        elif self._first_steps([opt]):
            self._start_after(sys._getframe(1))

    def _stepped_in_backward(self) -> None:
        """The backward in which optimizers stepped has ended: they step as one."""
        opts, self._in_backward = list(dict.fromkeys(self._in_backward)), []
        if self._pending is not None:
            return
        if self.tracker is None:
            if self._first_steps(opts):
                self._start()
            return
        new = [o for o in opts if not any(o is t for _, t in self._trained)]
        if new and self.on_model is None and self._trained[0][1] is not None:  # as _another_optimizer
            self._trained += [(self._trained[0][0], o) for o in new]
            self._pending = (self._trained[0][0], [o for _, o in self._trained])
            self._start()

    def _first_steps(self, opts: list[torch.optim.Optimizer]) -> bool:
        """A step of ``opts`` before tracking: whether tracking starts after it (the model found
        and pending with them, once the warm-up steps are done)."""
        self.optimizer_steps += 1
        self._unwatch()
        if self.optimizer_steps < self.warmup:
            return False
        model = self._find_model(opts[0] if len(opts) == 1 else _Together(opts))
        if self.simulated and not any(p.is_meta for p in model.parameters()):
            raise _Stop(_not_moved(model))
        self._trained = [(model, o) for o in opts]
        self._pending = (model, opts)
        return True

    def _another_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Another optimizer steps: over the same model (Muon for the matrices and
        AdamW for the rest, SparseAdam for embeddings) or over a model of its own (a
        GAN's generator after its discriminator). They train together, so the steps
        tracked so far are dropped and tracking starts again from the end of this
        call with every optimizer seen (this one ends each step) and every model
        (several as one ``nn.ModuleDict``). Plans (``on_model``) apply to one model
        and its optimizer: advice keeps the first model (its facts say what else trains), and
        tracks another optimizer over that model's own parameters with it if it steps before
        the first tracked step ends (Muon beside AdamW: its state is the model's)."""
        if any(opt is o for _, o in self._trained) or self._trained[0][1] is None:
            return  # (nor where the model trains without one: an optimizer of another model's is not its)
        if any(o is i for _, o in self._trained for i in _wrapped(opt)):
            # (A wrapper of a tracked optimizer, whose step PyTorch hooks from its first zero_grad on,
            # as timm's Lookahead does not call Optimizer.__init__: the tracker counts its state.)
            return
        if self.on_model is not None:
            model = self._trained[0][0]
            own = {id(p) for p in model.parameters()}
            if self.tracker is None or self.tracker.step or not all(
                    id(p) in own for group in opt.param_groups for p in group["params"]):
                return
            self._trained.append((model, opt))
            self._pending = (model, [o for _, o in self._trained])
            self._start_after(sys._getframe(2))
            return
        model = self._find_model(opt, quiet=True)
        if model is None:
            return
        self._trained.append((model, opt))
        model = self._as_one([m for m, _ in self._trained])
        self._pending = (model, [o for _, o in self._trained])
        self._start_after(sys._getframe(2))

    def _start_after(self, frame) -> None:
        """Start tracking once the optimizer.step() call running in ``frame`` returns:
        PyTorch is iterating over the step hooks, which must not change meanwhile."""
        stepping = _step_frame(frame)
        self._previous_profile = sys.getprofile()

        def on_return(frame, event: str, arg: Any) -> None:
            if event == "return" and frame is stepping:
                self._restore_profile()
                self._start()

        sys.setprofile(on_return)
        self._profiling = True

    def _on_tracked_step(self, *hook_args: Any, deferred: bool = False) -> None:
        # Registered after the tracker's own step hook (an optimizer's, or the forward pre-hook
        # that ends a step without one), so the step is recorded first. Every optimizer's step
        # and every forward calls it; a step ended only where the tracker's count moved (with
        # SGD and Adam over parts of one model, only one of them ends it). A step that ends
        # inside backward (optimizers stepped in it) is acted on where the backward ends: a
        # plan applied inside it would be undone with the engine's thread state.
        # (Deferred: at the end of the engine's graph task, which still runs, as a GPU's engine thread calls it.)
        if (self.tracker is not None and self.tracker.step != self._seen_step and not deferred
                and torch._C._current_graph_task_id() != -1):
            if not self._deferred:
                self._deferred = True
                _after_backward(sys._getframe(1), self._on_deferred_step)
            return
        if self.tracker is not None and self.tracker.step != self._seen_step:
            self._seen_step = self.tracker.step
            if self.tracker.step >= self.steps:
                raise _Stop()
            if self.on_step is not None:
                try:
                    go_on = self.on_step(self.tracker)
                except Exception as exc:
                    raise _Stop(f"memprof failed between steps {self.tracker.step} and {self.tracker.step + 1}: "
                                f"{type(exc).__name__}: {exc}") from exc
                if not go_on:
                    raise _Stop()
        self._check()

    # -- tracking --------------------------------------------------------------
    def _start(self, forward_args: tuple | None = None) -> None:
        """Track the pending model: from now, after an optimizer's step; with ``forward_args``,
        from inside the model's forward called with them (a model trained without an optimizer)."""
        model, opts = self._pending
        self._pending = None
        self._end_early()
        self._tracking.close()  # tracking one model of several: its unfinished step is dropped
        self.tracker = None
        try:
            if self.on_model is not None:  # e.g. the advisor applying a plan to the script's model
                self.on_model(model, opts[0] if opts else None)
            # (Made as Python too: the step may end inside a compiled function, see below.)
            tracker = torch.compiler.disable(track)(model, opts if len(opts) > 1 else opts[0] if opts else None,
                                                    warmup=self.steps, every=1, timeline_steps=self.steps, full=True)
            # As Python, even where the step returns inside a compiled function (torch.compile
            # of a function that steps the optimizer): Dynamo would trace memprof's own code.
            if forward_args is None:
                torch.compiler.disable(tracker.__enter__)()
            else:
                tracker._enter_in_forward(model, forward_args)
        except Exception as exc:  # e.g. the script already runs memprof.track itself
            self.error = f"memprof could not start tracking {type(model).__name__}: {exc}"
            return
        self.tracker, self._seen_step = tracker, tracker.step
        # An unfinished step (forwards after the last optimizer step) is no
        # training step: exit as if interrupted, which drops it.
        self._tracking.callback(tracker.__exit__, _Stop, _Stop(), None)
        on_step = torch.compiler.disable(self._on_tracked_step)
        if opts:
            self._tracking.callback(register_optimizer_step_post_hook(on_step).remove)
            optimizers = ", ".join(type(o).__name__ for _, o in self._trained)
            how = f"with {optimizers} from optimizer step {self.optimizer_steps + 1}"
        else:
            self._tracking.callback(register_module_forward_pre_hook(on_step).remove)
            how = f"without an optimizer (the script updates the parameters) from step {self.manual_steps + 1}"
        models = " and ".join(model.keys()) if model is self._root else type(_uncompiled(model)).__name__
        log.info("tracking %s %s", models, how)

    def _on_deferred_step(self) -> None:
        self._deferred = False
        self._on_tracked_step(deferred=True)

    def _restore_profile(self) -> None:
        if self._profiling:
            sys.setprofile(self._previous_profile)
            self._profiling, self._previous_profile = False, None

    def _as_one(self, models: list[nn.Module]) -> nn.Module:
        """The outermost of ``models``, several as one ``nn.ModuleDict`` (kept as the root, which the
        tracker holds weakly) by class name."""
        models = list(dict.fromkeys(c for m in models for c in (m.values() if m is self._root else [m])))
        models = [m for m in models if not any(m is not o and any(m is c for c in o.modules()) for o in models)]
        names: dict[str, nn.Module] = {}
        for m in models:
            name = type(_uncompiled(m)).__name__
            names[name if name not in names else f"{name}_{len(names)}"] = m
        self._root = nn.ModuleDict(names) if len(models) > 1 else None
        return self._root or models[0]

    def _find_model(self, opt: torch.optim.Optimizer, quiet: bool = False) -> nn.Module | None:
        """The outermost module called so far that holds most of ``opt``'s parameters
        (``quiet``: None if there is none, and no warning for a partial one). Where none
        holds them all, a module the training loop holds that does, though never called
        itself: a model trained through its methods (``model.score(u, i)``, CLIP's
        ``encode_image``), whose submodules are the modules called."""
        wanted = {id(p) for group in opt.param_groups for p in group["params"]}
        best, best_key = None, (0, -1)
        for module, seq in list(self._outermost.items()):
            held = sum(1 for p in module.parameters() if id(p) in wanted)
            if (held, seq) > best_key and held:
                best, best_key = module, (held, seq)
        if best_key[0] < len(wanted):
            for _, module in script_modules(sys._getframe(1)):
                held = sum(1 for p in module.parameters() if id(p) in wanted)
                if held == len(wanted) and any(any(c is m for c in module.modules()) for m in self._outermost):
                    # the smallest that holds them all
                    if best_key[0] < len(wanted) or sum(1 for _ in module.parameters()) < sum(
                            1 for _ in best.parameters()):
                        best, best_key = module, (held, -1)
        if best is not None and best_key[0] < len(wanted):
            # One optimizer over two models called apart (NeRF's coarse and fine networks):
            # the outermost modules called that hold the rest, tracked as one with it.
            found = {id(p) for p in best.parameters()} & wanted
            models = [best]
            for module in sorted(list(self._outermost), key=lambda m: -sum(id(p) in wanted for p in m.parameters())):
                more = {id(p) for p in module.parameters()} & wanted - found
                if more:
                    models.append(module)
                    found |= more
            if found == wanted:
                return self._as_one(models)
        if best is None and (copied := self._model_of_copy(opt, wanted)) is not None:
            return copied
        if best is None and self._outermost and not any(
                p.requires_grad for m in self._outermost for p in m.parameters()):
            # No module called trains: the optimizer steps what the model is given (style transfer's
            # and DeepDream's input image, an adversarial example) through a frozen model. That model
            # is the module called last, and the tensors stepped are the optimizer's own.
            model = max(self._outermost.items(), key=lambda item: item[1])[0]
            log.info("%s steps %d tensors that no module holds through %s, whose parameters are frozen: "
                     "tracked as the optimizer's own parameters (an input it optimizes)",
                     type(opt).__name__, len(wanted), type(_uncompiled(model)).__name__)
            return model
        if best is None and (skeleton := _skeleton(self._outermost)) is not None:
            # A model run functionally over the optimizer's tensors (the torch.func ensembles of
            # PyTorch's "Model ensembling" tutorial: functional_call of a base model moved to 'meta'
            # over stack_module_state's stacked copies): the module called, whose parameters hold
            # nothing, with the tensors the optimizer steps as its own.
            log.info("%s steps %d tensors that no module holds, through %s, whose parameters are on 'meta' "
                     "(torch.func.functional_call): tracked as the optimizer's own parameters",
                     type(opt).__name__, len(wanted), type(_uncompiled(skeleton)).__name__)
            return skeleton
        if best is None and quiet:
            return None
        if best is None and self._outermost:
            called = ", ".join(dict.fromkeys(type(_uncompiled(m)).__name__ for m in self._outermost))
            raise _Stop(
                f"{type(opt).__name__}.step() ran over {len(wanted)} tensors that are no parameters of the modules "
                f"the script called ({called}): memprof follows a model through its modules' parameters, and a "
                "model run functionally over tensors it does not hold (torch.func.functional_call over "
                "stack_module_state's stacked copies) is not one it can track"
            )
        if best is None:
            raise _Stop(
                f"{type(opt).__name__}.step() ran, but no module called before it holds the optimizer's parameters. "
                "memprof finds the model through nn.Module.__call__: call model(x), not model.forward(x)"
            )
        if best_key[0] < len(wanted) and not quiet:
            log.warning(
                "%s holds %d of the %d tensors %s optimizes; tracking it anyway",
                type(best).__name__, best_key[0], len(wanted), type(opt).__name__,
            )
        return best


    def _model_of_copy(self, opt: torch.optim.Optimizer, wanted: set[int]) -> nn.Module | None:
        """Where the optimizer steps tensors no module holds: the trainable module called or held by
        the loop with as many parameter elements, whose fp32 master copy they are (fairseq's
        FP16Optimizer steps one flat fp32 tensor, and the model runs inside the criterion)."""
        count = sum(p.numel() for group in opt.param_groups for p in group["params"])
        called = list(self._outermost)
        for module in [*called, *(m for _, m in script_modules(sys._getframe(2)) if m not in called)]:
            if sum(p.numel() for p in module.parameters() if p.requires_grad) == count:
                log.info("%s steps %d tensors that no module holds, as many numbers as %s trains: taken for "
                         "its master copy", type(opt).__name__, len(wanted), type(module).__name__)
                return module
        return None


def _skeleton(called: dict) -> nn.Module | None:
    """The module called last of those whose parameters are all on the 'meta' device (as the
    script sees them: no memory, a base model for torch.func.functional_call), or None."""
    skeletons = [(seq, m) for m, seq in list(called.items())
                 if (params := list(m.parameters())) and all(p.device.type == "meta" for p in params)]
    return max(skeletons, key=lambda item: item[0])[1] if skeletons else None


def _not_moved(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    where = first.device.type if first is not None else "host"
    return (f"{type(model).__name__} trains on the {where}, not on the simulated GPU: the script did not move it "
            "to CUDA (it may pick its device from an option or an environment variable); run it the way it "
            "trains on a GPU, e.g. pass its device option as 'cuda' after --")


class _Together:
    """Optimizers that step as one (one per parameter, in backward): their parameters, for finding the model."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.param_groups = [g for o in optimizers for g in o.param_groups]


_BACKWARD_FILES = {sys.modules[m].__file__ for m in ("torch._tensor", "torch.autograd", "torch.autograd.graph")}


def _after_backward(frame, then: Callable[[], None]) -> None:
    """Call ``then`` where the backward running ``frame`` ends: at the return of its outermost
    Python frame (``loss.backward()``) where this thread runs it (the CPU's, a simulated GPU's),
    else (a GPU's engine thread) at the end of the engine's graph task."""
    outer = None
    while frame is not None:
        if frame.f_code.co_filename in _BACKWARD_FILES and frame.f_code.co_name in (
                "backward", "grad", "_engine_run_backward"):
            outer = frame
        frame = frame.f_back
    if outer is None:
        torch.autograd.Variable._execution_engine.queue_callback(then)
        return
    previous = sys.getprofile()

    def on_return(f, event: str, arg: Any) -> None:
        if previous is not None:
            previous(f, event, arg)
        if event == "return" and f is outer:
            sys.setprofile(previous)
            then()

    sys.setprofile(on_return)


def _before(stepping: list, opt) -> list:
    """``stepping`` up to ``opt``'s step, which ends (or begins again), and those inside it."""
    i = next((i for i, o in enumerate(stepping) if o is opt), len(stepping))
    return stepping[:i]


def _step_frame(frame):
    """The outermost of the consecutive frames in torch/optim/optimizer.py, the ``step``
    wrapper, from the first at or above ``frame`` (the hooks are called through
    torch.compiler.disable's wrapper)."""
    while frame is not None and frame.f_code.co_filename != _OPTIMIZER_FILE:
        frame = frame.f_back
    outer = frame
    while frame is not None and frame.f_code.co_filename == _OPTIMIZER_FILE:
        outer, frame = frame, frame.f_back
    return outer


def _load(path: str | os.PathLike) -> Path:
    """The script's resolved path, after checking that it exists, reads and compiles."""
    script = Path(path)
    if not script.is_file():
        what = "is a directory" if script.is_dir() else "does not exist"
        raise ScriptError(f"script {str(path)!r} {what}: give the path of a Python training script, e.g. train.py")
    try:
        source = script.read_bytes()
    except OSError as exc:
        raise ScriptError(f"cannot read script {str(path)!r}: {exc.strerror or exc}; check its permissions") from None
    try:
        compile(source, str(script), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ScriptError(
            f"{path}:{exc.lineno}: syntax error in the script: {exc.msg}; fix it and run again "
            f"(python {path} shows the same error)"
        ) from None
    except ValueError as exc:  # e.g. null bytes in the source
        raise ScriptError(f"{str(path)!r} is not a Python script ({exc})") from None
    return script.resolve()


def _where(exc: BaseException, script: Path) -> str:
    """' (at train.py line 12)': the innermost frame of the script in the traceback, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == script]
    return f" (at {script.name} line {frames[-1].lineno})" if frames else ""


def raised(exc: BaseException, script: str | os.PathLike) -> str:
    """'the script raised AssertionError (at train.py line 73)': its message where it has one."""
    said = f": {exc}" if str(exc) else ""
    return f"the script raised {type(exc).__name__}{said}{_where(exc, Path(script).resolve())}"


def observe_script(
    path: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    steps: int = 3,
    warmup: int = 1,
    timeout: float | None = None,
    on_model: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None,
    on_step: Callable[[Tracker], bool] | None = None,
    target: str | None = None,
    oom: bool = True,
) -> Report:
    """Run a training script as ``python path *args`` would, and measure ``steps`` training steps.

    ``on_model(model, optimizer)``, if given, is called once they are found,
    before the tracked steps (the advisor applies a plan there);
    ``on_step(tracker)``, if given, after each tracked step, ends the
    observation early by returning False (the advisor changes plans there;
    the timeline keeps every tracked step). With
    ``target`` (a GPU of the catalogue) the script runs on that simulated GPU
    (``memprof.virtual_cuda``) and the report is a prediction; with ``oom``
    it runs out of memory where that GPU would (``torch.OutOfMemoryError``
    in the script), else it grows past the GPU's memory (the advisor's
    measure of what a plan needs).

    ``warmup`` optimizer steps run untracked first (at least 1: the first step
    is how the model and optimizer are found; Adam creates its state there),
    then ``steps`` steps are profiled in full and the script is stopped. The
    report's ``steps`` table has one row per tracked step.

    When the script ends, is interrupted (Ctrl-C) or runs past ``timeout``
    seconds after at least one tracked step, the steps measured so far are
    returned and a warning is logged; before one, Ctrl-C re-raises
    ``KeyboardInterrupt``. Every other failure raises :class:`ScriptError`
    saying what happened: no script, a syntax error, the script raising or
    exiting before a training step, no optimizer step at all.
    """
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}; e.g. {name}=3")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    script = _load(path)

    device, gpu = contextlib.nullcontext(), None
    if target is not None:
        from .devices import get_gpu
        from .simulate import SimulatedAllocator, usable_bytes
        from .virtual_cuda import VirtualCUDA

        gpu = get_gpu(target)
        device = VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu, capacity=usable_bytes(gpu) if oom else None),
                             script_meta=True)

    observer = _Observer(steps, warmup, timeout, on_model, simulated=gpu is not None, on_step=on_step,
                         early=oom)
    saved_argv, saved_path, saved_cwd, saved_env = sys.argv, list(sys.path), os.getcwd(), dict(os.environ)
    saved_switches = _switches()
    outcome: BaseException | None = None
    grouped = _process_group()
    try:
        sys.argv = [str(path), *map(str, args)]
        sys.path.insert(0, str(script.parent))
        with device:
            try:
                observer.install()
                try:
                    with _alarm(timeout), (_spawns(observer) if gpu is None else contextlib.nullcontext()):
                        runpy.run_path(str(path), run_name="__main__")
                except BaseException as exc:  # the script's own errors, exits and Ctrl-C, and our _Stop
                    outcome = exc
                    if isinstance(exc, torch.OutOfMemoryError):
                        observer.oom_files = observer.record_oom(exc)  # while what it failed on is still live
            finally:
                observer.close()  # every hook and the tracker, before the simulated device goes
                if _process_group() and not grouped:
                    # Stopped before its own destroy_process_group(): the next run (another plan,
                    # --verify) starts the script again, and a second init_process_group would fail.
                    torch.distributed.destroy_process_group()
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        if os.getcwd() != saved_cwd:
            os.chdir(saved_cwd)
        # What the script set (torchrun's variables, by os.environ.setdefault) is not the next run's.
        for key in os.environ.keys() - saved_env.keys():
            del os.environ[key]
        os.environ.update({k: v for k, v in saved_env.items() if os.environ.get(k) != v})
        _switches(saved_switches)
    return _result(observer, path, list(args), outcome, device if gpu is not None else None)


@contextlib.contextmanager
def _spawns(observer: "_Observer") -> Iterator[None]:
    """``torch.multiprocessing.spawn`` and ``start_processes`` as they are, counting the processes they
    start: those train where memprof's hooks, in this process, do not see (pytorch/examples' ImageNet's
    ``mp.spawn(main_worker, nprocs=ngpus_per_node)``). A simulated GPU runs the first in this process."""
    import torch.multiprocessing as mp

    originals = {name: getattr(mp, name) for name in ("spawn", "start_processes")}

    def counting(original: Callable) -> Callable:
        def started(fn: Callable, args: tuple = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
            observer.spawned += nprocs
            return original(fn, args, nprocs, *rest, **kwargs)
        return functools.wraps(original)(started)

    for name, original in originals.items():
        setattr(mp, name, counting(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(mp, name, original)


@contextlib.contextmanager
def _alarm(timeout: float | None) -> Iterator[None]:
    """Stop the script at ``timeout`` (and a second) where no hook of memprof's runs to see it: a
    script blocked waiting (``queue.get()`` for a batch a failed prefetching thread never puts).
    A signal interrupts a wait of the main thread; where there is no SIGALRM (Windows), where this
    is not the main thread, or where the process handles SIGALRM itself, the hooks' check alone."""
    usable = (timeout is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))
    if not usable:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _Stop(timed_out=True)

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout + 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _switches(saved: tuple | None = None) -> tuple:
    """PyTorch's process-wide switches a script sets for its run (TF32, cuDNN's autotuner and determinism,
    SDPA's kernels): read, or set back to ``saved``; they are not the next run's, nor the caller's. TF32
    through ``fp32_precision`` too where torch has it: once that API set it, ``allow_tf32`` and
    ``get_float32_matmul_precision`` raise ("mix of the legacy and new APIs") until the older one sets
    it again, so each is put back as it was, readable or not."""
    backends = torch.backends
    cuda, cudnn = backends.cuda, backends.cudnn
    levels = (backends, cuda.matmul, cudnn, cudnn.conv, cudnn.rnn) if hasattr(backends, "fp32_precision") else ()
    if saved is not None:
        precisions, legacy, cudnn.benchmark, cudnn.deterministic, flash, efficient, math = saved
        for level, value in zip(levels, precisions):
            level.fp32_precision = value
        if legacy is not None:
            cuda.matmul.allow_tf32, precision, cudnn.allow_tf32 = legacy
            torch.set_float32_matmul_precision(precision)
        cuda.enable_flash_sdp(flash)
        cuda.enable_mem_efficient_sdp(efficient)
        cuda.enable_math_sdp(math)
    try:
        legacy = (cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(), cudnn.allow_tf32)
    except RuntimeError:  # set through fp32_precision
        legacy = None
    return (tuple(level.fp32_precision for level in levels), legacy, cudnn.benchmark, cudnn.deterministic,
            cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())


def _process_group() -> bool:
    """Whether torch.distributed's default process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _result(observer: _Observer, path: str | os.PathLike, args: list[str], outcome: BaseException | None, device=None) -> Report:
    """The report, or the ScriptError that explains why there is none."""
    tracker, steps = observer.tracker, observer.steps
    done = tracker.step if tracker is not None else 0
    report = None
    if done:
        report = tracker.report()
        if device is not None:  # a simulated GPU
            report.source = "simulate"
            report.meta["target"] = device.gpu.name
            if device.notes:
                report.meta["simulation_notes"] = dict(device.notes)
        report.meta.update(script=str(path), script_args=args, warmup_steps=observer.warmup, observed_steps=done)
    needed = f"{observer.warmup} + {steps} training steps"

    if isinstance(outcome, _Stop) and outcome.error is not None:
        raise ScriptError(outcome.error, report)
    if isinstance(outcome, _Stop) and not outcome.timed_out:
        return report  # observed all steps
    if isinstance(outcome, KeyboardInterrupt) and report is None:
        raise KeyboardInterrupt
    exit_code = outcome.code if isinstance(outcome, SystemExit) else None
    failed = outcome is not None and not isinstance(outcome, (_Stop, KeyboardInterrupt, SystemExit))
    if isinstance(outcome, SystemExit) and exit_code not in (None, 0):
        msg = f"the script exited with status {exit_code!r}"
        if report is None:
            raise ScriptError(
                f"{msg} before memprof could observe a training step; check the script's arguments "
                "(memprof passes those given after --)"
            )
        raise ScriptError(f"{msg} after {done} of {steps} tracked steps", report)
    if isinstance(outcome, torch.OutOfMemoryError):
        where = _where(outcome, Path(path).resolve())
        gpu = f"the simulated {device.gpu.name}" if device is not None else "the GPU"
        when = f"in tracked step {done}" if tracker is not None else "before the first tracked step"
        files = observer.oom_files
        said = (f"what was live then, by category and module, is in {' and '.join(map(str, files))}" if files else
                f"{outcome}; `memprof advise` with this GPU as the budget simulates what each plan needs and which fit")
        raise ScriptError(f"the script ran out of memory on {gpu}{where} {when}; {said}", report) from outcome
    if failed:
        what = raised(outcome, path)
        if report is None:
            raise ScriptError(f"{what}; memprof could not observe a training step") from outcome
        raise ScriptError(f"{what} after {done} of {steps} tracked steps", report) from outcome

    # The script ended, timed out or was interrupted without error.
    if report is None:
        if isinstance(outcome, _Stop):
            raise ScriptError(
                f"no training step finished within the timeout ({observer.optimizer_steps or observer.manual_steps} training steps seen, "
                f"{needed} needed); give a longer timeout or make the script step sooner"
            )
        if observer.optimizer_steps == 0 and observer.manual_steps == 0 and tracker is None and observer.spawned:
            raise ScriptError(
                f"the script ended without a training step in this process: it trained in {observer.spawned} "
                "process(es) it started with torch.multiprocessing.spawn, which memprof does not follow (its hooks "
                "are in this process); `memprof track --target GPU` runs the first of them in this process on a "
                "simulated GPU; to measure on a GPU, run the script without spawning (one process: pytorch/examples' "
                "ImageNet without --multiprocessing-distributed, with --gpu 0) or use memprof.track inside the "
                "function it spawns"
            )
        if observer.optimizer_steps == 0 and observer.manual_steps == 0 and tracker is None:
            raise ScriptError(
                "the script ended without a training step, so memprof found no model to observe: no torch.optim "
                "optimizer stepped, and no model was called again after a backward reached its parameters and "
                "their gradients were reset (a loop that updates them itself); memprof observes training loops "
                "that call loss.backward() and then optimizer.step(), or update the parameters and zero their "
                "gradients before the next forward"
            )
        raise ScriptError(
            f"the script ended before a tracked step finished; memprof needs {needed}: "
            "run the script for more steps (pass its arguments after --)"
        )
    why = {KeyboardInterrupt: "was interrupted", _Stop: "timed out"}.get(type(outcome), "ended")
    log.warning("the script %s after %d of %d tracked steps; reporting those", why, done, steps)
    return report
