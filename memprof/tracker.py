"""``memprof.track``: live attribution of training memory.

How it stays cheap. A training step is bound by Python launching kernels when
the GPU is fast, so every microsecond spent in a hook shows. The tracker
therefore works in two gears:

* every step, it reads the allocator's counters once, at the step's end (peak
  allocated and reserved since the previous step) and nothing else runs;
* on *profiled* steps (the first ``warmup`` steps, then every ``every``-th),
  it installs global module hooks, a saved-tensors hook, gradient hooks and
  autograd-node hooks, samples the counters at every module boundary of
  forward and backward, and attributes every live storage to a category and a
  module. Those hooks are removed again at the step's end.

Each sample closes an interval named by its phase (``report.Phase``). The
module table is the ledger at the peak's moment, rebuilt once at the step's
end from the ledger's journal, so finding it costs the samples nothing.

A profiled step keeps thousands of Python objects alive until its end
(ledger entries, hooks on autograd nodes), and every such object brings
Python's next full garbage collection closer: a scan of the whole heap, a few
hundred ms in a large model's process. So the ledger's entries are tuples the
collector does not track, and one bound method serves every node's hook.

Memory in a steady training loop repeats step after step, so profiling a few
steps explains all of them; ``report().steps`` shows every step's peak, so a
step that drifts from the profiled ones is visible.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import time
import weakref
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import pandas as pd
import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakTensorKeyDictionary

from .allocator import counters_for
from .categories import ALLOCATED, Category
from .coupling import sample_coupling
from .frames import script_variables
from .hooks import Shared, in_torch_func, transformed
from .ledger import Ledger
from .manual_steps import GradientWatch
from .report import MODULE_CATEGORIES, MODULE_COLUMNS, STEP_COLUMNS, Breakdown, Phase, Report

__all__ = ["Tracker", "active_tracker", "own_forward", "track"]

log = logging.getLogger(__name__)

# The categories the ledger attributes: all but temporaries.
_NAMED = tuple(c for c in ALLOCATED if c is not Category.TEMPORARIES)
_TIMELINE_ROWS_PER_STEP = 50_000
_BATCH_SHAPES = 8  # the most distinct batch shapes a report lists
_OWN = "the optimizer's own"  # the detail of parameters the optimizer holds and no module does

# The tracker whose hooks are installed, if any: module and optimizer hooks are
# process-global, so two trackers would see (and reset the counters of) each
# other's steps.
_active: weakref.ref | None = None


def active_tracker() -> "Tracker | None":
    """The ``track`` block open in this process, if any (one at a time: see Tracker.__enter__)."""
    return _active() if _active is not None else None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in a module's inputs or outputs (one level of containers, and HF ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                yield o
    elif isinstance(obj, dict):  # also HF ModelOutput, an OrderedDict
        for o in obj.values():
            if isinstance(o, torch.Tensor):
                yield o


def own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class has a forward of its own (a container such as nn.ModuleDict has not).
    Read from the class without running descriptors: a TorchScript module's forward is one that
    raises when read from its class (torch.jit's ``_CachedForward``)."""
    return inspect.getattr_static(type(module), "forward", None) is not nn.Module.forward


def _hook_nodes(todo: list, hook: Callable, keep: Callable[[Any], bool]) -> None:
    """``hook`` on the autograd nodes from ``todo`` down, as far as ``keep(node)`` holds."""
    _walk_nodes(todo, lambda node: node.register_hook(hook), keep)


def _walk_nodes(todo: list, visit: Callable, keep: Callable[[Any], bool]) -> None:
    """``visit`` each autograd node from ``todo`` down, as far as ``keep(node)`` holds."""
    seen = set(todo)
    while todo:
        node = todo.pop()
        # AccumulateGrad's output is a parameter's .grad (_on_grad_accumulated
        # names it), and it has no next functions. By its type's name:
        # hasattr(node, "variable") raises and catches an error at every other node.
        if type(node).__name__ != "AccumulateGrad" and keep(node):
            visit(node)
            for n, _ in node.next_functions:
                if n is not None and n not in seen:
                    seen.add(n)
                    todo.append(n)


def _leaves(obj: Any) -> list[torch.Tensor]:
    """Every tensor in the root's inputs, however nested: DINO's list of crops, DETR's per-image
    target dicts (storages recorded already keep their category: a carried state stays activations)."""
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _on_first_grad(obj: Any, fn, handles: list) -> list[torch.Tensor]:
    """Call ``fn`` when backward reaches the first of ``obj``'s tensors that need grad.

    A hook on a tensor made in the step dies with the step's graph. A hook on
    a leaf (an input that needs grad, a parameter passed to a module) lives
    as long as the leaf, so one would pile up at every profiled step and
    outlive the block: its handle goes to ``handles``, removed at the step's end.
    """
    tensors = [t for t in _tensors(obj) if t.requires_grad]
    if len(tensors) == 1:  # the common case; a plain tensor hook costs a third of a multi-grad hook
        handle = tensors[0].register_hook(fn)
    elif tensors:
        handle = register_multi_grad_hook(tensors, fn, mode="any")
    else:
        return tensors
    if any(t.is_leaf for t in tensors):
        handles.append(handle)
    return tensors



def _wrapped(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers ``opt`` holds and steps inside its own step, whose state is the step's too:
    a wrapper's base optimizer (timm's ``Lookahead(RAdam)``, SAM's ``base_optimizer``)."""
    found = []
    for value in vars(opt).values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.optim.Optimizer) and v is not opt and not any(v is f for f in found):
                found += [v, *_wrapped(v)]
    return found


def _state_tensors(value: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of one optimizer state value: a tensor (Adam's ``exp_avg``), or a list of them
    (L-BFGS's curvature history ``old_dirs``, ``old_stps``, which grows to ``history_size``)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, torch.Tensor))
    return ()

def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that holds ``t``'s bytes on this process: for a sharded
    DTensor (FSDP2), the local shard's, not the global tensor's."""
    cls = type(t)
    if cls is torch.Tensor or cls is nn.Parameter:  # most tensors: a failed getattr costs more than all else here
        try:
            return t.untyped_storage()
        except NotImplementedError:
            if t.layout is torch.strided:
                raise
            # A sparse tensor (an nn.Embedding(sparse=True) gradient) has no storage of its own:
            # its values' stand for it (the indices, 8 bytes per stored row, go uncounted).
            return (t._values() if t.is_sparse else t.values()).untyped_storage()
    if t.layout is torch.jagged:  # a nested jagged tensor: its values hold its bytes (its own storage stands in)
        return _storage(t._values)
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).untyped_storage()


def _parts(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """Every storage that holds ``t``'s bytes: a sparse tensor's indices as well as its values
    (a graph's adjacency passed to the model: its indices are four fifths of it)."""
    if t.layout is torch.sparse_coo:
        return [t._indices().untyped_storage(), t._values().untyped_storage()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices().untyped_storage(), t.col_indices().untyped_storage(), t.values().untyped_storage()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices().untyped_storage(), t.row_indices().untyped_storage(), t.values().untyped_storage()]
    return [_storage(t)]


def _top_saved_tensors_hooks():
    """The saved-tensors hooks active now (e.g. ``save_on_cpu``), to chain to."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _checkpoint_frame() -> type | None:
    """torch.utils.checkpoint's frame class, whose ``save_inputs`` keeps a non-reentrant
    checkpoint's inputs for its recomputation; None where this torch has none."""
    import torch.utils.checkpoint as checkpoint

    cls = getattr(checkpoint, "_CheckpointFrame", None)
    return cls if cls is not None and "save_inputs" in vars(cls) else None


def _seconds(spans: list[tuple[Any, Any]]) -> float:
    """A step's seconds from its (start, end), less its evaluations' (start, end) after it:
    clock readings, or CUDA events the device has passed."""
    (start, end), *evaluations = spans
    if isinstance(end, (int, float)):
        return end - start - sum(e - s for s, e in evaluations)
    return (start.elapsed_time(end) - sum(s.elapsed_time(e) for s, e in evaluations)) / 1000


class _Span:
    """A module's forward or backward in a profiled step: where it began, its highest point."""

    __slots__ = ("name", "start", "high", "ends")

    def __init__(self, name: str, start: int) -> None:
        self.name, self.start, self.high = name, start, start
        self.ends = False  # a forward's: whether backward's reaching its inputs is hooked


class _Plan:
    """What full profiles found, for the cheap profiled steps after them.

    A step repeats the one before it. Once two full profiles (the counters
    read at every sample) peak in the same interval, the next profiled steps
    read the counters only at that interval's two samples (``bracket``: each
    an event and its occurrence in the step) and at the step's coarse
    moments (the root's forward and backward, loss, optimizer, zero_grad).
    If a cheap step's peak falls elsewhere, the step has changed and the next
    profiled steps are full ones again.

    What happens after the bracket cannot change what the peak in it is
    attributed to, so a cheap step stops naming storages there (the step's
    end still reads the counters: a higher peak later means the step
    changed). Nor does it hook the autograd nodes that backward runs after
    the bracket: autograd runs a graph's nodes in decreasing sequence number
    (each node is created after the nodes it feeds, and the engine's ready
    queue takes the highest first: torch/csrc/autograd/engine.cpp,
    CompareNodeTaskTime), so those before the bracket are the ``depth``
    nodes nearest the forward's output in creation order. And it hooks the
    forwards of the few modules whose events it needs (``hooked``: the root,
    the bracket's modules, the modules whose forward a checkpoint recomputes
    in backward), not every module's.
    """

    __slots__ = ("bracket", "events", "modules", "phase", "depth", "hooked")

    def __init__(self, bracket: tuple[tuple, tuple], phase: str, depth: int, also_hooked: Iterable[str]) -> None:
        self.bracket, self.phase, self.depth = bracket, phase, depth
        self.events = frozenset(key[:2] for key in bracket)
        self.modules = frozenset(key[1] for key in bracket if key[0] in _FINE_EVENTS)
        self.hooked = self.modules | frozenset(also_hooked)


# Events at which a cheap profiled step skips reading the counters (unless they
# bound the peak's interval): the boundaries of modules below the root, and
# the samples taken when a large activation is saved or a large gradient made.
_FINE_EVENTS = frozenset(("pre", "post", "bwd_start", "bwd_end", "saved", "node"))


class Tracker:
    """Context manager returned by :func:`track`; see there."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        device: torch.device | str | None = None,
        warmup: int = 3,
        every: int = 100,
        timeline_steps: int = 3,
        history: int = 10_000,
        full: bool = False,
        oom_dir: str | os.PathLike | None = ".",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"memprof.track needs an nn.Module, got {type(model).__name__}: pass your model, e.g. track(model)")
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        bad = [o for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
        if optimizer is not None and (bad or not optimizers):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, a list of them (a step ends when the last one steps) "
                f"or None, got {type(bad[0]).__name__ if bad else 'an empty list'}; leave it out to find the "
                "optimizer automatically"
            )
        for arg, value, low in (
            ("warmup", warmup, 0), ("every", every, 0), ("timeline_steps", timeline_steps, 1), ("history", history, 1)
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}")
        self._model = weakref.ref(model)
        # The optimizers given (None: found at their first step); the last one's step ends a step.
        self._given = None if optimizer is None else [weakref.ref(o) for o in optimizers]
        # The modules the script calls: the model, or the children of a container that has
        # no forward of its own (nn.ModuleDict of a GAN's generator and discriminator).
        roots = list(model.children()) if not own_forward(model) else [model]
        self._roots = [weakref.ref(m) for m in roots or [model]]
        self.device = self._resolve_device(model, device, [o for o in optimizers if o is not None])
        self._simulated = self.device.type == "meta"
        # The script's own meta tensors (a model built on meta and not yet materialised): not the GPU's.
        self._script_meta = getattr(_virtual_device(), "meta_tensors", None) if self._simulated else None
        self.warmup, self.every = warmup, every
        self._counters = counters_for(self.device)
        # Steps are timed by the device's clock where it has one (a simulated
        # GPU's predicted time), else by the host's.
        self._clock = getattr(self._counters, "clock", time.perf_counter)
        # Allocator blocks are 512-byte multiples on CUDA, real or simulated.
        self._ledger = Ledger(block=512 if self._counters.available else 1)
        # The bytes no storage claimed when cuBLAS's workspaces were last looked for.
        self._unclaimed: int | None = None
        named = _uncompiled(model)
        root = type(named).__name__
        self._root_name = root
        # module -> qualified name, prefixed by the root's class so names are
        # unique and readable in phases ("GPT2LMHeadModel.transformer.h.0"); a
        # model given compiled is named as the model it compiles, and is its root.
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary(
            (m, f"{root}.{n}" if n else root) for n, m in named.named_modules()
        )
        # A module registered under several parents (YOLOv5's one SiLU in every Conv): a module
        # of its own at each path, named at each call by the module calling it (_call_name).
        self._types: dict[str, str] = {}
        self._paths: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
        # A module registered twice under one parent is one module by two names (Lightning Fabric's
        # _forward_module and _original_module): its second name, and all under it, are left out.
        aliases: list[str] = []
        for n, m in named.named_modules(remove_duplicate=False):
            path, first = f"{root}.{n}" if n else root, self._names[m]
            if aliases and any(path.startswith(a + ".") for a in aliases):
                continue
            if path != first and path.rpartition(".")[0] == first.rpartition(".")[0]:
                aliases.append(path)
                continue
            self._types[path] = type(m).__name__
            if path != first:
                self._paths.setdefault(m, {first.rpartition(".")[0]: first})[path.rpartition(".")[0]] = path
        self._names[model] = root
        self._by_name = {name: weakref.ref(m) for m, name in self._names.items()}
        self._by_name.update((path, weakref.ref(m)) for m, paths in self._paths.items() for path in paths.values())
        self._by_name[root] = weakref.ref(model)
        # Modules whose forward a checkpoint recomputed in backward (in the last full step).
        self._recompute_roots: set[str] = set()
        # Each module's path and its ancestors' up to the root: a module row
        # includes its submodules.
        self._chains: dict[str, tuple[str, ...]] = {}
        for name in self._types:
            parent = name.rpartition(".")[0]
            self._chains[name] = (name, *self._chains.get(parent, ()))
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        # Each optimizer's state as last recorded, in the order of its ``state``:
        # weak references to each parameter and to its state tensors.
        self._recorded_state: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple]] = weakref.WeakKeyDictionary()
        self._primary: weakref.ref | None = self._given[-1] if self._given else None
        # Optimizers found automatically, in the order of their first steps, until one steps
        # again: the last of that cycle ends a step from then on (Muon beside AdamW, a GAN's two).
        self._cycle: list[weakref.ref] | None = [] if self._given is None else None

        self._handles: list = []  # removed on exit
        # Classes whose zero_grad is wrapped, (class, its own zero_grad or None, the wrapper): restored on exit.
        self._zero_grads: list[tuple[type, Any, Any]] = []
        # Classes' methods wrapped while tracking (torch.utils.checkpoint's): (class, name, its own).
        self._patched: list[tuple[type, str, Any]] = []
        self._step_handles: list = []  # removed at the end of each profiled step
        # Until an optimizer of the model's steps: what sees a step without one (a training
        # loop that updates the parameters itself), and its forward pre-hook. See _on_manual_pre.
        self._manual: GradientWatch | None = None
        self._manual_hook: Any = None
        self._entered: tuple | None = None  # a root call whose forward pre-hook ran at a step's start
        self._node_hook: Any = None  # _on_node_grads, bound while a step is profiled
        self._saved_hooks: saved_tensors_hooks | None = None
        #: While they are pushed: saved-tensors pushes as they were, and the one chaining to ours.
        self._pushes: tuple[Callable, Callable] | None = None
        self._chained = False  # whether the saved-tensors hooks chain to ones active before (save_on_cpu)
        self._user_view: Any = None
        self._active = False
        # UntypedStorage.resize_ as it was before the block (the class's own, or None), and ours.
        self._resize: tuple[Callable | None, Callable] | None = None

        self.step = 0
        self._forwards = 0
        self._profiled = False
        self._t0 = 0.0
        # The step's evaluations: the model called without gradients in eval mode (a validation loop
        # every few steps), (start, end) by _now(); the one running, its start. Left out of the step's
        # time. In train mode a call without gradients is the step's own work (GradCache's first pass
        # over its chunks, a DQN or PPO agent acting between updates: dropout on, as in training).
        self._evaluations: list[tuple[Any, Any]] = []
        #: Whether the step that ended last had an evaluation in it (see _evaluations).
        self.evaluated = False
        #: Whether it ran another model (not the tracked one) without gradients in eval mode, or
        #: through ``torch.optim.swa_utils.update_bn`` (its batch norms' momentum None): an averaged
        #: model's validation or statistics pass every few steps; a distillation teacher every step.
        #: Its time stays the step's.
        self.others_inferred = False
        self._others_inferring = False
        self._evaluating: Any = None
        # The forwards of the model in eval mode with gradients on since the last backward,
        # (start, end) each: none after them (pytorch-tabnet's predict, no torch.no_grad())
        # makes them evaluations, known at the next forward in train mode or the step's end.
        self._eval_with_grad: list[tuple[Any, Any]] = []
        self._no_grad_call: weakref.ref | None = None  # the module called without gradients, running (_on_pre)
        # Bounded, so that a run of any length costs the same host memory.
        self._steps: deque[tuple] = deque(maxlen=history)
        # The shapes of the model's inputs at each step's first training forward: the distinct ones
        # in the order first seen, and each step's (by index into them, as _steps holds its rows).
        # Batches of other shapes (dynamic padding) make steps of other peaks.
        self._batches: dict[tuple, int] = {}
        self._step_batches: deque[int | None] = deque(maxlen=history)
        self._batch: int | None = None
        # What makes a sample's gradient depend on the others of its batch (memprof.coupling), read from
        # the graphs behind the first profiled step's backward calls: {kind: nodes}, and that step.
        self._coupling: dict[str, int] = {}
        self._coupling_step: int | None = None
        # On a simulated GPU: its flop count when the step's optimizer began, and the arithmetic of
        # the last profiled step's optimizers (matrix products: Muon's Newton-Schulz iterations;
        # an elementwise AdamW does none), which an optimizer stepped on the host does there.
        self._optimizer_flops_at: int | None = None
        self._optimizer_flops: int | None = None
        self._last: Breakdown | None = None
        self._timeline: deque[list[tuple]] = deque(maxlen=timeline_steps)
        self._plan: _Plan | None = None
        self._last_bracket: tuple | None = None  # the peak's interval in the last full step
        self._always_full = full
        self._oom_dir = oom_dir
        # An out-of-memory error (as text: the error itself would keep the
        # failed step's frames and tensors alive, e.g. through a script's
        # retry with a smaller batch) and the phase it struck in.
        self._failed: tuple[str, str] | None = None
        #: The forensic report's JSON and HTML paths, once an out-of-memory error left the block.
        self.oom_files: tuple[Path, ...] | None = None
        self._full_steps: deque[int] = deque(maxlen=history)
        self._full = True  # whether the current profiled step reads the counters at every boundary
        self._done = False  # whether a cheap step has passed its peak's interval (see _Plan)
        # The model's parameters with their owner and name, found by full steps.
        self._params: list[tuple[weakref.ref, str, str]] = []
        # The same, by parameter: its storage changes where the script sets ``p.data`` (SAM's second
        # step puts back the weights it kept), and the new storage is still the module's parameter.
        self._param_names: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # (owner, name) by parameter
        self._state_only: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # see _refresh_state
        # Over-step module columns, measured by full steps.
        self._saved_over_step: dict[str, int] = defaultdict(int)
        self._fwd_delta: dict[str, int] = defaultdict(int)
        self._bwd_delta: dict[str, int] = defaultdict(int)
        # The reported step (the highest peak, the latest of equal ones): its
        # breakdown, module table and optimizer state by name.
        self._reported: Breakdown | None = None
        self._modules: dict[str, dict[str, int]] = {}
        self._optimizer_state: dict[str, int] = {}
        self._other_models: dict[str, int] = {}
        # Modules outside the tracked model that the script holds or calls (a frozen
        # encoder, a teacher, an EMA copy), by the name it holds them by; and every
        # module met outside the tracked model, their submodules included, so that a
        # forward hook passes over one it has seen at the cost of a lookup.
        self._others: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._outside: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # -- public ----------------------------------------------------------------
    def __enter__(self) -> "Tracker":
        global _active
        if _active is not None and _active() is not None:
            raise RuntimeError(
                "memprof.track is already active; nested or concurrent tracking is not supported because module and "
                "optimizer hooks and CUDA's peak counters are process-wide. Track the outer model only, or close the "
                "first track() block before opening another."
            )
        model = self._model()
        if model is None:
            raise RuntimeError(
                "the tracked model was garbage-collected before the with block began (memprof holds it weakly); "
                "keep a reference: model = ...; with memprof.track(model): ..."
            )
        try:
            _active = weakref.ref(self)
            self._active = True
            self._user_view = self._counters.user_view()
            self._user_view.__enter__()
            # Run as Python even where the script compiles its optimizer's step (torch.compile
            # traced them once and dropped them from the compiled step: one step was seen of five).
            self._handles.append(register_optimizer_step_pre_hook(torch.compiler.disable(self._on_optimizer_pre)))
            self._handles.append(register_optimizer_step_post_hook(torch.compiler.disable(self._on_optimizer_post)))
            for ref in self._roots:
                root = ref()
                # nn.Module's own methods: a TorchScript module's refuse hooks, yet its calls from Python run them
                self._handles += [
                    nn.Module.register_forward_pre_hook(root, Shared(self._on_root_pre), with_kwargs=True),
                    nn.Module.register_forward_hook(root, Shared(self._on_root_post), always_call=True)]
                self._wrap_zero_grad(root)
            # Parameters and buffers a tracked module registers while tracked (the pruning
            # tutorial's prune.global_unstructured: weight_orig and weight_mask, between steps).
            self._handles += [nn.modules.module.register_module_buffer_registration_hook(self._on_buffer),
                              nn.modules.module.register_module_parameter_registration_hook(self._on_parameter)]
            for ref in self._given or ():
                for opt in (ref(), *_wrapped(ref())):
                    self._optimizers[opt] = True
                    self._wrap_zero_grad(opt)
            if self._given is None:
                self._watch_manual(model)
            self._wrap_backward()
            self._wrap_checkpoint_inputs()
            self._wrap_sac_cache()
            self._wrap_func_transforms()
            self._wrap_resize()
            self._counters.reset_peak()  # later steps begin where the last one's counters were read and reset
            self._begin_step()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._forwards and exc[0] is None:
                self._end_step()
            elif isinstance(exc[1], torch.OutOfMemoryError):
                self.record_oom(exc[1])
        finally:
            self._close()

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` between two steps, the next step's peaks counted from
        the emptied cache: the counters were reset where the last step ended, so its peak
        reserved would keep what the cache held then (an evaluation's blocks)."""
        torch.cuda.empty_cache()
        self._counters.reset_peak()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Between two steps, let other work run unseen by this tracker: a
        simulation on a copy of the model, with a ``track`` block of its own
        (a trainer callback advising mid-fit). The step about to begin is
        begun again afterwards, its peak counters reset, as if the pause had
        not happened."""
        global _active
        if not self._active or self._forwards:
            raise RuntimeError("a tracker pauses between steps only: inside its with block, before the next forward")
        for handle in self._step_handles:  # the profiled step's process-wide module hooks
            handle.remove()
        self._step_handles.clear()
        _active = None
        try:
            yield
        finally:
            _active = weakref.ref(self)
            self._counters.reset_peak()
            self._begin_step()

    def record_oom(self, error: BaseException) -> None:
        """Save (to ``oom_dir``: :attr:`oom_files`) and log what was live as
        ``error`` struck; called on exit when an out-of-memory error leaves the
        block, or by whoever catches it inside. Never raises: a failure here is
        logged, and the caller's error is what matters."""
        from . import oom

        try:
            report = self.oom_report(error)
            if self._oom_dir is not None:
                self.oom_files = oom.save(report, self._oom_dir)
            log.error("%s", oom.explain(report, self.oom_files))
        except Exception as exc:  # the user's error matters more than ours
            log.warning("memprof could not record the out-of-memory error's breakdown: %s: %s", type(exc).__name__, exc)

    def oom_report(self, error: BaseException) -> Report:
        """The report, with its ``peak`` and module table taken now, as ``error``
        (an out-of-memory error raised inside the block) struck: every live
        storage by category and module, allocated and reserved from the
        allocator. In a profiled step activations are named; in a light one
        what is not a parameter, gradient, buffer or optimizer state counts as
        temporaries. ``meta["out_of_memory"]`` holds the error and, for a
        simulated GPU, the bytes requested and the capacity."""
        for opt in self._own_optimizers():  # state the failing step created (Adam's first)
            self._record_optimizer_state(opt)
        report = self.report()
        totals = self._ledger.snapshot()
        c = self._counters.read()
        alloc = c.allocated if c is not None else sum(totals.values())
        counts = _counts(totals, alloc, c.reserved if c is not None else None)
        if self._failed is not None and self._failed[0] == _describe(error):
            phase = self._failed[1]  # in a forward, which has unwound since
        else:
            phase = self._phase_now() if self._profiled else "light step (not profiled)"
        report.peak = Breakdown(step=self.step, phase=phase, bytes=counts)
        report.modules = self._table(self._module_rows(self._ledger.by_module()))
        gpu = getattr(self._counters, "gpu", None)  # a simulated GPU's allocator knows its target
        if gpu is not None:
            report.source = "simulate"
            report.meta["target"] = gpu.name
        report.meta["out_of_memory"] = {
            "error": _describe(error),
            **{k: getattr(error, k) for k in ("requested", "capacity") if hasattr(error, k)},
            "allocated": alloc,
            "reserved": c.reserved if c is not None else None,
        }
        return report

    @property
    def last_peak(self) -> Breakdown | None:
        """The peak breakdown of the latest profiled step (cheap: no tables are built)."""
        return self._last

    def report(self) -> Report:
        """What was measured so far (callable inside or after the ``with`` block)."""
        peak = self._reported
        self._resolve_time()
        modules = self._table(self._modules)
        cols = ["step", "seq", "phase", "allocated", "interval_peak", "reserved", *[c.value for c in ALLOCATED]]
        timeline = pd.DataFrame([r for rows in self._timeline for r in rows], columns=cols)
        meta = {
            "torch": torch.__version__,
            "profiled_steps": [r[0] for r in self._steps if r[1]],
            "full_profiles": list(self._full_steps),
            "steps_total": self.step,
        }
        if self.device.type == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(self.device)
        if self._optimizer_flops is not None:
            meta["optimizer_flops"] = self._optimizer_flops
        if self._coupling:
            meta["sample_coupling"] = dict(self._coupling)
        if len(self._batches) > 1:  # (the first few: a batch padded to each longest sequence makes many)
            shapes = [[list(t) for t in shape] for shape in self._batches]
            meta.update(batch_shapes=shapes[:_BATCH_SHAPES], batch_shapes_seen=len(shapes))
            at = {row[0]: b for row, b in zip(self._steps, self._step_batches)}.get(peak.step) if peak else None
            if at is not None:
                meta["peak_batch_shape"] = shapes[at]
        return Report(
            device=str(self.device),
            peak=peak,
            optimizer_state=dict(self._optimizer_state),
            other_models=dict(self._other_models),
            modules=modules,
            timeline=timeline,
            steps=pd.DataFrame(self._steps, columns=STEP_COLUMNS),
            source="track",
            meta=meta,
        )

    def _phase_now(self) -> str:
        # A cheap step names the phase without sampling (self._phase is its last sample's).
        return f"{self._kind.value} {self._phase_module}" if self._phase_module else self._kind.value

    def _table(self, rows: dict[str, dict[str, int]]) -> pd.DataFrame:
        names = list(self._types)
        return pd.DataFrame(
            [{"type": self._types[n], **{c: rows.get(n, {}).get(c, 0) for c in MODULE_COLUMNS[1:]}} for n in names],
            index=pd.Index(names, name="module"),
            columns=MODULE_COLUMNS,
        )

    # -- steps -----------------------------------------------------------------
    def _should_profile(self, step: int) -> bool:
        return step < self.warmup or (self.every > 0 and step % self.every == 0)

    def _begin_step(self) -> None:
        self._forwards = 0
        self._batch = None
        self._optimizer_flops_at = None
        self._failed = None
        self._profiled = self._should_profile(self.step)
        if self._profiled:
            self._start_profile()
        self._t0 = self._now()
        self._evaluations = []
        self._others_inferring = False

    def _now(self) -> Any:
        # A profiled step's time is its kernels', not how far ahead of them the
        # host got: on CUDA an event on the current stream marks each end, read
        # once the device has passed it (_resolve_time), so the host never waits
        # for the device (light steps take the host's clock, as ever).
        if self._profiled and self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return self._clock()

    def _resolve_time(self) -> None:
        """The latest step's seconds, if its end is an event: by now (a step later,
        or a report) the device has passed it, or soon will."""
        if self._steps and isinstance(self._steps[-1][-1], list):
            *row, spans = self._steps[-1]
            spans[0][1].synchronize()
            self._steps[-1] = (*row, _seconds(spans))

    def _end_step(self) -> None:
        self._no_backward_after()
        end = self._now()
        # Events (a profiled step on a GPU) are resolved later; evaluations in the step are left out.
        spans = [(self._t0, end), *self._evaluations]
        self.evaluated = bool(self._evaluations)
        self.others_inferred = self._others_inferring
        seconds = _seconds(spans) if isinstance(end, (int, float)) else spans
        self._resolve_time()
        if self._profiled:
            self._finish_profile()
            peak = self._last
            row = (self.step, True, peak.allocated, self._reserved_high, self._last_alloc, self._last_reserved, seconds)
        else:
            c = self._counters.read_and_reset()
            if c is None:  # no allocator counters on the CPU: only profiled steps are measured
                row = (self.step, False, None, None, None, None, seconds)
            else:
                row = (self.step, False, c.peak_allocated, c.peak_reserved, c.allocated, c.reserved, seconds)
        self._steps.append(row)
        self._step_batches.append(self._batch)
        if self._optimizer_flops_at is not None:
            self._optimizer_flops = self._counters.flops - self._optimizer_flops_at

    # -- profiled steps --------------------------------------------------------
    def _start_profile(self) -> None:
        # Without the allocator's peak counters (CPU), skipped samples would
        # hide the peak: every profiled step is a full one there.
        full = self._full = self._plan is None or self._always_full or not self._counters.available
        with torch._C.DisableTorchFunction():  # property reads, not the script's: past any device mode
            self._refresh_state(full)
            if full:
                self._find_workspaces()
        self._ledger.open_journal()
        self._fwd: list[_Span] = []
        self._bwd: dict[str, _Span] = {}
        # Modules whose backward's end no hook sees: no input needs grad (given detached, or ids).
        self._unended: set[str] = set()
        # Whether the open forwards run inside backward: a checkpointed
        # module's recomputation, which is neither a new forward nor the loss.
        self._recompute = False
        self._bwd_task: int | None = None  # the backward whose end is awaited
        self._kind, self._phase_module, self._phase = Phase.BETWEEN_STEPS, "", Phase.BETWEEN_STEPS.value
        # The timeline gets this step's samples when the step ends: a step that
        # never does (the one the block exits in, before any forward, after
        # zero_grad()) must not push a finished one out.
        self._rows: list[tuple] = []
        self._saved_seen: set = set()
        if full:
            self._saved_over_step.clear()
            self._fwd_delta.clear()
            self._bwd_delta.clear()
            self._recompute_roots.clear()
        # Each sample is named by its event and the event's occurrence in the
        # step, so that a cheap step can find the samples of the full one.
        self._occurrences: dict[tuple[str, str], int] = defaultdict(int)
        self._key: tuple = ("start", "", 0)
        self._peak: tuple | None = None
        self._peak_keys: tuple[tuple, tuple] | None = None
        self._reserved_high: int | None = None
        # A cheap step is done once its bracket's closing sample is taken.
        self._done = False
        # The highest sequence number of the latest forward's graph, the
        # deepest node below it that backward has run (a full step's), and
        # that depth at the peak's closing sample: the plan's depth.
        self._graph_top: int | None = None
        # Whether the root's forward ran inside torch.func's transforms in this step (_on_root_pre).
        self._transformed_forward = False
        self._depth = self._peak_depth = -1
        c = self._counters.read()
        self._last_alloc = c.allocated if c else self._ledger.attributed()
        self._last_reserved = c.reserved if c else None
        self._last_totals = self._ledger.snapshot()
        self._last_mark = self._ledger.mark()
        # A tensor this large is worth a sample of its own. Fixed for the
        # step, so that full and cheap steps take the same ones.
        self._big = max(self._last_alloc >> 5, 1 << 20)
        h = self._step_handles
        if full:
            h.append(nn.modules.module.register_module_forward_pre_hook(self._on_pre))
            h.append(nn.modules.module.register_module_forward_hook(self._on_post, with_kwargs=True, always_call=True))
        else:
            hooked: set[int] = set()  # a shared module, hooked once for all its paths
            for name in self._plan.hooked:
                ref = self._by_name.get(name)  # "" for a saved tensor's or a node's event
                module = ref() if ref is not None else None
                if module is not None and id(module) not in hooked:
                    hooked.add(id(module))
                    h.append(nn.Module.register_forward_pre_hook(module, Shared(self._on_pre)))
                    h.append(nn.Module.register_forward_hook(module, Shared(self._on_post), with_kwargs=True,
                                                             always_call=True))
        # Bound once a step, not once a node or parameter (see _hook_graph).
        self._node_hook = self._on_node_grads
        if full:  # a cheap step looks at the gradients at its bracket's samples only
            on_grad = Shared(self._on_grad_accumulated)
            for ref, _, _ in self._params:
                p = ref()
                if p is not None and p.requires_grad:
                    h.append(p.register_post_accumulate_grad_hook(on_grad))

    def _finish_profile(self) -> None:
        self._end_backward(Phase.BETWEEN_STEPS, ("end", ""))
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        self._node_hook = None
        self._pop_saved_hooks()
        alloc, phase, totals, reserved, mark = self._peak
        plan = self._plan
        if self._full:
            # Once two full steps in a row peak in the same interval, the step
            # repeats (the first steps differ: lazy initialisation, optimizer
            # state), and the next profiled steps read the counters around it only.
            if self._peak_keys == self._last_bracket and plan is None:
                self._plan = _Plan(self._peak_keys, phase, self._peak_depth, {self._root_name, *self._recompute_roots})
            self._last_bracket = self._peak_keys
        elif self._peak_keys == plan.bracket:
            phase = plan.phase  # the full step's name for it: a cheap step's backward phases are coarse
        else:
            log.debug("step %d peaked outside the interval of the last full profile: profiling in full again", self.step)
            self._plan = self._last_bracket = None
        counts = _counts(totals, alloc, reserved)
        if reserved is not None:
            used = self._counters.nvml_used()
            if used is not None:
                counts[Category.NON_PYTORCH.value] = max(used - self._last_reserved, 0)
        peak = self._last = Breakdown(step=self.step, phase=phase, bytes=counts)
        led = self._ledger
        best = self._reported
        if self._full:
            self._full_steps.append(self.step)
            self._timeline.append(self._rows)
        # The reported step has the highest peak, the latest of equal ones.
        # Its module table comes from a full step: a cheap one that only equals
        # it held the same storages at the same moment of the same step.
        if best is None or peak.allocated >= best.allocated:
            self._reported = peak
            if self._full:
                self._modules = self._module_rows(led.by_module(mark))
                self._optimizer_state = led.group(Category.OPTIMIZER_STATE, by="detail", mark=mark)
                self._other_models = led.group(Category.OTHER_MODELS, by="detail")
            elif peak.allocated > best.allocated:
                # A cheap step names storages by the few modules it hooks: the
                # next profiled step is a full one, whose table names them all.
                self._plan = self._last_bracket = None
        led.close_journal()
        # Activations and their gradients of this step are dead or about to be;
        # keep the ledger small between profiled steps.
        led.drop(Category.ACTIVATIONS, Category.ACTIVATION_GRADIENTS, Category.INPUTS)

    def _module_rows(self, at_peak: dict[tuple[str, Category], int]) -> dict[str, dict[str, int]]:
        """Each module's row: what it and its submodules held at the peak, and over the step."""
        rows = {n: dict.fromkeys(MODULE_COLUMNS[1:], 0) for n in self._types}
        for (module, cat), nbytes in at_peak.items():
            if cat is Category.OTHER_MODELS:  # no module of the tracked model holds them
                continue
            for name in self._ancestors(module):
                rows[name][cat.value] += nbytes
        for name, nbytes in self._saved_over_step.items():
            rows[name]["activations_saved_over_step"] = nbytes
        for name, delta in self._fwd_delta.items():
            rows[name]["forward_peak_delta"] = delta
        for name, delta in self._bwd_delta.items():
            rows[name]["backward_peak_delta"] = delta
        return rows

    def _ancestors(self, module: str) -> tuple[str, ...]:
        """``module`` and its ancestors, the rows that count what it holds."""
        chain = self._chains.get(module)
        if chain is None:
            # Not in the table (a module added after track() began, or no
            # module: ""): its nearest ancestor that is, else the root.
            name = module
            while name and name not in self._chains:
                name = name.rpartition(".")[0]
            chain = self._chains[name or self._root_name]
            self._chains[module] = chain
        return chain

    def _find_workspaces(self) -> None:
        """Name cuBLAS's workspaces, which it takes at a thread's first matrix
        product and keeps. Looking for them reads the allocator's every block
        (tens of ms on a large model), so only when the bytes no storage
        claims have changed since the last look (a new workspace changes them)."""
        c = self._counters.read()
        if c is None:
            return
        led = self._ledger
        unclaimed = c.allocated - led.attributed() + led.fixed(Category.WORKSPACES)
        if unclaimed != self._unclaimed:
            self._unclaimed = unclaimed
            led.set_fixed(Category.WORKSPACES, self._counters.workspaces(led.addresses))

    def _refresh_state(self, full: bool) -> None:
        """Record parameters, buffers, gradients and optimizer state that exist
        now. A full step looks for them in the model; a cheap one only
        re-checks the gradients of the parameters the last full step found
        (the rest is in the ledger for as long as its storage lives)."""
        led, root = self._ledger, self._root_name
        if full:
            model = _uncompiled(self._model())
            self._params = [(weakref.ref(p), _owner(root, name), name) for name, p in model.named_parameters()]
            self._param_names = WeakTensorKeyDictionary((ref(), (owner, name)) for ref, owner, name in self._params)
            for name, b in model.named_buffers():
                if self._on_device(b):
                    led.add(_storage(b), Category.BUFFERS, _owner(root, name), name)
            self._record_attributes(model)
        if full:
            for ref, owner, name in self._params:
                p = ref()
                if p is not None and self._on_device(p):
                    led.add(_storage(p), Category.PARAMETERS, owner, name, replace=True)
        self._refresh_gradients()
        if full:
            for opt in self._own_optimizers():
                self._record_optimizer_state(opt)
            found = script_variables(sys._getframe(1))
            names = dict((id(v), n) for n, v in found)
            own = self._own_optimizers()
            for name, v in found:
                if isinstance(v, nn.Module):
                    if v not in self._outside and v not in self._names:
                        self._adopt_other(v, names)
                elif (isinstance(v, torch.optim.Optimizer) and v not in self._optimizers
                      and any(o in own for o in _wrapped(v))):
                    # A wrapper whose own step() the script never calls (SAM's first_step and
                    # second_step step its base optimizer): its state is the model's all the same,
                    # made between the base's steps (the weights SAM keeps while it perturbs them).
                    self._optimizers[v] = True
                    self._state_only.add(v)
                    self._record_optimizer_state(v)
                elif isinstance(v, (list, tuple, dict)):
                    self._record_copy(name, v)
            for module, name in list(self._others.items()):
                self._record_other(module, name)

    def _record_attributes(self, model: nn.Module) -> None:
        """Tensors the model's modules keep on the device as plain attributes, neither parameters
        nor buffers (a rotary embedding's cos/sin cache, a mask, TabNet's group matrix): buffers,
        named ``attribute (attribute)``. Saved for backward, they counted as activations from
        their first save until the storage died, between steps as temporaries."""
        led, root = self._ledger, self._root_name
        for path, module in model.named_modules():
            for attr, v in vars(module).items():
                if type(v) is torch.Tensor and self._on_device(v):
                    known = led.get(_storage(v))
                    if known is None or known.category in (Category.ACTIVATIONS, Category.TEMPORARIES):
                        led.add(_storage(v), Category.BUFFERS, _owner(root, f"{path}.{attr}" if path else attr),
                                f"{attr} (attribute)", replace=True)

    def _record_copy(self, name: str, v: list | tuple | dict) -> None:
        """Record the values of ``v`` as another model's if they are a copy of the tracked model's
        parameters on the device, shape for shape: an EMA's shadow parameters (diffusers'
        ``EMAModel.shadow_params``), the best weights so far, kept as tensors, not a module; or
        a state dict of the model, or one ``v`` holds (a loaded checkpoint)."""
        if isinstance(v, dict) and self._record_state_dicts(name, v):
            return
        values = list(v.values()) if isinstance(v, dict) else v
        if len(values) != len(self._params):
            return
        shapes = sorted(tuple(p.shape) for ref, _, _ in self._params if (p := ref()) is not None)
        if not (all(isinstance(t, torch.Tensor) and self._on_device(t) and not t.requires_grad for t in values)
                and sorted(tuple(t.shape) for t in values) == shapes):
            return
        for t in values:
            self._ledger.add(_storage(t), Category.OTHER_MODELS, "", name)

    def _record_state_dicts(self, name: str, v: dict) -> bool:
        """Record ``v``, or a dict it holds, as another model's where it is a state dict of the
        tracked model on the device: a checkpoint loaded onto the GPU and kept (pytorch/examples'
        ImageNet keeps ``checkpoint`` for the run). Returns whether one was."""
        found = False
        for key, d in [(None, v), *((k, x) for k, x in v.items() if isinstance(x, dict))]:
            if self._copies_the_model(d):
                found = True
                for t in d.values():
                    if isinstance(t, torch.Tensor) and self._on_device(t):
                        self._ledger.add(_storage(t), Category.OTHER_MODELS, "", name if key is None else f"{name}[{key!r}]")
        return found

    def _copies_the_model(self, d: dict) -> bool:
        """Whether ``d`` is a state dict of the tracked model on the device: a tensor of each
        parameter's name and shape (DDP's ``module.`` prefix or not), buffers besides."""
        if len(d) < len(self._params) or not self._params:
            return False
        keys = {_unprefixed(k): t for k, t in d.items() if isinstance(k, str)}
        for ref, _, name in self._params:
            p, t = ref(), keys.get(_unprefixed(name))
            if p is None or not isinstance(t, torch.Tensor) or t.shape != p.shape or not self._on_device(t):
                return False
        return True

    def _adopt_other(self, module: nn.Module, names: dict[int, str] | None = None) -> None:
        """Follow ``module``, met outside the tracked model, as another model if it
        holds parameters or buffers: named by the variable the script holds it by
        (``names``: the script's values by identity, read from its frames where not
        given), else by its class; a name two modules share is numbered."""
        for m in module.modules():
            self._outside.add(m)
        if next(module.parameters(), None) is None and next(module.buffers(), None) is None:
            return  # a loss module or an activation called outside the model: no frames read
        if names is None:
            names = {id(v): n for n, v in script_variables(sys._getframe(2))}
        base = name = names.get(id(module)) or type(module).__name__
        taken, n = set(self._others.values()), 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        self._others[module] = name
        self._record_other(module, name)

    def _record_other(self, module: nn.Module, name: str) -> None:
        """Record another model's parameters and buffers on the device (those of the
        tracked model it shares, such as a wrapper's, stay the tracked model's)."""
        led = self._ledger
        for t in (*module.parameters(), *module.buffers()):
            if self._on_device(t):
                led.add(_storage(t), Category.OTHER_MODELS, "", name)

    def _refresh_gradients(self) -> None:
        """Record the parameters' gradients that exist now: at a profiled step's
        start, and in a cheap step at its bracket's samples (instead of a hook
        on every parameter: a cheap step's bracket sees only those gradients)."""
        led, on_device = self._ledger, self._on_device
        with torch._C.DisableTorchFunction():  # property reads, not the script's: past any device mode
            for ref, owner, name in self._params:
                p = ref()
                g = p.grad if p is not None else None
                if g is not None and on_device(g):
                    led.add(_storage(g), Category.GRADIENTS, owner, name, replace=True)
            # Another model's gradients are its own, as its parameters are: backward through the
            # tracked model (an actor's loss through a critic, a generator's through the
            # discriminator) bound them at nodes of the tracked model's, as activation gradients.
            for module, other in list(self._others.items()):
                for p in module.parameters():
                    g = p.grad
                    if g is not None and p not in self._param_names and on_device(g):
                        led.add(_storage(g), Category.OTHER_MODELS, "", other, replace=True)

    def _own_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of the tracked model (``_optimizers`` also remembers the others seen, as not ours)."""
        return [opt for opt, ours in list(self._optimizers.items()) if ours]

    def _record_optimizer_state(self, opt: torch.optim.Optimizer, changed: bool = False) -> None:
        """Record ``opt``'s state tensors; with ``changed``, only those of
        parameters whose state holds other tensors than when last recorded.

        A tensor recorded once stays in the ledger for as long as its storage
        lives, and optimizers update their state in place, so after the step
        that creates it (Adam's first) the state is the same tensors step
        after step; comparing them by identity costs a fraction of recording
        them again. (A state tensor given another storage in place, by
        ``set_``, would be missed until the next full profile, which records
        it all.)
        """
        led = self._ledger
        for group in opt.param_groups:
            for p in group["params"]:
                if not (isinstance(p, torch.Tensor) and self._on_device(p)):
                    continue
                entry = led.get(_storage(p))
                known = self._param_names.get(p)
                if known is not None and (entry is None or entry.category is not Category.PARAMETERS):
                    # The model's parameter, given another storage since it was recorded (p.data = ...).
                    led.add(_storage(p), Category.PARAMETERS, *known, replace=True)
                    if p.grad is not None and self._on_device(p.grad):
                        led.add(_storage(p.grad), Category.GRADIENTS, *known, replace=True)
                elif entry is None or entry.detail == _OWN:
                    # The optimizer's own parameters, which no module of the model holds: fp32 master
                    # weights kept by hand (fairseq's FP16Optimizer: one flat tensor), a learnable
                    # temperature; and the gradients the script gives them.
                    led.add(_storage(p), Category.PARAMETERS, "", _OWN)
                    if p.grad is not None and self._on_device(p.grad):
                        led.add(_storage(p.grad), Category.GRADIENTS, "", _OWN, replace=True)
        last = self._recorded_state.get(opt) if changed else None
        if last is not None and len(last) != len(opt.state):
            last = None  # parameters came or went: compare nothing, record all
        recorded = []
        for i, (p, state) in enumerate(opt.state.items()):
            tensors = tuple(t for v in state.values() for t in _state_tensors(v))
            is_tensor = isinstance(p, torch.Tensor)
            # Compared by position in the state's order, by identity: cheaper than
            # a lookup by parameter, and a tensor's == is elementwise.
            if last is not None and is_tensor:
                ref, refs = last[i]
                if ref is not None and ref() is p and len(refs) == len(tensors) and all(
                        r() is t for r, t in zip(refs, tensors)):
                    recorded.append(last[i])
                    continue
            owner = led.get(_storage(p)) if is_tensor else None
            module = owner.module if owner is not None else ""
            for key, value in state.items():
                for t in _state_tensors(value):
                    if self._on_device(t):
                        led.add(_storage(t), Category.OPTIMIZER_STATE, module, str(key))
            recorded.append((weakref.ref(p) if is_tensor else None, tuple(map(weakref.ref, tensors))))
        self._recorded_state[opt] = recorded

    def _on_device(self, t: torch.Tensor) -> bool:
        if self._simulated:  # a simulated GPU's tensors are meta tensors that report device cuda
            return t.is_meta and (self._script_meta is None or not self._script_meta.holds(t))
        # Comparing devices whole: reading a torch.device's type and index
        # costs eight times as much, and this runs for every tensor a hook sees.
        return t.device == self.device

    def _sample(self, kind: Phase, module: str = "", event: tuple[str, str] = ("", "")) -> int:
        """Close the interval that ran in the current phase and begin one of
        phase ``kind`` (in ``module``); return allocated bytes now.

        ``event`` names what happened (``("bwd_end", module)``); a cheap step
        skips the counters at the boundaries of modules below the root that
        do not bound the last full profile's peak (and returns the bytes of
        the last sample it took).
        """
        skippable = not self._full and event[0] in _FINE_EVENTS and event[1] != self._root_name
        if skippable and (self._done or event not in self._plan.events):
            self._kind, self._phase_module = kind, module
            return self._last_alloc
        # Occurrences are counted for every event of a full step, and in a
        # cheap one for those it samples or may: they count alike in both.
        occurrences = self._occurrences
        n = occurrences[event] = occurrences[event] + 1
        key = (*event, n)
        if skippable and key not in self._plan.bracket:
            self._kind, self._phase_module = kind, module
            return self._last_alloc
        if not self._full and key in self._plan.bracket:
            self._refresh_gradients()
        c = self._counters.read_and_reset()
        totals = self._ledger.snapshot()
        mark = self._ledger.mark()
        if c is None:
            alloc = sum(totals.values())
            high, reserved, reserved_high = max(alloc, self._last_alloc), None, None
        else:
            alloc, high, reserved, reserved_high = c.allocated, c.peak_allocated, c.reserved, c.peak_reserved
            self._reserved_high = max(self._reserved_high or 0, reserved_high)
        if self._peak is None or high > self._peak[0]:
            # Between two samples only the counters' peak is known; attribute it
            # with the ledger of the higher end and call the rest temporaries.
            # The mark lets the module table be rebuilt at that same end.
            if alloc >= self._last_alloc:
                self._peak = (high, self._phase, totals, reserved_high, mark)
            else:
                self._peak = (high, self._phase, self._last_totals, reserved_high, self._last_mark)
            self._peak_keys = (self._key, key)
            self._peak_depth = self._depth
        if not self._full and key == self._plan.bracket[1]:
            self._done = True
        if self._full:
            for span in self._fwd:
                span.high = max(span.high, high)
            for span in self._bwd.values():
                span.high = max(span.high, high)
            if len(self._rows) < _TIMELINE_ROWS_PER_STEP:
                named_now = _named(totals, alloc)
                self._rows.append(
                    (self.step, len(self._rows), self._phase, alloc, high, reserved, *named_now, alloc - sum(named_now))
                )
        self._last_alloc, self._last_totals, self._last_reserved, self._last_mark = alloc, totals, reserved, mark
        self._key = key
        self._kind, self._phase_module = kind, module
        self._phase = f"{kind.value} {module}" if module else kind.value
        return alloc

    # -- hooks: forward --------------------------------------------------------
    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        # A hook removed while PyTorch runs the hooks it gathered for a call (this tracker
        # closed in an earlier one) is still called, without the kwargs it was registered for.
        if in_torch_func() and self._active and module in self._names:
            # Inside torch.func's transforms (functorch's MAML: vmap(grad(...)) around the model) no
            # hook of the modules' can watch (see _on_pre), nor saved-tensors hooks (grad refuses
            # them): the region is one phase, the root's forward, whose graph _hook_loss claims.
            self._transformed_forward = self._transformed_forward or self._profiled
            if self._profiled and not self._done and not self._fwd and torch.is_grad_enabled() \
                    and self._kind is not Phase.FORWARD:
                self._sample(Phase.FORWARD, self._root_name, ("pre", self._root_name))
            return
        if not self._active or transformed() or module not in self._names:  # see _on_pre; a copy
            return  # of the root (copy.deepcopy: an EMA), which shares its hook
        self._forwards += 1
        if module.training:  # (two forwards in eval mode before one backward are training: not here)
            self._no_backward_after()
            if self._batch is None and torch.is_grad_enabled() and not self._recompute:
                shape = tuple(tuple(d if isinstance(d, int) else str(d) for d in t.shape)  # a jagged size: symbolic
                              for t in _leaves((args, kwargs)))
                self._batch = self._batches.setdefault(shape, len(self._batches))
        if not module.training and self._evaluating is None and not self._recompute:
            self._evaluating = self._now()  # an evaluation (see _evaluations, _on_root_post)
        if self._profiled and not self._recompute:
            for opt in self._state_only:  # (see _refresh_state)
                self._record_optimizer_state(opt, changed=True)
        # Inputs passed by keyword (Hugging Face's model(**batch)): the process-wide
        # pre-hook that names the positional ones (_on_pre, which ran first) sees no kwargs.
        if kwargs and self._profiled and not self._recompute and self._fwd:
            name = self._names.get(module)
            for t in _leaves(kwargs):
                if self._on_device(t):
                    for s in _parts(t):
                        self._ledger.add(s, Category.INPUTS, name)

    def _on_buffer(self, module: nn.Module, name: str, buffer: Any) -> None:
        owner = self._names.get(module)
        if owner is not None and self._active and isinstance(buffer, torch.Tensor) and self._on_device(buffer):
            self._ledger.add(_storage(buffer), Category.BUFFERS, owner, name, replace=True)

    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        owner = self._names.get(module)
        if owner is not None and self._active and isinstance(param, torch.Tensor) and self._on_device(param):
            self._params.append((weakref.ref(param), owner, name))
            self._param_names[param] = owner, name
            self._ledger.add(_storage(param), Category.PARAMETERS, owner, name, replace=True)

    def _on_root_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._evaluating is not None and self._active:
            if torch.is_grad_enabled():  # an evaluation if no backward follows (_no_backward_after)
                self._eval_with_grad.append((self._evaluating, self._now()))
            else:
                self._evaluations.append((self._evaluating, self._now()))
        self._evaluating = None

    def _no_backward_after(self) -> None:
        """The model's forwards in eval mode with gradients on that no backward followed: evaluations."""
        if self._eval_with_grad:
            self._evaluations += self._eval_with_grad
            self._eval_with_grad = []

    def _enter_in_forward(self, model: nn.Module, args: tuple) -> "Tracker":
        """Enter from inside ``model``'s forward pre-hooks, which PyTorch has
        already gathered for this call: run the tracker's own for it too."""
        self.__enter__()
        self._on_root_pre(model, args, {})
        if self._profiled:
            self._on_pre(model, args)
        return self

    def _on_pre(self, module: nn.Module, args: tuple) -> None:
        # Inside a region torch.compile traces (the tracked model compiled, or a part of it),
        # Dynamo inlines module hooks into its graph; inside torch.func's transforms (per-sample
        # gradients) tensors are wrappers without storages: hooks do nothing there, and the
        # region is attributed as a whole, from the modules around it and the saved tensors.
        # (not self._active: this tracker closed in an earlier hook of a call whose hooks PyTorch
        # had gathered, as the runner closes its early tracker in the model's first forward)
        if not self._active or self._done or transformed():
            return
        if self._entered is not None:
            entered, self._entered = self._entered, None
            if args is entered:  # this call's hook already ran where its step began (_on_manual_pre)
                return
        if self._no_grad_call is not None:
            return  # inside an evaluation (below)
        name = self._call_name(module) or self._adopt_compiled(module, args)
        if name is None:  # a module outside the tracked model: part of its caller
            if module not in self._outside:
                self._adopt_other(module)
            if (not self._fwd and not torch.is_grad_enabled() and module in self._others
                    and (not module.training or any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                                    and m.momentum is None for m in module.modules()))):
                self._others_inferring = True
            return
        outer = not self._fwd
        if outer and not torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
            # The model (or a part of it: a flow's reverse() sampling) called without gradients
            # between steps: an evaluation, which keeps nothing for backward. Its memory falls in
            # the phase it interrupts; its modules are no forward of the step, its arguments no inputs.
            self._no_grad_call = weakref.ref(module)
            return
        if outer:
            # A forward that begins while autograd runs a node is a checkpointed
            # module's recomputation (torch.utils.checkpoint, either kind).
            self._recompute = torch._C._current_autograd_node() is not None
            if self._recompute and self._full:
                self._recompute_roots.add(name)
        alloc = self._sample(Phase.RECOMPUTE if self._recompute else Phase.FORWARD, name, ("pre", name))
        if outer:  # the root: its inputs, and start watching saved tensors
            self._failed = None  # an error caught by the script, which goes on
            if not self._recompute:
                for t in _leaves(args):
                    if self._on_device(t):
                        for s in _parts(t):
                            self._ledger.add(s, Category.INPUTS, name)
                self._saved_seen.clear()
            # Also while recomputing: what the recomputation keeps for the
            # backward in progress are activations again. A forward before this one that no
            # backward followed (an evaluation with gradients on) left them on (_on_post): they
            # serve this one as they are (hooks pushed since chain through them).
            if self._recompute or self._saved_hooks is None:
                self._push_saved_hooks()
        span = _Span(name, alloc)
        self._fwd.append(span)
        if not self._recompute and self._watches_backward(name, outer):
            span.ends = bool(_on_first_grad(args, lambda g, n=name: self._on_backward_end(n), self._step_handles))

    def _watches_backward(self, name: str, outer: bool) -> bool:
        """Whether to sample where ``name``'s backward begins and ends: always
        in a full step, in a cheap one for the root and the peak's modules."""
        return self._full or outer or name in self._plan.modules

    def _adopt_compiled(self, module: nn.Module, args: tuple) -> str | None:
        """The name of the tracked module that ``module`` compiles (``torch.compile(m)``'s
        wrapper, called by the script where ``m`` was tracked), or None. Its forward runs
        compiled, hooks of ``m`` and its submodules inlined (see _on_pre): from now on the
        wrapper stands for ``m``, its hooks for ``m``'s, the root's included."""
        inner = _uncompiled(module)
        name = self._names.get(inner) if inner is not module else None
        if name is None:
            return None
        self._names[module] = name
        self._by_name[name] = weakref.ref(module)
        if any(ref() is inner for ref in self._roots):
            self._handles += [nn.Module.register_forward_pre_hook(module, Shared(self._on_root_pre), with_kwargs=True),
                              nn.Module.register_forward_hook(module, Shared(self._on_root_post), always_call=True)]
            self._on_root_pre(module, args, {})  # this call's hooks were gathered before that one
        return name

    def _call_name(self, module: nn.Module) -> str | None:
        """``module``'s name in the forward now running: a shared one's path under the module calling it."""
        paths = self._paths.get(module) if self._paths else None
        if paths is not None and self._fwd:
            return paths.get(self._fwd[-1].name, self._names.get(module))
        return self._names.get(module)

    def _on_post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        # (kwargs, output); (output,) where the forward raised: PyTorch calls a process-wide
        # always_call hook without kwargs then.
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        if not self._active or self._done or transformed():  # see _on_pre
            return
        if self._no_grad_call is not None:
            if self._no_grad_call() is module:
                self._no_grad_call = None
            return
        paths = self._paths.get(module) if self._paths else None
        name = self._fwd[-1].name if paths and self._fwd and self._fwd[-1].name in paths.values() else (
            self._names.get(module))
        if name is None or not self._fwd or self._fwd[-1].name != name:
            return
        if output is None and self._failed is None:
            # Called (always_call) while an error unwinds the forward: note
            # where it struck before the phases unwind with it.
            error = sys.exc_info()[1]
            if isinstance(error, torch.OutOfMemoryError):
                self._failed = (_describe(error), self._phase_now())
        span = self._fwd[-1]
        outer = len(self._fwd) == 1
        if outer:
            self._pop_saved_hooks()
            if not self._recompute and _top_saved_tensors_hooks() is None:
                # On again until backward is called (_wrap_backward): what the loss saves for backward
                # (cross-entropy's log-probabilities, a square's input: the model's output) is an
                # activation, of the root, not a temporary. Only where no other hooks are on: hooks
                # come off innermost first, and a context around this forward (a checkpoint segment
                # of checkpoint_sequential, whose layers are called as the model is) ends first.
                self._push_saved_hooks()
        event = ("post", name)
        if not outer:
            alloc = self._sample(Phase.RECOMPUTE if self._recompute else Phase.FORWARD, self._fwd[-2].name, event)
        elif self._recompute:  # back to the backward that asked for it
            alloc = self._sample(*self._backward_phase(self._bwd), event)
        else:
            alloc = self._sample(Phase.LOSS, "", event)
        self._fwd.pop()
        if self._recompute:
            # The recomputed graph is not the one backward runs through; the
            # module's forward was measured when it first ran.
            return
        if self._full:
            self._fwd_delta[name] = max(self._fwd_delta[name], max(span.high, alloc) - span.start)
        if self._watches_backward(name, outer):
            if not span.ends and kwargs:
                # Inputs passed by keyword (Hugging Face's layers: self_attn(hidden_states=...)), which
                # the process-wide pre-hook is not given: without them its backward never ended.
                span.ends = bool(_on_first_grad(kwargs, lambda g, n=name: self._on_backward_end(n),
                                                self._step_handles))
            if not span.ends:
                self._unended.add(name)
            # An output that is one of the inputs (nn.Identity, a dropout that does nothing) passed
            # through: backward reaches it where the module's backward would end, and no further
            # backward of the module's begins there (its hook would fire after the end's and open
            # a span nothing closes).
            passed = [*_tensors(args), *_tensors(kwargs)]
            made = [t for t in _tensors(output) if not any(t is x for x in passed)]
            outs = _on_first_grad(made, lambda g, n=name: self._on_backward_start(n), self._step_handles)
            if outer and outs:
                self._hook_graph(outs)

    def _push_saved_hooks(self) -> None:
        inner = _top_saved_tensors_hooks()
        pack_inner, unpack_inner = inner if inner else (None, None)
        pack = self._pack(pack_inner)
        unpack = unpack_inner if unpack_inner is not None else _identity
        pack.memprof_own = True  # it makes no tensors of the device's (virtual_cuda._in_mode)
        # Seen through by torch.utils.checkpoint (torch >= 2.14) as its own hooks are: the hooks a
        # selective checkpoint region finds around it are the script's (none: no FutureWarning,
        # and the tensors it caches are not handed to this hook; _wrap_sac_cache counts them).
        pack._checkpoint_internal, pack._user_hooks = True, inner
        self._chained = inner is not None
        self._saved_hooks = saved_tensors_hooks(pack, unpack)
        self._saved_hooks.__enter__()
        # Hooks the script pushes inside the forward (save_on_cpu around some layers,
        # torchtune's NoOpManager in a pre-hook) replace these while they are on: they are
        # chained through the same accounting, or what they keep on the device is unseen.
        module = torch._C._autograd
        push = module._push_saved_tensors_default_hooks

        def push_chained(pack_hook: Callable, unpack_hook: Callable) -> None:
            if getattr(pack_hook, "memprof_own", False):
                return push(pack_hook, unpack_hook)
            chained = self._pack(pack_hook)
            if getattr(pack_hook, "_checkpoint_internal", False):  # checkpoint's own (see above)
                chained._checkpoint_internal, chained._user_hooks = True, getattr(pack_hook, "_user_hooks", None)
            push(chained, unpack_hook)

        module._push_saved_tensors_default_hooks = push_chained
        self._pushes = (push, push_chained)

    def _pack(self, inner: Callable | None) -> Callable:
        """The saved-tensors pack hook: what stays on the device after ``inner`` (the hook chained
        to, or None) is an activation of the module running."""
        def pack(t: torch.Tensor) -> Any:
            # Detached: the tensor itself would hold its grad_fn, the node that saves it, in a
            # reference cycle through C++ that no collector breaks: a graph dropped without a
            # backward (an evaluation with gradients on, outputs no loss uses, TorchScript's
            # autodiff under no_grad) would never free what it saved.
            packed = inner(t) if inner is not None else t
            if not self._simulated:  # a real GPU's: no torch-function mode to leave (every saved tensor)
                return self._kept(t, packed)
            # On the simulated GPU in backward (checkpointing's recomputation) its mode is on:
            # every property read would go through it.
            with torch._C.DisableTorchFunction():
                return self._kept(t, packed)

        return pack

    def _kept(self, t: torch.Tensor, packed: Any) -> Any:
        """What a pack hook returns for ``t``, ``packed`` by the hook chained to (or ``t``)."""
        # What stays on the device is what the (possibly chained) hook kept: save_on_cpu
        # returns a host copy, which costs the device nothing; a compressing hook (ActNN's
        # habit) its own tensors, in a tuple (int8 values, their scale), which are the activation.
        for kept in _tensors(packed):
            if self._on_device(kept):
                self._on_saved(kept)  # (the tensor itself: a parameter FSDP gathered is one)
        return packed.detach() if packed is t else packed

    def _wrap_backward(self) -> None:
        """Take the saved-tensors hooks off where backward is called: they stay on from the model's
        forward through the loss (see _on_post), and autograd's engine runs with a copy of this thread's
        hooks, so popping them from inside backward would leave them on here after it. Every backward
        (``Tensor.backward``, ``torch.autograd.backward`` and ``grad``) calls the engine through
        ``_engine_run_backward``, where it is defined and where torch.autograd imported it."""
        import torch.autograd as autograd
        import torch.autograd.graph as graph

        own = vars(graph)["_engine_run_backward"]
        tracker = weakref.ref(self)

        @functools.wraps(own)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            t = tracker()
            if t is not None:
                t._eval_with_grad = []  # forwards in eval mode that backward follows are training (frozen norms)
            if t is not None and not t._fwd and not t._recompute and t._hooks_innermost():
                t._pop_saved_hooks()
            if t is not None and torch._C._current_graph_task_id() != -1 and (args or "t_outputs" in kwargs):
                # A backward inside backward (reentrant checkpointing, reversible layers): its graph,
                # made inside the outer one's backward, has none of this step's node hooks.
                t._hook_nested(args[0] if args else kwargs["t_outputs"])
            elif t is not None and (args or "t_outputs" in kwargs):
                t._hook_loss(args[0] if args else kwargs["t_outputs"])
            return own(*args, **kwargs)

        for module in (graph, autograd):
            if vars(module).get("_engine_run_backward") is own:
                module._engine_run_backward = run_backward
                self._patched.append((module, "_engine_run_backward", own))

    def _wrap_checkpoint_inputs(self) -> None:
        """Keep a non-reentrant checkpoint's inputs out of the tracker's saved-tensors hooks.

        Under any saved-tensors hooks, ``torch.utils.checkpoint`` hands its recomputation
        each input as a new tensor object (autograd's SavedVariable wraps what an unpack
        hook returns), so one tensor passed twice arrives as two: nn.MultiheadAttention's
        ``query is key`` fast path then differs between forward and recomputation, and
        checkpoint stops with "Recomputed values ... have different metadata" (an
        nn.Transformer checkpointed by layer, under memprof.track only). While the block
        runs, ``save_inputs`` of checkpoint's frame class (the class, as for zero_grad)
        records the inputs as the hooks would and saves them with the tracker's hooks set
        aside, where they are the ones in effect."""
        cls = _checkpoint_frame()
        if cls is None:
            return
        own = vars(cls)["save_inputs"]
        tracker = weakref.ref(self)

        @functools.wraps(own)
        def save_inputs(frame: Any, *args: Any) -> None:
            t = tracker()
            hooks = t._saved_hooks if t is not None else None
            top = _top_saved_tensors_hooks()
            if hooks is None or top is None or top[0] is not hooks.pack_hook:
                return own(frame, *args)
            if t._chained:
                # The hooks chained to (save_on_cpu, the script's own) save the inputs as without
                # memprof, new objects and all; the tracker's pack counts what they keep.
                return own(frame, *args)
            for a in args:
                if isinstance(a, torch.Tensor) and t._on_device(a):
                    t._on_saved(a)
            torch._C._autograd._pop_saved_tensors_default_hooks()
            try:
                return own(frame, *args)
            finally:
                torch._C._autograd._push_saved_tensors_default_hooks(hooks.pack_hook, hooks.unpack_hook)

        cls.save_inputs = save_inputs
        self._patched.append((cls, "save_inputs", own))

    def _wrap_func_transforms(self) -> None:
        """Set the tracker's saved-tensors hooks aside while a torch.func transform runs inside the
        model's forward (a contractive autoencoder's Jacobian penalty, ``vmap(jacrev(encode))``).
        ``grad``, ``vjp``, ``jacrev`` and ``hessian`` refuse saved-tensors hooks: they enter
        ``torch.autograd.graph.disable_saved_tensors_hooks``, which raises while any is on, so the
        script failed under memprof alone. What the transform saves is then not a module's
        activation (it counts as temporaries); hooks of the script's own still fail, as without
        memprof."""
        import torch.autograd.graph as graph

        own = vars(graph)["disable_saved_tensors_hooks"]
        tracker = weakref.ref(self)

        @contextlib.contextmanager
        def disable_saved_tensors_hooks(error_message: str) -> Any:
            t = tracker()
            hooks = t._saved_hooks if t is not None and t._hooks_innermost() else None
            if hooks is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            try:
                with own(error_message):
                    yield
            finally:
                if hooks is not None:
                    torch._C._autograd._push_saved_tensors_default_hooks(hooks.pack_hook, hooks.unpack_hook)

        graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks
        self._patched.append((graph, "disable_saved_tensors_hooks", own))

    def _wrap_sac_cache(self) -> None:
        """Count what selective activation checkpointing keeps for backward as activations.

        Its caching dispatch mode (``create_selective_checkpoint_contexts``, torchtitan's
        per-op policy) keeps the outputs its policy saves in a storage of its own, outside
        autograd's saved tensors, where no saved-tensors hook sees them: they were
        temporaries. While tracking, the mode's ``__torch_dispatch__`` (the class's, as for
        ``save_inputs``) reports each output it kept on the device."""
        import torch.utils.checkpoint as checkpoint

        cls = getattr(checkpoint, "_CachingTorchDispatchMode", None)
        if cls is None or "__torch_dispatch__" not in vars(cls):
            return
        own = vars(cls)["__torch_dispatch__"]
        key_of = getattr(checkpoint, "_sac_storage_key", lambda func, args: func)
        tracker = weakref.ref(self)

        @functools.wraps(own)
        def dispatch(mode: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            key = key_of(func, args)
            before = len(mode.storage.get(key, ()))
            out = own(mode, func, types, args, kwargs)
            t, kept = tracker(), mode.storage.get(key)
            if t is None or not (t._active and t._profiled) or kept is None or len(kept) == before:
                return out  # an op the policy does not see (SAC_IGNORED_OPS)
            # The entry made now: the last of the op's list (older torch), or its highest call number.
            entry = kept[max(kept)] if isinstance(kept, dict) else kept[-1]
            with torch._C.DisableTorchFunction():
                for w in torch.utils._pytree.tree_leaves(entry):
                    v = getattr(w, "val", None)  # checkpoint's _VersionWrapper; _RECOMPUTE has none
                    if isinstance(v, torch.Tensor) and t._on_device(v):
                        t._on_saved(v)
            return out

        cls.__torch_dispatch__ = dispatch
        self._patched.append((cls, "__torch_dispatch__", own))

    def _hooks_innermost(self) -> bool:
        """Whether this tracker's saved-tensors hooks are on and the innermost (a pop takes the
        innermost hooks, whoever pushed them)."""
        top = _top_saved_tensors_hooks()
        return self._saved_hooks is not None and top is not None and top[0] is self._saved_hooks.pack_hook

    def _pop_saved_hooks(self) -> None:
        if self._pushes is not None:
            (push, ours), self._pushes = self._pushes, None
            if torch._C._autograd._push_saved_tensors_default_hooks is ours:
                torch._C._autograd._push_saved_tensors_default_hooks = push
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _on_saved(self, t: torch.Tensor) -> None:
        if self._done:
            return
        storage = _storage(t)
        module = self._fwd[-1].name if self._fwd else self._root_name
        led = self._ledger
        if storage in led:
            # A weight, or a storage saved before: the first module to save a
            # storage owns it, and a later save (the next Linear saving a ReLU's
            # output) adds nothing live.
            if not self._full:
                return
            added = 0
        else:
            base = t._base
            if isinstance(t if base is None else base, nn.Parameter):
                # A parameter the model did not register before the step: FSDP's
                # gathered (unsharded) copy, whose storage it frees and re-fills
                # in place (see _wrap_resize).
                led.add(storage, Category.PARAMETERS, module, "gathered")
            added = led.add(storage, Category.ACTIVATIONS, module)
        if added >= self._big:
            self._sample(self._kind, self._phase_module, ("saved", ""))
        if not self._full:
            return  # activations saved over the step are counted by full steps
        entry = self._ledger.get(storage)
        if entry is None or entry.category in (Category.PARAMETERS, Category.BUFFERS):
            return
        # Over the step, every module row that this save happens inside counts
        # the storage once; its ancestors have counted it whenever it has.
        ref = weakref.ref(storage)
        seen = self._saved_seen
        for name in self._ancestors(module):
            key = (name, ref)
            if key in seen:
                break
            seen.add(key)
            self._saved_over_step[name] += entry.nbytes

    # -- hooks: backward -------------------------------------------------------
    def _hook_nested(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Hook the graph a backward inside backward runs through, every node of it."""
        if self._profiled and self._active and not self._done:
            self._hook_graph([outputs] if isinstance(outputs, torch.Tensor) else outputs, nested=True)

    def _hook_graph(self, outputs: Iterable[torch.Tensor], nested: bool = False) -> None:
        """Hook every autograd node of this forward (or of a graph made in backward, ``nested``)
        to name the gradients it produces."""
        # One bound method for every node: each node keeps its hook until the
        # graph dies, and thousands of objects living that long make Python's
        # garbage collector scan the whole heap more often.
        hook = self._node_hook
        todo = list({t.grad_fn for t in outputs if t.grad_fn is not None})
        if not todo:
            return
        floor = None
        if not nested:
            top = self._graph_top = max(n._sequence_nr() for n in todo)
            # A cheap step hooks the nodes backward runs before its bracket closes
            # (see _Plan), with a margin: a node hooked needlessly only costs its call.
            floor = None if self._full else top - (self._plan.depth * 5 // 4 + 32)
        _hook_nodes(todo, hook, lambda node: floor is None or node._sequence_nr() >= floor)

    def _hook_loss(self, outputs: Any) -> None:
        """Hook the nodes between what backward starts from and the model's output (a loss computed
        outside the model: cross-entropy's log-softmax and NLL), which :meth:`_hook_graph`, at the
        model's output, does not reach: their gradients are activation gradients, and the large one
        they make (the logits' gradient, beside the log-probabilities still saved for it) is sampled
        as it is made. A language model with a large vocabulary peaks there, and the interval's end
        had named the log-probabilities and both gradients temporaries. Where the allocator's counters
        are (CUDA, simulated): on the CPU the peak is the highest sample, and these are no samples of it."""
        self._read_coupling(outputs)
        if (self._transformed_forward and not self._done and self._profiled
                and self._active and not transformed()):
            # The forward ran where no hook could watch it (inside torch.func's transforms): what its
            # graph's nodes saved is the root's activations, claimed before the backward frees them.
            # Also where the model ran outside them too (a PINN's boundary loss beside its vmap(hessian)
            # residual): those saves are known already, and the ledger keeps their first owner.
            self._transformed_forward = False
            self._claim_graph(outputs)
            if self._graph_top is None:
                self._sample(Phase.BACKWARD, "", ("bwd_start", ""))
                return
            # Backward's peak is measured from here: the claimed saves are the interval's start.
            self._sample(self._kind, self._phase_module, ("bwd_start", ""))
        if (self._done or not self._profiled or not self._active or self._graph_top is None
                or not self._counters.available):
            return
        top = self._graph_top
        todo = [t.grad_fn for t in ([outputs] if isinstance(outputs, torch.Tensor) else outputs)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        _hook_nodes(todo, self._node_hook, lambda node: node._sequence_nr() > top)  # not the model's, hooked already

    def _read_coupling(self, outputs: Any) -> None:
        """The couplings of the samples in the graph behind ``outputs``, in the first profiled step's
        backward calls only (a GAN's two, a step's micro-batches): one walk of a graph a run, not a step."""
        if not (self._active and self._profiled and self._coupling_step in (None, self.step)):
            return
        self._coupling_step = self.step
        shape = next((s for s, i in self._batches.items() if i == self._batch), ())
        try:
            found = sample_coupling(outputs, {dims[0] for dims in shape if dims and isinstance(dims[0], int)})
        except Exception as exc:  # a graph of a kind not foreseen: the advice loses a caveat, the run goes on
            log.warning("memprof could not read how the samples meet in this step's graph (%s: %s); the advice "
                        "will not say what accumulation changes", type(exc).__name__, exc)
            self._coupling_step = -1
            return
        for kind, n in found.items():  # the same graph may be walked twice (retain_graph): the most, not the sum
            self._coupling[kind] = max(self._coupling.get(kind, 0), n)

    def _claim_graph(self, outputs: Any) -> None:
        """Every tensor the autograd graph behind ``outputs`` saved (its nodes' ``_saved_*``), on the
        device, as an activation of the root."""
        def claim(node: Any) -> None:
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # freed already (a backward before, without retain_graph)
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor) and self._on_device(t):
                        self._ledger.add(_storage(t), Category.ACTIVATIONS, self._root_name)

        todo = [t.grad_fn for t in ([outputs] if isinstance(outputs, torch.Tensor) else outputs)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        with torch._C.DisableTorchFunction():
            _walk_nodes(todo, claim, lambda node: True)

    def _on_node_grads(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if self._done or not self._profiled or not self._active:
            return
        if self._full and self._graph_top is not None:
            node = torch._C._current_autograd_node()  # the node whose hook this is
            if node is not None:
                self._depth = max(self._depth, self._graph_top - node._sequence_nr())
        module = self._phase_module or self._root_name
        add, on_device = self._ledger.add, self._on_device
        added = 0
        for i, g in enumerate(grad_inputs):
            if g is not None and on_device(g):
                # A large gradient bound for a parameter without one is its .grad already: AccumulateGrad
                # takes it as it is (accumulate_grad.h), after this hook, where a peak is sampled.
                owner = self._gradient_of(i) if g.numel() * g.element_size() >= self._big else None
                if owner is not None:
                    added += add(_storage(g), Category.GRADIENTS, owner)
                else:
                    added += add(_storage(g), Category.ACTIVATION_GRADIENTS, module)
        if added >= self._big:
            # A large gradient was just produced, and the node's saved tensors
            # are still alive (autograd frees them after its post hooks): the
            # likeliest moment of a backward peak, so look at it exactly.
            self._sample(self._kind, self._phase_module, ("node", ""))

    def _gradient_of(self, i: int) -> str | None:
        """The module of the parameter the running node's ``i``-th input gradient goes to, where it
        goes to a parameter (an AccumulateGrad) that has no gradient yet, else None."""
        node = torch._C._current_autograd_node()
        try:
            variable = getattr(node.next_functions[i][0], "variable", None) if node is not None else None
        except (IndexError, RuntimeError):
            return None
        if variable is None or variable.grad is not None:
            return None
        known = self._param_names.get(variable)
        return known[0] if known is not None else None

    def _backward_phase(self, names: Iterable[str]) -> tuple[Phase, str]:
        # The innermost open module: a module and its last child share an
        # output tensor, and the child's hook fires first.
        inner = max(names, key=lambda n: n.count("."), default="")
        return Phase.BACKWARD, inner

    def _on_backward_start(self, name: str) -> None:
        if self._done or not self._active or not self._profiled or name in self._bwd:
            return
        task = torch._C._current_graph_task_id()
        if task != self._bwd_task:
            # Autograd calls this back when the whole backward is done (as
            # FSDP does): the end of backward is then a sample, not a guess.
            self._bwd_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_done)
        # A module whose end no hook sees is done where a module outside it begins its backward
        # (RAFT's update block, given coords.detach(): else every later sample was named after it).
        for other in [n for n in self._bwd if n in self._unended and not name.startswith(n + ".")]:
            self._close_backward(other)
        alloc = self._sample(*self._backward_phase([*self._bwd, name]), ("bwd_start", name))
        self._bwd[name] = _Span(name, alloc)

    def _on_backward_end(self, name: str) -> None:
        if not self._done and self._active and self._profiled and name in self._bwd:
            self._close_backward(name)

    def _on_backward_done(self) -> None:
        self._bwd_task = None
        if self._active and self._profiled:
            if self._full:
                # Gradients no AccumulateGrad made (FSDP1 with use_orig_params sets .grad itself) or
                # whose parameters did not require grad when the step began (Lightning's
                # toggle_optimizer): their hooks were not there to see them.
                self._refresh_gradients()
            self._end_backward(Phase.AFTER_BACKWARD, ("backward_done", ""))

    def _close_backward(self, name: str) -> None:
        alloc = self._sample(*self._backward_phase(n for n in self._bwd if n != name), ("bwd_end", name))
        span = self._bwd.pop(name)
        if self._full:
            self._bwd_delta[name] = max(self._bwd_delta[name], max(span.high, alloc) - span.start)

    def _end_backward(self, kind: Phase, event: tuple[str, str]) -> None:
        """Sample, beginning phase ``kind``, and close every open backward span there."""
        alloc = self._sample(kind, "", event)
        if self._full:
            for name, span in self._bwd.items():
                self._bwd_delta[name] = max(self._bwd_delta[name], max(span.high, alloc) - span.start)
        self._bwd.clear()
        self._unended.clear()

    def _on_grad_accumulated(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is not None and self._on_device(g):
            known = self._param_names.get(p)
            owner = known[0] if known is not None else getattr(self._ledger.get(_storage(p)), "module", None)
            if owner is not None:  # else a copy's parameter (copy.deepcopy of the model), its hook shared
                self._ledger.add(_storage(g), Category.GRADIENTS, owner, replace=True)

    # -- hooks: optimizer ------------------------------------------------------
    def _is_ours(self, opt: torch.optim.Optimizer) -> bool:
        known = self._optimizers.get(opt)
        if known is None:
            if self._given is not None:  # or a wrapper of one given (timm's Lookahead, SAM)
                known = any(ref() in _wrapped(opt) for ref in self._given)
            else:  # an optimizer over the tracked model's parameters
                led = self._ledger
                known = any(
                    (e := led.get(_storage(p))) is not None and e.category is Category.PARAMETERS
                    for g in opt.param_groups
                    for p in g["params"][:1]
                )
            self._optimizers[opt] = known
            if known:
                self._unwatch_manual()
                self._wrap_zero_grad(opt)
                if self._primary is None:
                    self._primary = weakref.ref(opt)
                if self._active and self._profiled:
                    self._adopt_optimizer_state(opt)
        return known

    def _adopt_optimizer_state(self, opt: torch.optim.Optimizer) -> None:
        """Count the state of an optimizer first met at its ``step()`` from the
        beginning of this step. An optimizer creates its state only in
        ``step()``, so what it holds now was there before the step began:
        the samples taken so far called it temporaries (or, without the
        allocator's counters, missed it)."""
        led = self._ledger
        before = led.totals[Category.OPTIMIZER_STATE]
        with led.backdated():
            self._record_optimizer_state(opt)
        b = led.totals[Category.OPTIMIZER_STATE] - before
        if not b:
            return
        counted = self._counters.available  # else the samples' totals are the ledger's sums
        snapshots = [self._last_totals]
        if self._peak is not None:
            high, phase, totals, reserved, mark = self._peak
            if totals is not self._last_totals:
                snapshots.append(totals)
            if not counted:
                self._peak = (high + b, phase, totals, reserved, mark)
        for totals in snapshots:
            totals[Category.OPTIMIZER_STATE] = totals.get(Category.OPTIMIZER_STATE, 0) + b
        if not counted:
            self._last_alloc += b
        i = 6 + _NAMED.index(Category.OPTIMIZER_STATE)  # (step, seq, phase, allocated, interval_peak, reserved, *named, temporaries)
        for n, row in enumerate(self._rows):
            row = list(row)
            row[i] += b
            if counted:
                row[-1] -= b
            else:
                row[3] += b
                row[4] += b
            self._rows[n] = tuple(row)

    def _on_optimizer_pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict):
        if not self._is_ours(opt) or not self._profiled or transformed():  # a CUDA graph's capture
            return None
        # args[0] is the optimizer itself (torch.optim.Optimizer.profile_hook_step)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._enter_optimizer()
            return None
        # Lightning and LBFGS run forward and backward inside step(closure):
        # the update begins when the closure returns.
        def wrapped():
            try:
                return closure()
            finally:
                self._enter_optimizer()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _enter_optimizer(self) -> None:
        self._end_backward(Phase.OPTIMIZER_STEP, ("optimizer", ""))
        if self._simulated and self._optimizer_flops_at is None:  # (every optimizer of the step, to its end)
            self._optimizer_flops_at = getattr(self._counters, "flops", None)  # none without a simulated allocator

    def _on_optimizer_post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._is_ours(opt) or transformed():  # a step captured in a CUDA graph is not one run
            return
        if self._profiled:
            self._record_optimizer_state(opt, changed=True)  # Adam creates its state at the first step
        if self._cycle is not None:
            if any(ref() is opt for ref in self._cycle):
                self._primary, self._cycle = self._cycle[-1], None
            else:
                self._cycle.append(weakref.ref(opt))
        if self._primary is not None and self._primary() is opt:
            self._end_step()
            self.step += 1
            self._begin_step()

    # -- steps without an optimizer ---------------------------------------------
    def _watch_manual(self, model: nn.Module) -> None:
        """See steps that no optimizer ends (:mod:`memprof.manual_steps`): until an
        optimizer of the model steps, a step also ends where the model's next forward
        begins after a backward reached its parameters and their gradients were reset."""
        watch = GradientWatch(model)
        if watch.trainable:
            self._manual = watch
            self._manual_hook = nn.modules.module.register_module_forward_pre_hook(self._on_manual_pre)

    def _unwatch_manual(self) -> None:
        if self._manual is not None:
            self._manual.remove()
            self._manual_hook.remove()
            self._manual = self._manual_hook = None

    def _on_manual_pre(self, module: nn.Module, args: tuple) -> None:
        if (self._manual is None or transformed() or not any(module is ref() for ref in self._roots)
                or not self._manual.stepped()):
            return  # a call PyTorch gathered the hook for before it was removed; another module; the same step
        self._end_step()
        self.step += 1
        self._begin_step()
        if self._profiled:
            # The new step's forward hooks were installed after PyTorch gathered this call's.
            self._on_pre(module, args)
            self._entered = args

    # -- storages resized in place -----------------------------------------------
    def _wrap_resize(self) -> None:
        """Re-read a storage's size in the ledger when it is resized in place: FSDP frees a
        gathered parameter's storage with ``resize_(0)`` and fills it again before its next
        use (FSDP1 through TypedStorage._resize_, FSDP2 through free_storage), keeping the
        storage object, so no weak reference dies. A storage saved by checkpointing's
        recomputation (a detached view: no parameter to know it by) is sized the same way."""
        cls = torch.UntypedStorage
        own, resize = cls.__dict__.get("resize_"), cls.resize_
        tracker = weakref.ref(self)

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            t = tracker()
            if t is not None and t._active:
                t._ledger.resize(storage)
            return out

        cls.resize_ = resize_
        self._resize = (own, resize_)

    # -- zero_grad -------------------------------------------------------------
    def _wrap_zero_grad(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        """Name the phase of ``obj.zero_grad()``. PyTorch has no hook for it, so
        while the block runs ``zero_grad`` of ``obj``'s class is wrapped: the
        class, not the instance, so that pickling or copying ``obj`` meets
        nothing of memprof's. Other instances of the class pass straight through."""
        cls = type(obj)
        if any(patched is cls for patched, _, _ in self._zero_grads):
            return
        inherited = getattr(cls, "zero_grad", None)
        if inherited is None:
            return
        tracker = weakref.ref(self)

        @functools.wraps(inherited)
        def zero_grad(this: Any, *args: Any, **kwargs: Any) -> Any:
            t = tracker()
            if t is None or not t._active or not t._profiled or not t._is_zero_grad_target(this):
                return inherited(this, *args, **kwargs)
            resume = t._kind, t._phase_module
            t._sample(Phase.ZERO_GRAD, "", ("zero_grad", ""))
            try:
                return inherited(this, *args, **kwargs)
            finally:
                if t._active and t._profiled:
                    t._sample(*resume, ("zero_grad_end", ""))

        own = cls.__dict__.get("zero_grad")
        try:
            cls.zero_grad = zero_grad
        except TypeError:  # a class that takes no new attributes: its zero_grad stays unnamed
            return
        self._zero_grads.append((cls, own, zero_grad))

    def _is_zero_grad_target(self, obj: Any) -> bool:
        """The tracked model or one of its optimizers (not another instance of their classes)."""
        if isinstance(obj, torch.optim.Optimizer):
            return self._optimizers.get(obj) is True
        return any(obj is ref() for ref in self._roots)

    def _unwrap_zero_grads(self) -> None:
        for cls, own, wrapper in reversed(self._zero_grads):
            if cls.__dict__.get("zero_grad") is not wrapper:
                continue  # replaced since by someone else: theirs stays
            if own is not None:
                cls.zero_grad = own
            else:
                delattr(cls, "zero_grad")
        self._zero_grads.clear()

    # -- teardown --------------------------------------------------------------
    def _close(self) -> None:
        global _active
        self._active = False
        self._pop_saved_hooks()
        self._unwrap_zero_grads()
        if self._resize is not None:
            (own, ours), self._resize = self._resize, None
            if torch.UntypedStorage.__dict__.get("resize_") is ours:
                if own is None:
                    del torch.UntypedStorage.resize_
                else:
                    torch.UntypedStorage.resize_ = own
        while self._patched:
            cls, name, own = self._patched.pop()
            setattr(cls, name, own)
        if self._user_view is not None:
            view, self._user_view = self._user_view, None
            view.__exit__(None, None, None)
        for handle in (*self._step_handles, *self._handles):
            handle.remove()
        self._step_handles.clear()
        self._handles.clear()
        self._unwatch_manual()
        self._entered = None
        self._node_hook = None
        self._ledger.clear()
        self._recorded_state.clear()
        self._failed = None
        if _active is not None and _active() is self:
            _active = None

    @staticmethod
    def _resolve_device(model: nn.Module, device: torch.device | str | None,
                        optimizers: list[torch.optim.Optimizer]) -> torch.device:
        if device is None:
            p = next(iter(model.parameters()), None)
            if p is None or p.is_meta:
                # A model without memory of its own: a base model on 'meta' run functionally over the
                # optimizer's tensors (torch.func.functional_call, stack_module_state's ensembles).
                p = next((q for o in optimizers for g in o.param_groups for q in g["params"]), p)
            # A sharded parameter (DTensor) computes on its mesh's device, also
            # when FSDP keeps its shard on the host (CPU offload).
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                device = torch.device(mesh.device_type)
            else:
                device = p.device if p is not None else torch.device("cpu")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device {device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' or 'cpu'") from None
        from .virtual_cuda import current

        if current() is not None and device.type in ("cuda", "meta"):
            return torch.device("meta")  # the simulated GPU
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device


def _unprefixed(key: str) -> str:
    return key[len("module."):] if key.startswith("module.") else key  # DDP's and DataParallel's


def _virtual_device() -> Any:
    from .virtual_cuda import current  # imported here: the simulation imports the tracker

    return current()


def _identity(x: Any) -> Any:
    return x


_identity.memprof_own = True


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wraps (its ``OptimizedModule``), else ``model``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    return model._orig_mod if eval_frame and isinstance(model, eval_frame.OptimizedModule) else model


def _owner(root: str, qualified: str) -> str:
    """Module that owns a parameter or buffer named ``a.b.weight`` -> ``Root.a.b``."""
    prefix = qualified.rpartition(".")[0]
    return f"{root}.{prefix}" if prefix else root


_WORKSPACES = _NAMED.index(Category.WORKSPACES)


def _named(totals: dict[Category, int], allocated: int) -> list[int]:
    """The named categories' bytes (in ``_NAMED``'s order) out of ``allocated``.
    A block taken for one of cuBLAS's workspaces may be a tensor memprof
    learns of later in the step (an optimizer met at its first step): the
    workspaces give way rather than count it twice."""
    named = [totals.get(c, 0) for c in _NAMED]
    over = sum(named) - allocated
    if over > 0:
        named[_WORKSPACES] -= min(over, named[_WORKSPACES])
    return named


def _counts(totals: dict[Category, int], allocated: int, reserved: int | None) -> dict[str, int]:
    """A breakdown's bytes: the ledger's categories, the rest of ``allocated`` as
    temporaries, and what ``reserved`` holds beyond it (where known) as fragmentation."""
    counts = dict(zip((c.value for c in _NAMED), _named(totals, allocated)))
    counts[Category.TEMPORARIES.value] = allocated - sum(counts.values())
    if reserved is not None:
        counts[Category.FRAGMENTATION.value] = max(reserved - allocated, 0)
    return counts


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def track(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    device: torch.device | str | None = None,
    warmup: int = 3,
    every: int = 100,
    timeline_steps: int = 3,
    history: int = 10_000,
    full: bool = False,
    oom_dir: str | os.PathLike | None = ".",
) -> Tracker:
    """Attribute live training memory while the ``with`` block runs.

    ::

        with memprof.track(model) as prof:
            for batch in loader:
                loss = model(batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        print(prof.report())

    A step ends when the optimizer steps (found through PyTorch's global
    optimizer hooks unless given). A script that trains several models with
    an optimizer each (a GAN's generator and discriminator) tracks them as one:
    ``track(nn.ModuleDict({"G": netG, "D": netD}), [opt_d, opt_g])``, each
    model called as the script calls it, and a step ends when the last
    optimizer of the list steps. Several optimizers found automatically (Muon
    beside AdamW, or the list left out) end a step at the last of them to step
    in an iteration, learnt in the first: the one stepping before the first
    steps again. ``warmup`` steps are profiled, then every
    ``every``-th step (``every=1``: all; ``0``: none after warmup); the other
    steps cost one read of the allocator's counters.

    The first profiled steps are full ones: the counters are read at every
    module boundary. Once two of them peak at the same moment, the next
    profiled steps read the counters only around that moment (and at the
    step's coarse phases),
    which costs a fraction; a step that peaks elsewhere makes the next
    profiled step a full one again (``full=True``: every profiled step is a
    full one; ``report().meta["full_profiles"]`` lists them).

    What a run keeps is bounded, whatever its length. The steps table
    (``report().steps``) holds one row for each of the latest ``history``
    steps (``min(steps, history)`` rows), ``meta["profiled_steps"]`` and
    ``meta["full_profiles"]`` at most ``history`` step numbers each, and the
    timeline the samples of the latest ``timeline_steps`` full steps (at most
    50,000 a step). So a report grows by about 200 bytes of saved JSON a step
    until ``history`` steps have run (2 MB at the default), then stays that
    size. The rest the tracker holds is per module or per live storage, and
    a profiled step's hooks are removed when it ends or die with its graph.

    On CUDA, the categories of every sample add up to
    ``torch.cuda.memory_allocated()``, and a step's peak breakdown adds up to
    its ``max_memory_allocated()``. The tracker resets CUDA's peak counters
    between samples, but inside the block ``torch.cuda.max_memory_allocated()``,
    ``max_memory_reserved()`` and ``memory_stats()`` (and ``torch.accelerator``'s)
    answer what they would without memprof; after the block, peaks count from
    the end of its last step.

    When ``torch.OutOfMemoryError`` (also a simulated GPU's) leaves the block,
    what was live at that moment, by category and module, is written to
    ``memprof-oom-<time>.json`` and ``.html`` in ``oom_dir`` (None: nowhere;
    :meth:`Tracker.oom_report` builds it) and explained in one logged
    paragraph; the error propagates unchanged.
    """
    return Tracker(
        model, optimizer, device=device, warmup=warmup, every=every, timeline_steps=timeline_steps, history=history,
        full=full, oom_dir=oom_dir,
    )
