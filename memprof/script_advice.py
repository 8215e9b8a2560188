"""The advisor on an unmodified training script (``memprof advise train.py``).

A script's step is its own code, so plans cannot be composed from its parts
as :func:`memprof.advise` does with a :class:`~memprof.workload.Workload`.
Instead the script runs once, on the simulated target GPU (or the local one),
and between its optimizer steps the plans take turns on the model the runner
found: each plan's strategies (the same :mod:`memprof.strategies` objects the
workload door uses) are applied to a :class:`Workload` around that model, and
what they set there is bound to the model's forward:

* mixed precision: the model's forward runs under ``torch.autocast`` (a loss
  computed outside the model stays as the script computes it);
* checkpointing: the repeated blocks' forwards go through ``torch.utils.checkpoint``;
* accumulation over K micro-batches: each forward sees 1/K of every
  batch-sized input, the memory of one of K micro-batches; the step time is
  charged K times;
* activation offload: what forward saves goes to host memory;
* ZeRO and state offload: one rank's step, sharded analytically.

A plan runs two steps, the first after the allocator's free cache is
emptied; on the simulated GPU the second is derived from the first's
allocation events (:func:`memprof.simulate.replay_step`) when it repeats it.
A plan that breaks the script is left out and the script starts again for
the plans after it, as it does when it ends before every plan ran.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import re
import statistics
import sys
import types
import weakref
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import pandas as pd
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack as _function_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .aten_args import leaves, tensors
from .advisor import (Advice, PlanFactory, _adjusted, _name, _progress, _spread, _step_view, _with_expandable,
                      default_plans, fragmented, parse_budget, plan_changes, plan_table, rank)
from .caching import expandable_segments_configured
from .hooks import Shared, in_torch_func
from .devices import GPU, get_gpu
from .frames import _locals
from .report import Report
from .runner import ScriptError, observe_script, raised
from .tracker import _storage, _wrapped, active_tracker, own_forward
from .simulate import _HALF
from .workload import Workload
from .units import fmt_bytes

__all__ = ["ScriptAdvice", "advise_script", "verify_script"]

log = logging.getLogger(__name__)


def apply_to_script(strategies: list, model: nn.Module, optimizer: torch.optim.Optimizer, simulated: bool,
                    stack: ExitStack, facts: "ScriptFacts | None" = None) -> Workload:
    """Apply ``strategies`` to a script's ``model`` until ``stack`` closes.

    They change a :class:`Workload` around the model as they would any
    workload; what they set there is then bound to the model's forward.
    Accumulation over K micro-batches runs 1/K of the batch: the batch's
    tensors (of the model's batch size, ``facts``) are cut as they reach the
    device or are made there, and the model's forward cuts what it is still
    given whole.
    """
    w = Workload(model, optimizer, batch=None, loss_fn=None)
    stack.enter_context(w.plan(strategies, simulated=simulated))
    cut = None
    if w.micro_batches > 1:
        batch = facts.batch_size if facts is not None else None
        cut = _MicroBatchCut(w.micro_batches, batch, facts.micro_batches if facts is not None else 1, model)
        if batch and not cut.sizes:
            first = next(iter(facts.batch.items()), None)
            taken = f" (dimension 0 of {first[0]} {tuple(first[1][0])})" if first else ""
            raise ValueError(f"a batch of {batch} samples{taken} cannot be cut into {w.micro_batches} micro-batches "
                             "of equal size; where the batch is not the first dimension (a time-major recurrent "
                             "network's), accumulate in the script itself")
        stack.enter_context(cut)
        stack.enter_context(_later_micro_batches(model, optimizer, w.micro_batches))

    region = _AutocastRegion(w, stack) if w.autocast_dtype is not None else None
    live = [True]  # emptied when the plan is undone
    stack.callback(live.clear)

    def planned(forward):
        if cut is not None:
            forward = cut.wrap(forward)
        if w.saved_tensors_hooks is not None:
            forward = _under(w.saved_tensors_hooks, forward)
        if region is not None:
            forward = region.wrap(forward)
        return forward

    forward = model.forward  # (each read of a method makes a new bound method)
    if planned(forward) is forward:
        return w
    # The model's forward, and its children's for a model the script trains through its
    # methods (PPO's agent.get_action_and_value(x) calling self.actor(x) and self.critic(x),
    # a two-tower model's score()): the first of them to run applies the plan, the calls
    # inside it pass straight through.
    depth = [0]
    for module in _entries(model):
        w.patch(module, "forward", _outermost(module, planned(module.forward), depth, live))
    return w


class _AutocastRegion:
    """Autocast from the model's forward until backward, as autocast's code change asks ("wrap the
    forward pass and the loss"): a loss computed outside the model (criterion(model(x), y)) and what
    comes between them (CTC's log_softmax) run under it too, in fp32 where autocast says so (the
    logits' fp32 copy; CTC's loss takes no bf16 at all). It closes where backward begins (the
    gradients of PyTorch's AMP recipes are computed outside autocast), before an optimizer step,
    and when the plan ends."""

    def __init__(self, w: Workload, stack: ExitStack) -> None:
        self.dtype = w.autocast_dtype
        self._open: torch.autocast | None = None
        for owner, name in ((torch.Tensor, "backward"), (torch.autograd, "backward"), (torch.autograd, "grad")):
            w.patch(owner, name, self._closing(getattr(owner, name)))
        stack.callback(register_optimizer_step_pre_hook(lambda *args: self.close()).remove)
        stack.callback(self.close)

    def wrap(self, forward):
        @functools.wraps(forward)
        def under_autocast(*args, **kwargs):
            if not torch.is_grad_enabled():
                # Evaluation between steps, as the script runs it (under autocast, its casts of the
                # weights, made without gradients, would be cached for the step's forward).
                return forward(*args, **kwargs)
            if self._open is None and not torch.is_autocast_enabled("cuda"):
                self._open = torch.autocast("cuda", dtype=self.dtype)
                self._open.__enter__()
            return forward(*args, **kwargs)

        return under_autocast

    def _closing(self, fn):
        @functools.wraps(fn)
        def closing(*args, **kwargs):
            self.close()
            return fn(*args, **kwargs)

        return closing

    def close(self) -> None:
        if self._open is not None:
            region, self._open = self._open, None
            region.__exit__(None, None, None)


def _entries(model: nn.Module) -> list[nn.Module]:
    """Where a step enters ``model``: its forward, or its children's (those with a forward of
    their own) for a model trained through its methods."""
    return [model, *(c for c in model.children() if own_forward(c))]


def _outermost(module: nn.Module, planned, depth: list[int], live: list):
    """``module.forward`` as ``planned`` where no other of the functions sharing ``depth`` is
    running, while ``live`` (the plan is applied). A method of ``module``: ``copy.deepcopy`` of
    the module (an EMA, a model copied to evaluate) binds it to the copy, which runs its own
    forward (a function would have run this module's)."""
    plain = module.forward

    def forward(self, *args, **kwargs):
        if self is not module:
            return type(self).forward(self, *args, **kwargs)
        if not live:
            # A call PyTorch began before this plan was undone: it took the forward then, and the
            # plan changed in its hooks (where a step without an optimizer ends): the plan now.
            return module.forward(*args, **kwargs)
        if depth[0]:
            return plain(*args, **kwargs)
        depth[0] += 1
        try:
            return planned(*args, **kwargs)
        finally:
            depth[0] -= 1

    return types.MethodType(functools.wraps(plain)(forward), module)


@contextlib.contextmanager
def _later_micro_batches(model: nn.Module, optimizer: torch.optim.Optimizer | None, k: int):
    """Each step a micro-batch after the first of ``k``: the gradients the earlier ones left are there.

    The plan's step runs one micro-batch of K; the first of a real step's K makes the
    gradients as its backward goes, the others add into them (a whole set of gradients
    lives through their forward and backward: the K-micro-batch step's peak, unless the
    optimizer's step is higher). So the model's trainable parameters are given gradients
    where they have none, and zero_grad (the optimizer's, the model's) zeroes them in
    place instead of dropping them. Parameters held as other tensor types (FSDP's DTensors)
    are left as they are. A sparse embedding's gradient grows with each micro-batch instead:
    CUDA sums sparse gradients by concatenating their rows (``add_out_sparse_cuda``), so
    zero_grad leaves it with K - 1 times the rows one micro-batch made (zeros: row 0)."""
    # Keyed by identity: a tensor's == is elementwise (weakref.WeakSet would compare two weights by it)
    sparse = WeakIdKeyDictionary({m.weight: None for m in model.modules()
                                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse})
    carried = WeakIdKeyDictionary()  # sparse weight -> the rows the earlier micro-batches left
    with torch.no_grad():
        for p in sparse:  # a whole step's rows, where the script zeroes its gradients as a step begins
            if p.grad is not None and p.grad.is_sparse:
                carried[p] = p.grad._nnz() * (k - 1) // k
                p.grad = _zero_rows(p.grad, carried[p])
        for p in model.parameters():
            if (p.requires_grad and p not in sparse and type(p.data) is torch.Tensor
                    and (p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype)):
                p.grad = torch.zeros_like(p)

    def zero_grad(zero, owner, *args: Any, **kwargs: Any) -> None:
        for p in sparse:
            if p.grad is not None and p.grad.is_sparse and p.grad._nnz() > carried.get(p, 0):  # a micro-batch ran
                carried[p] = (k - 1) * (p.grad._nnz() - carried.get(p, 0))
        _zero_in_place(zero, owner, *args, **kwargs)
        with torch.no_grad():
            for p in sparse:
                g = p.grad
                if g is None or not g.is_sparse or g._nnz() == carried.get(p, 0):
                    continue
                p.grad = _zero_rows(g, carried[p])

    owners = [(o, vars(o).get("zero_grad")) for o in (optimizer, model) if o is not None]
    for owner, _ in owners:
        # Through the instance's __dict__: a wrapper's __setattr__ (Fabric's) would pass it on.
        vars(owner)["zero_grad"] = functools.partial(zero_grad, owner.zero_grad, owner)
    try:
        yield
    finally:
        for owner, own in owners:
            if own is None:
                del vars(owner)["zero_grad"]
            else:
                vars(owner)["zero_grad"] = own


def _zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """A sparse gradient like ``like`` of ``rows`` zero rows (each at index 0, uncoalesced)."""
    return torch.sparse_coo_tensor(like._indices().new_zeros((like.sparse_dim(), rows)),
                                   like._values().new_zeros((rows, *like.shape[like.sparse_dim():])),
                                   like.shape, is_coalesced=False, check_invariants=False)


def _zero_in_place(zero_grad, owner, set_to_none: bool = True, *args: Any, **kwargs: Any) -> None:
    try:
        zero_grad(False, *args, **kwargs)
    except RuntimeError:
        # A DTensor gradient pending a reduction (Partial: a sequence-parallel norm's weight) refuses an
        # in-place zero; its local tensor is what its memory is, and what accumulation adds into.
        params = ([p for g in owner.param_groups for p in g["params"]] if isinstance(owner, torch.optim.Optimizer)
                  else list(owner.parameters()))
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).zero_()


def _under(make_context, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with make_context():
            return fn(*args, **kwargs)

    return wrapped


# How a script's batch reaches the device: copied from the host, or made there.
_TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}
_FACTORIES = {torch.randn, torch.rand, torch.randint, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.tensor, torch.as_tensor, torch.Tensor.new_tensor, torch.Tensor.new_zeros, torch.Tensor.new_ones,
              torch.Tensor.new_empty, torch.Tensor.new_full}
_CUT_AT = _TO_DEVICE | _FACTORIES
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
# Where a script compares samples with their targets: the losses of torch.nn.functional (what
# nn.CrossEntropyLoss and its kin call) and equality (accuracy). Not any operator: a second model
# (a GAN's generator) runs outside the model too, and its batch norm's running mean may have
# as many elements as the batch has samples.
_SAMPLEWISE = {"kl_div", "eq", "ne", "__eq__", "__ne__"} | {
    name for name in dir(torch.nn.functional) if name.endswith(("_loss", "cross_entropy", "_with_logits"))}
# Elementwise operators between per-sample tensors outside the model (PPO's loss: the new log-probabilities
# against the minibatch's old ones, each picked from rollout buffers on the device by the same indices):
# where one operand is a whole batch and another of the same rank its micro-batch of more than one sample,
# the operator would raise (the two do not broadcast), so the whole one is cut as at a loss.
_ELEMENTWISE = {"add", "sub", "mul", "div", "maximum", "minimum", "where", "broadcast_tensors"} | {
    f"__{r}{op}__" for op in ("add", "sub", "mul", "truediv") for r in ("", "r")}


class _MicroBatchCut(TorchFunctionMode):
    """1/k of the batch, for a step of k micro-batches run as one of them.

    Outside the model's forward, a tensor of the batch's size (``batch``
    samples, or ``batch * script_micro_batches`` where the script splits a
    larger batch itself) that is copied to the device or made there is cut to its first
    1/k: inputs and the targets a loss outside the model compares them with
    alike. The model's forward cuts what it is given that is still whole
    (data made on the device before the plan began), and so does a loss or
    an equality outside it that meets a whole batch and a micro-batch (the
    cut output against targets a prefetcher copied during the step before:
    timm's ``PrefetchLoader``, apex's ``data_prefetcher``), or a whole batch's
    rows flattened with their positions and the micro-batch's (token targets
    made flat against the logits viewed as ``(-1, vocabulary)``), and an
    elementwise operator that meets a whole batch and a micro-batch of the
    same rank, which would not broadcast (PPO's new log-probabilities against
    the old ones picked by the same indices from a buffer on the device).
    Inside the forward nothing else is cut: the model's own tensors of that
    size (positions when the sequence is as long as the batch) are not samples.
    A copy to the device of a half, third or quarter of the batch is cut too:
    the parts a script joins on the device into the model's batch (DPO's chosen
    and rejected answers, SimCLR's two views), so each part gives the
    micro-batch its share, until the batch is copied whole. Where the batch is
    copied from the host, what is made on the device is not cut: it is no data."""

    def __init__(self, k: int, batch: int | None, script_micro_batches: int = 1, model: nn.Module | None = None) -> None:
        super().__init__()
        self.k = k
        self._model = weakref.ref(model) if model is not None else None
        self.batch = batch
        self.sizes = {n for n in (batch, batch * script_micro_batches if batch else None) if n and n % k == 0}
        self._parts = {n // k for n in self.sizes}
        self._joined = self.sizes | {n // m for n in self.sizes for m in (2, 3, 4) if n % m == 0 and n // m % k == 0}
        # What was cut where it reached the device: the script's own chunks of it (GradCache encodes its
        # queries 16 at a time) are views of a micro-batch already, not whole batches of the chunk's size.
        self._cut_storages: weakref.WeakSet = weakref.WeakSet()
        self._in_model = 0
        # A batch copied from the host: then a tensor of the batch's size made on the device is the
        # step's own (DINO's EMA teacher's drop-path noise, sized by its two views joined), not data.
        self._copied = False
        # A whole batch copied and cut: then a host tensor of a part's size is made from the cut
        # micro-batch (RAFT's noise, torch.randn(*image1.shape) copied to the device), not a part.
        self._whole = False
        #: Tensors (and length lists) cut so far: none in a step means its batch was not found.
        self.cuts = 0
        # The per-sample lengths (host tensors) that trimmed a copy's padding, latest first.
        self._trimmed_by: list[weakref.ref] = []

    def _cut(self, t: Any, device_only: bool = True, sizes: set[int] | None = None) -> Any:
        if (isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] in (sizes or self.sizes)
                and not (device_only and t.device.type == "cpu")):
            if t.is_nested:  # PyTorch slices no nested tensor along its batch ("slice(): not supported")
                raise ValueError("the batch is a nested jagged tensor, which memprof does not cut into micro-batches")
            self.cuts += 1
            return t[: t.shape[0] // self.k]
        return t

    def _within_part(self, t: Any, index: Any) -> Any:
        """An integer index into a cut tensor's first dimension that only the whole batch has (a
        per-sample loop over the script's batch size filling a mask made on the device): the same
        position in the micro-batch, index modulo its size. On the GPU the batch is whole, so such an
        index is never out of range there."""
        first = index[0] if isinstance(index, tuple) and index else index
        if (isinstance(t, torch.Tensor) and t.dim() and isinstance(first, int) and not isinstance(first, bool)
                and t.shape[0] in self._parts and t.shape[0] <= first < t.shape[0] * self.k):
            first %= t.shape[0]
            return (first, *index[1:]) if isinstance(index, tuple) else first
        return index

    def _evaluating(self) -> bool:
        """Whether the script evaluates now, not trains: gradients off (no_grad, inference_mode), or the
        model in eval mode (the Hugging Face Trainer's evaluation loop moves and pads its batches with
        gradients on, after model.eval())."""
        if not torch.is_grad_enabled():
            return True
        model = self._model() if self._model is not None else None
        return model is not None and not model.training

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._evaluating():  # evaluation between steps: not the step's
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if not self._in_model and (name in _SAMPLEWISE or name in _ELEMENTWISE):
            args, kwargs = self._match(args, kwargs, elementwise=name in _ELEMENTWISE)
        if not self._in_model and func in _INDEXING and len(args) > 1:
            args = (args[0], self._within_part(args[0], args[1]), *args[2:])
        out = func(*args, **kwargs)
        if self._in_model or func not in _CUT_AT:  # the model's operators: as fast as can be
            return out
        if func in _TO_DEVICE and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            if self._cut(out, sizes=self.sizes if self._whole else self._joined) is not out:
                # copied whole to the device: copy the part instead
                self._copied = True
                self._whole = self._whole or out.shape[0] in self.sizes
                return self._made(func(self._unpadded(args[0]), *args[1:], **kwargs))
        elif func in _FACTORIES and not self._copied:
            part = self._cut(out)
            if part is not out:
                return self._made(part.clone())  # its own storage, of the part's size
        return out

    def _unpadded(self, whole: torch.Tensor) -> torch.Tensor:
        """The first 1/k of a host batch, collated as a micro-batch of its own would be: without the
        padding that only a sample outside it needed. A collate function pads each batch to its
        longest sample (``pad_sequence``), so micro-batches collated one by one (a DataLoader of 1/k
        the batch size, Lightning's and Hugging Face's accumulation) are each as long as their own
        longest sample, and a model that sizes its masks from the per-sample lengths it is given
        (torchaudio's Conformer: ``arange(max(lengths)) >= lengths``) meets tensors of that length.
        The lengths are those the script holds beside the batch (:func:`_lengths_beside`); where
        none is found, or what they call padding is not, the part keeps the batch's length."""
        part = whole[: whole.shape[0] // self.k]
        if part.dim() < 2 or not part.numel():
            return part
        beside = _lengths_beside(whole.shape[0])
        for d in range(1, part.dim()):
            n = part.shape[d]
            found = [t for t in beside if int(t.max()) == n and int(t.min()) < n and _padded_by(whole, d, t)]
            # Lengths that trimmed a tensor of the batch already first: the text's lengths may explain the
            # stop-token targets' padding too where the frames' (which the mels need) are meant.
            lengths = next((t for t in found if any(t is r() for r in self._trimmed_by)), found[0] if found else None)
            if lengths is None:
                continue
            keep = int(lengths[: part.shape[0]].max())
            if 0 < keep < n:  # beyond it the part holds padding alone, which a longer sample outside it needed
                self._trimmed_by = [weakref.ref(lengths), *self._trimmed_by[:3]]
                return part.narrow(d, 0, keep).contiguous()
        return part

    def _made(self, part: Any) -> Any:
        if isinstance(part, torch.Tensor):
            self._cut_storages.add(_storage(part))
        return part

    def _match(self, args: tuple, kwargs: dict, elementwise: bool = False) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with whole batches cut where they meet a micro-batch (not
        parameters): tensors, on the device or not, and per-sample lengths as a list (CTC's
        ``input_lengths``, ``target_lengths``); for an ``elementwise`` operator, only a whole
        tensor beside a micro-batch of its rank and more than one sample (they would not broadcast)."""
        if elementwise:
            shapes = {(t.dim(), t.shape[0]) for t in leaves(args) if isinstance(t, torch.Tensor) and t.dim() > 0}
            wholes = {n for d, n in shapes if n in self.sizes and n // self.k > 1 and (d, n // self.k) in shapes}
            if not wholes:
                return args, kwargs
            return tree_map(lambda a: a if isinstance(a, nn.Parameter) else self._cut(
                a, device_only=False, sizes=wholes), args), kwargs
        values = (*args, *kwargs.values())
        firsts = [a.shape[0] if isinstance(a, torch.Tensor) else len(a) for a in values
                  if isinstance(a, torch.Tensor) and a.dim() > 0 or _lengths(a)]
        # A whole batch beside another operand of its micro-batch's size: one tensor of a size that is
        # both (16 rows where the script accumulates 2 of 16 itself) is not met with anything, so the
        # collator's labels.masked_fill(mask.ne(1), -100) on the host stays whole.
        # So is a whole batch's flattened tokens (targets made flat, batch x sequence rows, against the
        # micro-batch's logits flattened to (-1, vocabulary): a loss between the two raises otherwise).
        wholes = {n for i, n in enumerate(firsts) if (n in self.sizes or self._flattened(n))
                  and any(m == n // self.k for j, m in enumerate(firsts) if j != i)}
        if not wholes:
            return args, kwargs

        def cut(a):
            if _lengths(a) and len(a) in wholes:
                self.cuts += 1
                return type(a)(a[: len(a) // self.k])
            return self._cut(a, device_only=False, sizes=wholes) if not isinstance(a, nn.Parameter) else a

        return tuple(cut(a) for a in args), {k: cut(a) for k, a in kwargs.items()}

    def _flattened(self, n: int) -> bool:
        """Whether ``n`` rows are a whole batch's samples times the positions of each (a multiple of
        the batch, and the micro-batch's share a multiple of the micro-batch)."""
        return bool(self.batch) and n % self.batch == 0 and n > self.batch and n % self.k == 0

    def _samples(self, a: Any) -> bool:
        """Whether ``a`` is a list of one item per sample of the whole batch: DETR's and torchvision
        detection's per-image target dicts and images, captions, lengths. An item is no batch of
        its own (a list of per-layer tensors, each of the batch's size, is not one)."""
        return (isinstance(a, (list, tuple)) and len(a) in self.sizes and all(
            isinstance(x, (dict, str, int)) or isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] not in self.sizes)
            for x in a))

    def wrap(self, fn):
        """``fn`` (the model's forward) on 1/k of each argument still of the batch's size."""
        cut = self._cut if self.batch else _divisible(self.k)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if self._evaluating():  # evaluation between steps: as the script runs it
                return fn(*args, **kwargs)

            def part(a):
                if self._samples(a):  # the items' own tensors are not batches (a target with 8 boxes)
                    self.cuts += 1
                    return a[: len(a) // self.k]
                # (inside torch.func's transforms the arguments are wrappers, without storages)
                return tree_map(lambda t: t if isinstance(t, torch.Tensor) and not in_torch_func()
                                and _storage(t) in self._cut_storages else cut(t, device_only=False), a)

            args, kwargs = tuple(map(part, args)), {name: part(a) for name, a in kwargs.items()}
            self._in_model += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_model -= 1

        return wrapped


def _lengths_beside(batch: int, frames: int = 6) -> list[torch.Tensor]:
    """What may be per-sample lengths of a batch of ``batch`` samples, as the code copying the
    batch to the device holds them: host tensors of ``batch`` integers among the local variables
    (or one level into short ones: a dict's values, a tuple's items) of the nearest ``frames``
    callers (``for wavs, wav_lens in loader: wavs = wavs.cuda()``)."""
    found, frame = [], sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            break
        # (frames._locals, not frame.f_locals: before Python 3.13 its snapshot, kept by the frame, would
        # hold every variable's value past its rebinding: a micro-batch's logits through the next one's)
        values = [v for _, v in _locals(frame)]
        found += [t for t in leaves(*(v for v in values if not isinstance(v, (list, tuple, dict)) or len(v) <= 64))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 1 and len(t) == batch
                  and not t.is_floating_point() and not t.is_complex() and t.dtype is not torch.bool]
        frame = frame.f_back
    return found


def _padded_by(whole: torch.Tensor, d: int, lengths: torch.Tensor) -> bool:
    """Whether ``whole`` is padded after each sample's own length along ``d``: one value beyond every
    sample's length, and another within some sample's (a tensor of one value is no padded batch). The
    padding follows these lengths, not others of the same longest (Tacotron 2's text and frames), nor
    a fixed length (audio cut to 6 s, padded to 9)."""
    positions = torch.arange(whole.shape[d]).view([-1 if i == d else 1 for i in range(whole.dim())])
    beyond = (positions >= lengths.view([-1] + [1] * (whole.dim() - 1))).expand_as(whole)
    values = whole[beyond]
    if not values.numel():
        return False
    value = values[0]
    return bool((values == value).all()) and bool((whole[~beyond] != value).any())


def _lengths(a: Any) -> bool:
    """Whether ``a`` is a list or tuple of integers (a batch's per-sample lengths)."""
    return isinstance(a, (list, tuple)) and bool(a) and all(isinstance(x, int) for x in a)


def _divisible(k: int):
    """Without a known batch size: every tensor whose first dimension k divides."""

    def cut(t: Any, device_only: bool = False) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] >= k and t.shape[0] % k == 0:
            return t[: t.shape[0] // k]
        return t

    return cut


_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def _dtype(d: torch.dtype) -> str:
    return _SHORT.get(d, str(d).removeprefix("torch."))


@dataclass
class ScriptFacts:
    """What the script already does, as observed in its steps before any plan."""

    #: Autocast's dtype around the model's forward ("bf16", "fp16"), or None.
    autocast: str | None = None
    #: The parameters' dtype while the forward runs, where 16-bit ("bf16", "fp16"): a model
    #: cast to it, or FSDP's MixedPrecisionPolicy (stored in fp32, gathered in bf16); or None.
    forward_dtype: str | None = None
    #: Forward passes of the model per optimizer step (gradient accumulation).
    micro_batches: int = 1
    #: Modules whose forward runs again in backward (activation checkpointing).
    checkpointed: list[str] = field(default_factory=list)
    #: Whether that checkpointing is selective: a policy keeps some operators' outputs
    #: (``create_selective_checkpoint_contexts``, torchtitan's per-op mode).
    selective_checkpointing: bool = False
    #: Tensors the model's forward returned that the script passes back to its next forward
    #: (Transformer-XL's memory, a recurrent state): most seen in one call.
    carried_state: int = 0
    #: The model's input that couples the rows of its batch (a full-batch GNN's N x N adjacency, its
    #: 2 x E edge list): its name, or "".
    coupled_by: str = ""
    #: The optimizer's class and implementation ("fused", "foreach", "for-loop", or "default").
    optimizer: str = ""
    implementation: str = ""
    #: Parameter dtype -> number of parameters; frozen: parameters that do not require grad.
    parameters: dict[str, int] = field(default_factory=dict)
    frozen: int = 0
    #: The model's first forward's tensor arguments: name or position -> (shape, dtype).
    batch: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    #: Other optimizers that step over parameters outside the model (a GAN's other model):
    #: "Adam over 3.58 M parameters". The plans are for the model alone.
    also_trains: list[str] = field(default_factory=list)
    #: The model's own switch for activation checkpointing, as a call (Hugging Face's, timm's), or "".
    checkpointing_switch: str = ""
    #: Optimizers that step inside backward, as each gradient is made (torchtune's optimizer in
    #: backward: one per parameter, stepped by post-accumulate-grad hooks); 0 where none does.
    in_backward: int = 0
    #: Repeated blocks (:func:`find_blocks`) whose forward the step never called (a reversible
    #: model's irreversible twin of its layers): checkpointing them changes nothing.
    idle_blocks: list[str] = field(default_factory=list)
    #: The custom autograd Function whose backward runs the recomputed modules (reversible
    #: layers' ``_ReversibleFunction``, an ODE adjoint), where not ``torch.utils.checkpoint``.
    recomputed_by: str = ""
    #: Whether the caching allocator runs with expandable segments (PYTORCH_CUDA_ALLOC_CONF, often set
    #: in the script's own first lines).
    expandable_segments: bool = False
    #: The torch.func transforms the model's forward runs inside ("vmap, grad": functorch's MAML,
    #: per-sample gradients), outermost first; "" where it runs outside any.
    transformed: str = ""
    #: The torch.func transforms the model's forward runs inside itself, around some of its modules
    #: ("vmap, grad": a contractive autoencoder's ``vmap(jacrev(encode))``); "" where none.
    transforms_inside: str = ""
    #: Whose loop steps the optimizer, as a ``memprof.strategies.base.Door`` value: "script" (the
    #: script's own), "hf" (transformers' Trainer), "lightning" (Lightning's Trainer). The changes
    #: a plan asks for are phrased for it: TrainingArguments(...) where the Trainer runs the steps.
    trainer: str = "script"

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None, **facts: Any) -> "ScriptFacts":
        """The facts ``model`` and ``optimizer`` show by themselves (the optimizer's
        implementation, the parameters by dtype and those frozen), and ``facts``.
        No optimizer: the script updates the parameters itself (memprof.manual_steps)."""
        impl = "the script updates the parameters itself" if optimizer is None else _implementation(optimizer)
        counts: dict[str, int] = {}
        frozen = 0
        for p in model.parameters():
            counts[_dtype(p.dtype)] = counts.get(_dtype(p.dtype), 0) + p.numel()
            frozen += 0 if p.requires_grad else p.numel()
        name = "none" if optimizer is None else type(optimizer).__name__ + "".join(
            f"({type(o).__name__})" for o in _wrapped(optimizer)[:1])  # a wrapper's base: Lookahead(RAdam)
        return cls(optimizer=name, implementation=impl, parameters=counts, frozen=frozen,
                   checkpointing_switch=_checkpointing_switch(model), expandable_segments=_expandable_segments(),
                   **facts)

    @property
    def compute(self) -> str:
        """The dtype most parameters have (the forward computes in it without autocast)."""
        return max(self.parameters, key=self.parameters.get) if self.parameters else "fp32"

    @property
    def batch_size(self) -> int | None:
        """Samples per forward: the first dimension of its first tensor argument."""
        return next((shape[0] for shape, _ in self.batch.values() if shape), None)

    @property
    def _optimizers(self) -> str:
        """Each optimizer with its implementation: "AdamW (fused) + Muon (for-loop)"."""
        names, impls = self.optimizer.split(" + "), self.implementation.split(" + ")
        if len(names) != len(impls):
            return f"{self.optimizer} ({self.implementation})"
        return " + ".join(f"{n} ({i})" for n, i in zip(names, impls))

    def lines(self) -> list[str]:
        """One short line per fact, for the header of the advice."""
        params = ", ".join(f"{n / 1e6:.2f} M {d}" for d, n in self.parameters.items()) or "none"
        out = [
            "mixed precision: " + (f"{self.autocast} autocast" if self.autocast else
                                   f"{self.forward_dtype} parameters in forward" if self.forward_dtype else
                                   f"none ({self.compute} compute)"),
            f"micro-batches per optimizer step: {self.micro_batches}",
            f"checkpointed: {', '.join(_short_list(self.checkpointed)) if self.checkpointed else 'nothing'}"
            + (" (selective: its policy keeps some operators' outputs)" if self.selective_checkpointing else "")
            + (f" (run again inside {self.recomputed_by})" if self.recomputed_by else ""),
            f"optimizer: {self._optimizers}" if not self.in_backward else
            f"optimizer: {self.in_backward} x {self.optimizer} ({self.implementation}), stepped in backward as each "
            "gradient is made",
            f"parameters: {params}" + (f", {self.frozen / 1e6:.2f} M frozen" if self.frozen else ""),
        ]
        if self.batch:
            out.append("batch: " + ", ".join(f"{k} {tuple(shape)} {d}" for k, (shape, d) in self.batch.items()))
        if self.trainer != "script":
            out.append("training loop: " + _LOOPS[self.trainer])
        if self.expandable_segments:
            out.append("allocator: expandable segments")
        if self.also_trains:
            out.append(f"also trains: {', '.join(self.also_trains)}, outside the model (the plans are for the model "
                       "alone; the other's weights and gradients count as other_models, its optimizer's state as "
                       "temporaries)")
        return out


#: The trainers whose loops a script may hand its steps to: where their code lives (a frame's
#: file) and how the advice names them, by ``Door`` value.
_TRAINER_FILES = {"hf": ("/transformers/trainer",), "lightning": ("/lightning/pytorch/", "/pytorch_lightning/")}
_LOOPS = {"hf": "Hugging Face Trainer", "lightning": "Lightning Trainer"}


def _loop_owner() -> str:
    """Whose loop the caller runs in: a trainer whose code is on the stack ("hf", "lightning"), else
    "script"."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for door, places in _TRAINER_FILES.items():
            if any(place in path for place in places):
                return door
        frame = frame.f_back
    return "script"


def _implementation(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's implementation as its defaults choose it. An optimizer without a foreach
    option (SparseAdam, LBFGS, Hugging Face's Adafactor) loops."""
    d = optimizer.defaults
    if "foreach" in d and d["foreach"] is None and type(optimizer).__name__ == "Adafactor":
        return "default: for-loop"  # torch.optim.Adafactor takes its foreach path only when asked
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else (
        "for-loop" if d.get("foreach") is False or "foreach" not in d else "default: foreach on CUDA")


def _transforms() -> str:
    """The torch.func transforms running now, outermost first: "vmap, grad"."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    names = [str(i.key()).rpartition(".")[2].lower() for i in retrieve_all_functorch_interpreters()]
    return ", ".join(dict.fromkeys(names)) or "transforms"


def _expandable_segments() -> bool:
    """Whether the allocator the script runs on has expandable segments, as set by now: the simulated
    allocator's setting, else the environment PyTorch read it from."""
    from .virtual_cuda import current

    model = getattr(getattr(current(), "allocator", None), "model", None)
    return model.expandable_segments if model is not None else expandable_segments_configured()


def _checkpointing_switch(model: nn.Module) -> str:
    """How ``model`` turns activation checkpointing on itself: Hugging Face's
    ``PreTrainedModel.activation_checkpointing_enable`` (transformers 5.2x; before it
    ``gradient_checkpointing_enable``, now its deprecated alias) where the model supports it,
    timm's ``set_grad_checkpointing`` (every timm model has it; the ones that cannot raise)."""
    if getattr(model, "supports_gradient_checkpointing", False):
        if callable(getattr(model, "activation_checkpointing_enable", None)):
            return "model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})"
        if callable(getattr(model, "gradient_checkpointing_enable", None)):
            return "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
    if callable(getattr(model, "set_grad_checkpointing", None)):
        return "model.set_grad_checkpointing(True)"
    return ""


def _coupling(named: dict[str, Any]) -> str:
    """The model's input that couples its batch's rows, if one does: an N x N matrix beside another input of
    N rows and another shape (a full-batch GNN's adjacency beside its node features), a sparse N x N one, or
    a 2 x E integer edge list beside the nodes' floating-point features (PyTorch Geometric's ``edge_index``).
    Its name, else "". (A square batch alone, 64 samples of 64 features, couples nothing.)"""
    tensors_ = {n: t for n, t in named.items() if isinstance(t, torch.Tensor) and t.dim()}
    for n, t in tensors_.items():
        others = [u for m, u in tensors_.items() if m != n]
        if t.dim() == 2 and t.shape[0] == t.shape[1] > 1 and (t.layout is not torch.strided or any(
                u.shape[0] == t.shape[0] and u.shape != t.shape for u in others)):
            return n
        if (t.dim() == 2 and t.shape[0] == 2 and t.layout is torch.strided and not t.is_floating_point()
                and any(u.is_floating_point() and u.shape[0] > 2 for u in others)):
            return n
    return ""


def tensor_shapes(named: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    """The tensors among ``named`` values: name -> (shape, short dtype). A list, tuple or dict gives
    each tensor in it as ``name[i]`` (DINO's crops, each a batch of the views of one size), except a list of
    one image per sample, which a list of as many target dicts beside it tells (torchvision's
    detectors: ``model(images, targets)``): that is one batch, ``[len(images), *image.shape]``."""
    samples = {len(v) for v in named.values() if isinstance(v, (list, tuple)) and v
               and all(isinstance(x, dict) for x in v)}
    out = {}
    for k, v in named.items():
        if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v) and len(v) in samples:
            out[str(k)] = ([len(v), *_dims(v[0])], _dtype(v[0].dtype))
        elif isinstance(v, (list, tuple, dict)):
            # A container's tensors each (NVIDIA's Tacotron 2 takes one tuple of padded text, lengths, mels
            # and an int; a model given the collated dict): its other items are no batch.
            items = ((f"{k}[{i!r}]", t) for i, t in v.items()) if isinstance(v, dict) else (
                (f"{k}[{i}]", t) for i, t in enumerate(v))
            out.update({name: (_dims(t), _dtype(t.dtype)) for name, t in items if isinstance(t, torch.Tensor)})
        elif isinstance(v, torch.Tensor):
            out[str(k)] = (_dims(v), _dtype(v.dtype))
    return out


def _dims(t: torch.Tensor) -> list[int | str]:
    # A nested jagged tensor's ragged dimension is a symbolic size: named, as PyTorch prints it.
    return [d if isinstance(d, int) else str(d) for d in t.shape]


def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A forward's arguments by the names its signature gives them; a wrapper's
    (DDP, DataParallel: ``module.module``) by the wrapped module's, which it is given as they are."""
    inner = getattr(module, "module", None)
    forward = inner.forward if isinstance(inner, nn.Module) else module.forward
    try:
        signature = inspect.signature(forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {f"argument {i}": a for i, a in enumerate(args)} | dict(kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({f"{name}[{i}]": a for i, a in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _short_list(names: list[str], n: int = 3) -> list[str]:
    return names[:n] + ([f"... ({len(names)} in all)"] if len(names) > n else [])


class _Watch:
    """Hooks that fill :class:`ScriptFacts` while the script's own steps run."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.facts, self.forwards, self.steps = ScriptFacts.of(model, opt), 0, 0
        self.ran: dict[str, None] = {}  # modules whose forward ran (outside backward)
        self.recomputed: dict[str, None] = {}
        self._names = [name for name, _ in model.named_modules() if name]
        self._children: dict[str, list[str]] = {}
        for name in self._names:
            self._children.setdefault(name.rpartition(".")[0], []).append(name)
        self._handles = [register_optimizer_step_post_hook(torch.compiler.disable(self._on_optimizer))]
        # The model's forward, or a child's where the script trains the model through its methods
        # (PPO's agent.get_action_and_value calling self.actor and self.critic): the first of them
        # to run outside another is the step's entry (as memprof.script_advice applies plans).
        self._entry: weakref.ref | None = None
        self._open: list[bool] = []  # per entry forward running: whether it counts
        # The last counted forward's output tensors' storages: a state passed back detached by the
        # script's loop (a TBPTT's repackage_hidden, [s.detach() for s in state]) is a new tensor over one
        self._outputs = weakref.WeakSet()
        self._entries = weakref.WeakSet(_entries(model))  # (a copy of the model shares their hooks)
        for m in _entries(model):  # (nn.Module's methods: a TorchScript module's own refuse hooks)
            self._handles += [nn.Module.register_forward_pre_hook(m, Shared(self._on_entry), with_kwargs=True),
                              nn.Module.register_forward_hook(m, Shared(self._on_entry_end), always_call=True)]
        self._optimizers = weakref.WeakSet([opt] if opt is not None else [])
        self._loop_known = False
        self._in_backward: weakref.WeakSet = weakref.WeakSet()
        self._optimizer = weakref.ref(opt) if opt is not None else None
        # Backward passes that reach the model, counted at one of its parameters: the micro-batches
        # of a step (NeRF calls its network once per chunk of rays, with one backward for all).
        # Those since any optimizer's last step are the ones the model's step takes: a GAN's
        # generator step also runs backward through the discriminator, whose gradients the
        # next discriminator step's zero_grad throws away.
        # A second backward of one forward (a multi-task step's ``loss_a.backward(retain_graph=True);
        # loss_b.backward()``) is not another micro-batch: a backward counts after a forward only.
        # Nor is a pass whose gradients are reset before the next one (SAM's first_step(zero_grad=True)
        # between its two passes, PGD's zero_grad after its attack's passes): a pass counts where the
        # first parameter's gradient is still the one the pass before it left.
        self.backwards, self._pending, self._per_step, self._forward_since = 0, 0, [], False
        self._left: tuple[weakref.ref, int] | None = None  # that gradient, and its version then
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if first is None and opt is not None:  # a frozen model: the optimizer steps its input (style transfer)
            first = next((p for g in opt.param_groups for p in g["params"] if p.requires_grad), None)
        if first is not None:
            self._handles += [first.register_hook(Shared(functools.partial(self._on_gradient, weakref.ref(first)))),
                              first.register_post_accumulate_grad_hook(Shared(self._on_backward))]
        self._model = weakref.ref(model)
        self._handles += [nn.Module.register_forward_pre_hook(m, Shared(functools.partial(self._on_module, name)))
                          for name, m in model.named_modules() if name]

    def _on_entry(self, module, args, kwargs=None) -> None:
        if not self._handles:  # closed in an earlier hook of this call, which PyTorch still calls, without kwargs
            return
        # Not re-run in backward (the whole model checkpointed), nor evaluation between steps.
        counts = (not self._open and torch._C._current_graph_task_id() == -1 and torch.is_grad_enabled()
                  and module in self._entries and (self._entry is None or self._entry() is module))
        self._open.append(counts)
        if not counts:
            return
        self._entry = self._entry or weakref.ref(module)
        self.forwards += 1
        self._forward_since = True
        if in_torch_func():
            # Inside torch.func's transforms the arguments are wrappers (TensorWrapper,
            # BatchedTensor) without storages, and no state comes back through them.
            self.facts.transformed = self.facts.transformed or _transforms()
        else:
            carried = [t for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                       if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
                       and _storage(t) in self._outputs]
            self.facts.carried_state = max(self.facts.carried_state, len(carried))
        if self.forwards == 1:
            self._autocast()
            self.facts.batch = tensor_shapes(_arguments(module, args, kwargs))
            self.facts.coupled_by = _coupling(_arguments(module, args, kwargs))

    def _on_entry_end(self, module, args, output) -> None:
        if self._handles and self._open and self._open.pop():
            # What the model returns, to tell the state a script passes back to its next forward
            # (nothing inside torch.func's transforms: wrappers, without storages).
            self._outputs = weakref.WeakSet() if in_torch_func() else weakref.WeakSet(
                _storage(t) for t in torch.utils._pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter))

    def _on_module(self, name: str, module, args) -> None:
        if torch._C._current_graph_task_id() == -1:
            self.ran[name] = None
            if self._open and self._open[0] and in_torch_func() and not self.facts.transformed:
                self.facts.transforms_inside = self.facts.transforms_inside or _transforms()
            if self.forwards == 1 and torch.is_grad_enabled():
                # A wrapper may enter autocast inside the model's forward, after its hooks
                # (Accelerate, hence Hugging Face's Trainer, wraps ``model.forward``).
                self._autocast()
                # FSDP gathers a layer's parameters in its own pre-forward hook, registered before ours.
                if self.facts.forward_dtype is None:
                    half = next((p.dtype for p in module._parameters.values()
                                 if p is not None and p.dtype in _HALF), None)
                    self.facts.forward_dtype = half and _dtype(half)
        elif not any(name.startswith(r + ".") for r in self.recomputed):
            # A module run while autograd computes gradients is recomputed: activation checkpointing;
            # selective where checkpoint's cached-outputs mode replays what its policy kept.
            self.recomputed[name] = None
            node = torch._C._current_autograd_node()
            if (not self.facts.recomputed_by and isinstance(node, torch.autograd.function.BackwardCFunction)
                    and node.name() != "CheckpointFunctionBackward"):  # reentrant checkpoint's own Function
                self.facts.recomputed_by = node.name()
            if not self.facts.selective_checkpointing:
                from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

                self.facts.selective_checkpointing = any(
                    type(m).__name__ == "_CachedTorchDispatchMode" for m in _get_current_dispatch_mode_stack())

    def _on_optimizer(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        if self._optimizer is not None and opt is self._optimizer() and self._handles:
            self._per_step.append(self._pending)
        self._pending = 0
        if torch._C._current_graph_task_id() != -1 and opt not in self._in_backward:
            self._in_backward.add(opt)
            self.facts.in_backward = len(self._in_backward)
        if not self._loop_known:  # the first optimizer step: whose loop runs it
            self._loop_known, self.facts.trainer = True, _loop_owner()
        if opt in self._optimizers:
            return
        self._optimizers.add(opt)
        if self._optimizer is not None and self._optimizer() in _wrapped(opt):
            self.facts.optimizer = f"{type(opt).__name__}({self.facts.optimizer})"  # timm's Lookahead(RAdam)
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        model = self._model()
        if params and model is not None and any(params[0] is p for p in model.parameters()):
            # Over the model's other parameters (Muon beside AdamW; one per parameter, stepped in backward)
            if type(opt).__name__ not in self.facts.optimizer.split(" + "):
                self.facts.optimizer += f" + {type(opt).__name__}"
                self.facts.implementation += f" + {_implementation(opt)}"
            return
        # (An optimizer of the host's parameters, a large embedding table kept in host memory while the
        # model trains on the GPU, takes no GPU memory.)
        mine = next(model.parameters(), None) if model is not None else None
        if (params and mine is not None and not any(params[0] is p for p in model.parameters())
                and params[0].device.type == mine.device.type):
            self.facts.also_trains.append(f"{type(opt).__name__} over {sum(p.numel() for p in params) / 1e6:.2f} M "
                                          "parameters")

    def _on_gradient(self, first: weakref.ref, grad: torch.Tensor) -> None:
        """Before a pass's gradient is accumulated: the passes before it were thrown away where
        the gradient they left is gone (set to None, replaced) or was changed in place (zeroed)."""
        p, left = first(), self._left
        if p is not None and left is not None and (p.grad is None or p.grad is not left[0]() or p.grad._version != left[1]):
            self._pending = 0

    def _on_backward(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._left = weakref.ref(p.grad), p.grad._version
        if self._handles and self._forward_since:  # not once closed
            self._forward_since = False
            self.backwards += 1
            self._pending += 1

    def _autocast(self) -> None:
        if self.facts.autocast is None and torch.is_autocast_enabled("cuda"):
            self.facts.autocast = _dtype(torch.get_autocast_dtype("cuda"))

    def step(self) -> None:
        self.steps += 1

    def close(self) -> ScriptFacts:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        counts = [n for n in self._per_step if n]  # the most common count (a first step may be seen in part)
        counted = max(counts, key=lambda n: (counts.count(n), n)) if counts else 0
        self.facts.micro_batches = max(counted or (self.backwards or self.forwards) // max(self.steps, 1), 1)
        self.facts.checkpointed = self._checkpointed()
        model = self._model()
        if model is not None and self.ran:
            from memprof.strategies import find_blocks

            self.facts.idle_blocks = [n for n, _ in find_blocks(model) if n not in self.ran]
        return self.facts

    def _checkpointed(self) -> list[str]:
        """The recomputed modules, a module named for its children where every child that
        ran was recomputed but not the module's own call: a checkpointed ``forward``
        (Hugging Face's ``GradientCheckpointingLayer`` checkpoints ``forward``, not
        ``__call__``, so the layer's own hooks stay outside the recomputation)."""
        done = dict(self.recomputed)
        for name in sorted(self.ran, key=lambda n: -n.count(".")):  # the deepest first
            ran = [c for c in self._children.get(name, ()) if c in self.ran]
            if name not in done and ran and all(c in done for c in ran):
                for c in ran:
                    del done[c]
                done[name] = None
        # Inside another recomputed module: a module shared by every layer (one rotary embedding),
        # named for the first layer holding it, may recompute first inside a later layer's backward.
        return [n for n in self._names if n in done and not any(n.startswith(r + ".") for r in done)]


def what_is_done(plans: dict[str, list], facts: ScriptFacts, model: nn.Module, who: str) -> dict[str, str]:
    """The plans that would repeat what the training (``who``: "script", "fit") does already, and why."""
    from memprof.strategies import Accumulation, ActivationOffload, Autocast, Checkpointing, ZeRO, find_blocks

    # Blocks the optimizer trains: a frozen encoder's (Whisper's with freeze_encoder()) keeps
    # nothing for a backward that never reaches it, so it never recomputes either. Hugging Face's
    # switch, when on, checkpoints every block that can be.
    blocks = [n for n, m in find_blocks(model)
              if any(p.requires_grad for p in m.parameters()) and n not in facts.idle_blocks]
    covered = getattr(model, "is_gradient_checkpointing", False) is True or (
        bool(blocks) and all(any(b == c or b.startswith(c + ".") for c in facts.checkpointed) for b in blocks))
    fsdp = _fsdp(model)
    # Tensor parallelism alone (DTensor parameters, no FSDP): fully_shard of a tensor-parallel model on a
    # group of one rank fails in PyTorch (its mesh has no data-parallel dimension), and save_on_cpu copies
    # a DTensor's saved activations into a plain pinned tensor (which raises where it packs).
    tensor_parallel = not fsdp and any(type(p).__name__ == "DTensor" for p in model.parameters())
    out = {}
    for name, strategies in plans.items():
        zero = [s for s in strategies if isinstance(s, ZeRO)]
        if fsdp and zero:
            out[name] = (f"the {who} shards the model already ({fsdp}): memprof's sharding and state offload "
                         "plans are for an unsharded model; FSDP's own CPUOffload offloads its shards")
            continue
        if tensor_parallel and (zero or any(isinstance(s, ActivationOffload) for s in strategies)):
            out[name] = (f"the {who} shards the model by tensor parallelism (DTensor parameters): memprof's "
                         "sharding, state offload and activation offload plans are for plain tensors; shard the "
                         "state over a data-parallel mesh dimension instead (fully_shard with a 2-D mesh)")
            continue
        if "grad" in facts.transformed and any(isinstance(s, (Checkpointing, ActivationOffload)) for s in strategies):
            out[name] = (f"the {who} runs the model inside torch.func's {facts.transformed}, where PyTorch refuses "
                         "saved-tensors hooks (torch.utils.checkpoint, save_on_cpu): 'torch.func.{grad, vjp, jacrev, "
                         "hessian} don't yet support saved tensor hooks'")
            continue
        if "grad" in facts.transforms_inside and any(isinstance(s, ActivationOffload) for s in strategies):
            out[name] = (f"the model's forward runs torch.func's {facts.transforms_inside} around some of its "
                         "modules, where PyTorch refuses saved-tensors hooks (activation offload's save_on_cpu "
                         "around the forward): 'torch.func.{grad, vjp, jacrev, hessian} don't yet support saved "
                         "tensor hooks'")
            continue
        if facts.transformed and any(isinstance(s, Accumulation) for s in strategies):
            out[name] = (f"the {who} runs the model inside torch.func's {facts.transformed}: the batch to split is "
                         "what vmap maps over (the tasks, the samples), not the model's arguments; split it in the "
                         "script (a backward per part, one optimizer step) to accumulate")
            continue
        if facts.carried_state and any(isinstance(s, Accumulation) for s in strategies):
            out[name] = (f"the {who} passes {facts.carried_state} of the model's outputs back to its next forward (a "
                         "memory of earlier segments, a recurrent state): micro-batches cut from the batch would cut "
                         "that state too; split along the batch dimension with a state per micro-batch (Transformer-XL's "
                         "batch_chunk)")
            continue
        if facts.coupled_by and any(isinstance(s, Accumulation) for s in strategies):
            shape = " x ".join(map(str, facts.batch.get(facts.coupled_by, ([],))[0]))
            out[name] = (f"the model's batch is one graph: its input {facts.coupled_by} ({shape}) couples its rows "
                         "with each other (a full-batch GNN's adjacency or edges), so 1/K of its rows is no "
                         "micro-batch; train on sampled subgraphs instead (neighbour sampling, Cluster-GCN)")
            continue
        if facts.in_backward and (zero or any(isinstance(s, Accumulation) for s in strategies)):
            # torchtune refuses accumulation with optimizer_in_bwd for the same reason.
            out[name] = (f"the {who}'s {facts.in_backward} optimizers step inside backward, each as its gradient "
                         "is made: no gradient outlives its backward to accumulate over micro-batches, and "
                         "memprof's sharding and state offload plans are for one optimizer stepped after backward")
            continue
        if facts.optimizer == "ZeroRedundancyOptimizer" and any(s.stage == 1 for s in zero):
            out[name] = f"the {who}'s ZeroRedundancyOptimizer shards the optimizer's state already (ZeRO stage 1)"
            continue
        if facts.compute == "fp64" and any(isinstance(s, Autocast) for s in strategies):
            out[name] = f"the {who}'s parameters are fp64, which autocast leaves as they are (it casts fp32 only)"
        elif facts.autocast and any(isinstance(s, Autocast) for s in strategies):
            out[name] = f"the {who} already runs its forward under {facts.autocast} autocast"
        elif facts.forward_dtype and any(isinstance(s, Autocast) for s in strategies):
            out[name] = f"the {who}'s forward already computes with {facts.forward_dtype} parameters"
        elif covered and any(isinstance(s, Checkpointing) for s in strategies):
            out[name] = (f"the {who} already runs the repeated blocks again in backward, inside "
                         f"{facts.recomputed_by} (a custom autograd Function that keeps nothing of them in forward, "
                         "as reversible layers and adjoint methods do)") if facts.recomputed_by else (
                f"the {who} already checkpoints the repeated blocks" + (
                ", selectively: to recompute all of each block, make its policy return "
                "CheckpointPolicy.PREFER_RECOMPUTE for every operator (torchtitan: activation checkpointing mode "
                "'full')" if facts.selective_checkpointing else ""))
        elif facts.optimizer == "none" and any(isinstance(s, ZeRO) for s in strategies):
            out[name] = f"the {who} updates the parameters itself: no optimizer's state to shard or offload"
    return out


def _fsdp(model: nn.Module) -> str | None:
    """How ``model`` is sharded by FSDP, if it is: "FSDP1" (FullyShardedDataParallel) or
    "FSDP2" (fully_shard); else None."""
    import torch.distributed.fsdp as fsdp

    for m in model.modules():
        if isinstance(m, fsdp.FullyShardedDataParallel):
            return "FSDP1"
        if isinstance(m, getattr(fsdp, "FSDPModule", ())):
            return "FSDP2"
    return None


def _sequence_first(model: nn.Module) -> str | None:
    """The first of ``model``'s modules that lays out its batch sequence first (nn.Transformer,
    nn.MultiheadAttention and nn.LSTM without ``batch_first=True``), by class; else None."""
    return next((type(m).__name__ for m in model.modules() if getattr(m, "batch_first", None) is False), None)


def _without_accumulation(strategies: list) -> set[str]:
    from memprof.strategies import Accumulation

    return {s.name for s in strategies if not isinstance(s, Accumulation)}


def _micro_batches(strategies: list) -> int:
    from memprof.strategies import Accumulation

    k = 1
    for s in strategies:
        if isinstance(s, Accumulation):
            k *= s.k
    return k


@dataclass
class ScriptAdvice(Advice):
    """What ``memprof advise`` found: the baseline report and the ranked plans."""

    script: str = ""
    simulated: bool = True
    #: The strategies of each plan as applied to the script's model (for their code changes).
    applied: dict[str, list] = field(default_factory=dict, repr=False)
    facts: ScriptFacts | None = None
    #: Plans that could not run, or were left out as the script does that already: plan -> why.
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    verified: pd.DataFrame | None = None
    #: Bytes each plan's peak reserved carries for the cache layout the script's first step leaves
    #: (the script's step as it is, less the same step on an emptied cache).
    cache_excess: int = 0
    #: The highest peak allocated of a script's step with an evaluation in it (its model called without
    #: gradients between training steps), and the plan it ran with; (0, "") where none was seen.
    evaluation: tuple[int, str] = (0, "")
    #: The shapes (but the first dimension) of the model's training inputs the plans' steps ran on, where
    #: they were not all alike (dynamic padding: each batch as long as its longest sequence).
    batch_shapes: list[tuple] = field(default_factory=list)

    def notes(self) -> list[str]:
        """What the table alone does not say: an evaluation between the steps that needs more than the
        budget; plans that ran on batches of different shapes."""
        out = []
        peak, plan = self.evaluation
        if peak > self.budget:
            out.append(f"an evaluation between the script's training steps (its model called without gradients) "
                       f"peaked at {fmt_bytes(peak)} allocated (with plan {plan}): above the budget of "
                       f"{fmt_bytes(self.budget)}, whatever a plan does to the training step; a smaller evaluation "
                       "batch would fit it")
        if self.batch_shapes:
            shown = ", ".join(str(list(shape)) for shape in self.batch_shapes[:4])
            out.append(f"the script's batches change shape from step to step ({len(self.batch_shapes)} shapes past the "
                       f"first dimension: {shown}{', ...' if len(self.batch_shapes) > 4 else ''}), and each plan ran "
                       "on the batch of its own step: their peaks differ by the batch as well as by the plan. Pad to "
                       "one length (padding='max_length', a fixed crop) to compare plans, and size the budget for "
                       "the longest batch")
        return out

    def code_change(self, plan: str | None = None) -> list[str]:
        """The changes to make in the script for ``plan`` (default: the best)."""
        plan = plan or self.best
        if plan is None or plan == "baseline":
            return []
        door = self.facts.trainer if self.facts is not None else "script"
        return [s.code_change(self.facts, door) for s in self.applied.get(plan) or self.plans[plan]()]

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
            "script_does": None if self.facts is None else asdict(self.facts),
            "cache_excess_bytes": self.cache_excess,
            "evaluation_peak_allocated_bytes": self.evaluation[0],
            "varying_batch_shapes": [[list(t) for t in shape] for shape in self.batch_shapes],
            "skipped": dict(self.skipped),
            "failed": dict(self.failed),
            "plans": [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}  # JSON has no NaN
                      for row in self.table.reset_index().to_dict(orient="records")],
            "verified": None if self.verified is None else self.verified.reset_index().to_dict(orient="records"),
            "baseline": self.baseline.to_dict(),
        }

    def rich_table(self, table: pd.DataFrame | None = None):
        """The plans (``table``: a part of them) as a rich table."""
        return plan_table(self, table, f"{'simulated ' if self.simulated else ''}{self.gpu.name}")

    def __rich__(self):
        return self.rich_table()


class _Schedule:
    """The plans, one after another, in runs of the script (``observe_script``'s hooks)."""

    def __init__(self, plans: dict[str, list], steps: int, simulated: bool, advance) -> None:
        self.plans, self.steps, self.simulated, self.advance = plans, steps, simulated, advance
        self.keys = {name: tuple(s.key for s in ss if s.simulated) for name, ss in plans.items()}
        # Strategies accounted for afterwards (sharding) read the samples of a steady step.
        self.sampled = {self.keys[n] for n, ss in plans.items() if not all(s.simulated for s in ss)}
        #: Per plan key: (tracker step of this run, derived counters or None), then its report view.
        self.steps_of: dict[tuple, tuple[int, Any]] = {}
        self.views: dict[tuple, Report] = {}
        #: Per plan key, on the simulated GPU: the seconds the device was busy in its step.
        self.busy: dict[tuple, float] = {}
        self._busy_at: tuple[Any, float] = (None, 0.0)  # the simulated device and its busy seconds at the last step's end
        self.failed: dict[str, str] = {}
        #: Plans left out because the script already does what they would (plan -> why).
        self.skipped: dict[str, str] = {}
        self.facts: ScriptFacts | None = None
        self._watch: _Watch | None = None
        self.baseline: Report | None = None
        self.units: dict = {}
        self._stack = ExitStack()
        self._current: str | None = None
        self._done = 0
        self._fresh = True  # no plan has run yet in this run of the script
        #: What the layout the script's first step left adds to its step's peak reserved (on_step).
        self.cache_excess = 0
        self._emptied: int | None = None  # the script's step's peak reserved, while it runs again
        self._emptied_steps = 0
        self.started = False  # whether the model's forward ran since the current plan was applied
        self._advanced: set[str] = set()
        self._evaluated = False  # whether the script's step before had an evaluation
        #: The shapes (but the first dimension) of the model's training inputs seen while plans ran.
        self.shapes: set[tuple] = set()
        self._step_shapes: list[tuple] = []  # of the step in progress, one per forward
        #: The highest peak allocated of a step with an evaluation in it, and the plan it ran with (allocated:
        #: the reserved high-water mark a step reads may be from before the cache was emptied for the plan).
        self.evaluation_peak: tuple[int, str] = (0, "")
        self.left_out = 0  # steps left out: with an evaluation in them, or a short batch
        self._step_rows: list[int | None] = []  # of the step in progress: each forward's samples
        self._kind: int | None = None  # other optimizers' steps in the baseline's measured step
        self._kind_left_out = 0  # at most 8 over the advice: a script whose steps all differ goes on
        self._others = 0  # other optimizers' steps in the step in progress
        self._others_hook = None
        self._short_left_out = False  # whether the current plan left out a step for a short batch

    def pending(self) -> list[str]:
        return [n for n in self.plans if n not in self.failed and n not in self.skipped
                and self.keys[n] not in self.views and self.keys[n] not in self.steps_of]

    # -- observe_script's hooks ----------------------------------------------------
    def on_model(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        from memprof.strategies.zero import fsdp_units

        self.model, self.opt = model, opt
        if self._others_hook is None:
            self._others_hook = register_optimizer_step_post_hook(self._on_any_step)
        self._fresh = True  # a run of the script begins
        # A first step with an evaluation in it (a validation at step 0) is no more the step's than
        # a later one: the next is taken, the evaluation's cache emptied (one where every step
        # evaluates is taken as it is from the second on).
        self._evaluated = False
        self.units = fsdp_units(model)
        if self.facts is None:  # (again: tracking restarted with another optimizer of the model's)
            if self._watch is not None:
                self._watch.close()
            self._watch = _Watch(model, opt)
            self._check_accounted(model, opt)
        self._next()

    def _on_any_step(self, opt, args, kwargs) -> None:
        if opt is not self.opt:
            self._others += 1

    def _check_accounted(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Strategies accounted for after the step (sharding) never run on the script's model: what
        they check of it when simulated (FSDP2's refusals: a sparse embedding, a channels-last
        weight) fails their plans here, before any step."""
        for name in self.pending():
            accounted = [s for s in self.plans[name] if not s.simulated]
            if accounted:
                try:
                    with Workload(model, opt, batch=None, loss_fn=None).plan(accounted, simulated=True):
                        pass
                except ValueError as e:
                    self.failed[name] = f"{type(e).__name__}: {e}"

    def on_step(self, tracker) -> bool:
        # A step's shapes: its forwards' in order (a model called for positives, then for negatives, is one)
        others, self._others = self._others, 0  # other optimizers' steps in this step (a GAN's generator's)
        if self._step_shapes:
            distinct = tuple(dict.fromkeys(self._step_shapes))  # the model called 3 times on one shape: one shape
            self.shapes.add(distinct[0] if len(distinct) == 1 else distinct)
            self._step_shapes = []

        rows, self._step_rows = self._step_rows[:1], []
        before, self._evaluated = self._evaluated, tracker.evaluated or tracker.others_inferred
        if self._evaluated and not before:
            # An evaluation ran in this step, not in the one before (the model called without
            # gradients every N steps): its peak would be the evaluation's as much as the plan's.
            # The next step is taken instead; a script that calls its model so every step (a DQN
            # acting, a validation batch per step) has them taken as they are.
            allocated = int(tracker.report().steps["peak_allocated"].iloc[-1])
            if self._current is not None and allocated > self.evaluation_peak[0] and tracker.evaluated:
                self.evaluation_peak = (allocated, self._current)
            if self._current is not None:
                # What the evaluation cached is not the plan's step (an evaluation of 4 x the batch left
                # accum8 reserving 5.49 GiB where its step needs 2.64): said apart, as evaluation_peak.
                # Nor the step's as it is, or every plan would seem to save the evaluation's cache.
                tracker.empty_cache()
            return self._leave_out()
        if rows and self._current is not None and not self._short_left_out and self._short_batch(rows[0]):
            # An epoch's last batch, short of the batch size (a DataLoader's drop_last=False): the
            # plan's step is the next one (accumulation plans failed on it, finding nothing to cut).
            # Once a plan: a script whose every step is short (its first forward a smaller call) goes on.
            self._short_left_out = True
            return self._leave_out()
        if (self._current is not None and self._kind is not None and others != self._kind
                and self._emptied is None and self._kind_left_out < 8):
            self._kind_left_out += 1
            # A step of another kind than the baseline's (a GAN's lazy regularization: the first model's
            # optimizer steps twice every N iterations): each plan is measured on a step like the baseline's.
            return self._leave_out()
        if self._emptied is not None:  # the script's steps on an emptied cache (below): as many as a plan's
            self._emptied_steps += 1
            if self._emptied_steps < self.steps:
                return True
            emptied = int(tracker.report().steps["peak_reserved"].iloc[-1])
            self.cache_excess, self._emptied = max(self._emptied - emptied, 0), None
            return self._next()
        self._done += 1
        if self._watch is not None:
            self._watch.step()
        allocator = self._allocator()
        key = self.keys[self._current]
        cut = next((m for m in _function_modes() if isinstance(m, _MicroBatchCut)), None)
        if cut is not None and cut.batch and not cut.cuts:
            if cut.batch % cut.k and cut.sizes:  # only the script's whole step's batch divides: never made whole
                self.fail(f"the script makes its micro-batches of {cut.batch} samples itself, which do not divide "
                          f"into {cut.k}")
            else:
                self.fail(f"memprof found nothing of the batch's size ({cut.batch} samples, the model's first forward's) "
                          "to cut in its step: its batch changes size from step to step, or reaches the model another way")
            return self._next()
        derived = None
        if allocator is not None:
            events, allocator.events = allocator.events, []
            # Without an optimizer a step ends where the next forward begins, whose call PyTorch
            # made before the next plan was applied: the plan's first step is not its own to derive from.
            if self._done == 1 and self.steps > 1 and key and key not in self.sampled and self.opt is not None:
                derived = allocator.replay_step(events)
            since = self._busy_at[1] if self._busy_at[0] is allocator else 0.0  # a new run: a new device
            self._busy_at = (allocator, allocator.busy)
            self.busy[key] = derived.busy if derived is not None else allocator.busy - since
        if self._done < self.steps and derived is None:
            return True
        self.steps_of[key] = (tracker.step - 1, derived)
        if not key:
            self._kind = others
            self.baseline = tracker.report()
            if self._watch is not None:
                self.facts, self._watch = self._watch.close(), None
                self._skip_what_is_done()
            # The script's steps again, as many as a plan's, on an emptied cache: each plan's step
            # runs on one (_next), but the script's keeps the layout its first step left, the
            # optimizer's state made among that step's freed activations and segments split around
            # it. A run of a plan from its start lays its cache out alike, so every plan's peak
            # reserved carries the difference (a Whisper fine-tune: 244 MiB; its plans measured on
            # the H200 within -5 to +3 %, benchmarks/results/corpus-unseen-9-h200.json).
            self._emptied, self._emptied_steps = int(self.baseline.steps["peak_reserved"].iloc[-1]), 0
            tracker.empty_cache()
            if allocator is not None:
                allocator.events = []
            return True
        return self._next()

    def _skip_what_is_done(self) -> None:
        for name, why in what_is_done(self.plans, self.facts, self.model, "script").items():
            self.skipped[name] = why
            self._advance(name)

    def end_run(self, report: Report | None) -> None:
        """The script stopped: each plan's step becomes a view of this run's report."""
        if self._emptied is not None:
            log.warning("the script ended before its step ran again on an emptied cache: the plans' peak reserved "
                        "leave out what the layout its first step leaves adds (run it for more steps after --)")
            self._emptied = None
        self._stack.close()
        if self._others_hook is not None:
            self._others_hook.remove()
            self._others_hook = None
        self._others = 0
        self._step_shapes = []  # of a step the run's end cut short: no step's (it would join the next run's first)
        self._step_rows = []
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if report is not None:
            for key, (step, derived) in self.steps_of.items():
                view = _step_view(report, step)
                if derived is not None:
                    view.steps.loc[:, ["peak_allocated", "peak_reserved", "seconds"]] = [derived[:3]]
                self.views[key] = view
        self.steps_of.clear()
        self._current = None

    def fail(self, message: str) -> None:
        """The current plan broke the script's step."""
        name = self._current
        if name is None:
            return
        failing = [name]
        k = _micro_batches(self.plans[name])
        if k > 1:
            # The step saw 1/K of its batch where memprof could cut it (see _MicroBatchCut); what it
            # could not (a batch of another size, made another way) fails the plans that add to this
            # one's other strategies as many micro-batches or more alike. Fewer may run (BatchNorm
            # refuses a micro-batch of one); without this plan's other strategies, another plan may
            # run (checkpointing's failure is not bf16's).
            # A module that takes its batch sequence first is named where the error is about the batch's
            # size (a sequence cut as if it were the batch), not any shape (a mask's length).
            first, batch = _sequence_first(self.model), self.facts.batch_size if self.facts else None
            sizes = {str(batch), str(batch // k)} if batch else set()
            message += (" (memprof runs 1/K of the batch to simulate K micro-batches, cutting its tensors where "
                        "they reach the device, and the script's step could not follow"
                        + (f"; {first} takes its batch sequence first, which memprof does not cut"
                           if first and sizes.intersection(re.findall(r"\d+", message)) else "") + ")")
            others = _without_accumulation(self.plans[name])
            failing += [p for p in self.pending() if p != name and _micro_batches(self.plans[p]) >= k
                        and others <= _without_accumulation(self.plans[p])]
        for plan in failing:
            self.failed[plan] = message
            self._advance(plan)

    # -- plans -----------------------------------------------------------------------
    def _allocator(self):
        from .virtual_cuda import current

        device = current() if self.simulated else None
        return device.allocator if device is not None else None

    def _next(self) -> bool:
        self._stack.close()
        self._current = None
        for name in self.plans:  # plans that share a step already run
            if self.keys[name] in self.steps_of:
                self._advance(name)
        for name in self.pending():
            try:
                apply_to_script(self.plans[name], self.model, self.opt, self.simulated, self._stack, self.facts)
            except Exception as exc:  # e.g. no repeated blocks to checkpoint
                self._stack.close()
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                self._advance(name)
                continue
            self._current, self._done, self.started, self._short_left_out = name, 0, False, False
            # (copies of the model share it)
            handle = nn.Module.register_forward_pre_hook(self.model, Shared(self._on_forward), with_kwargs=True)
            self._stack.callback(handle.remove)
            if hasattr(self.advance, "now"):
                self.advance.now(name)
            # What the last plan cached is not this plan's, nor is what the steps before it left
            # (the script as it is, a run with the plan from the start would not have it; the
            # plan's measurement empties it too: _measure_plan). The step as it is keeps it.
            if not self._fresh or self.keys[name]:
                tracker = active_tracker()  # none before the run's first tracked step
                (tracker.empty_cache if tracker is not None else torch.cuda.empty_cache)()
            self._fresh = False
            allocator = self._allocator()
            if allocator is not None:
                allocator.events = []
            return True
        return False

    def _leave_out(self) -> bool:
        """Take the next step instead of the one that ended."""
        self.left_out += 1
        allocator = self._allocator()
        if allocator is not None:
            allocator.events = []
            self._busy_at = (allocator, allocator.busy)
        return True

    def _short_batch(self, rows: int | None) -> bool:
        """Whether the model's first forward in a step took ``rows`` samples where the plan's steps
        take a whole batch, or 1/K of one: fewer, and neither."""
        batch = self.facts.batch_size if self.facts is not None else None
        if not batch or rows is None:
            return False
        return rows < batch and rows != batch // _micro_batches(self.plans[self._current])

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.started = True
        if torch.is_grad_enabled() and module.training and self._current is not None:
            if module is self.model:  # not a copy of it (which shares the hook): a host evaluation's
                self._step_rows.append(next((t.shape[0] for t in tensors(args, kwargs)
                                             if isinstance(t, torch.Tensor) and t.dim()), None))
            # The batch's shape but its first dimension (which accumulation cuts): dynamic padding changes it
            # (a nested jagged tensor's ragged size is symbolic, another per batch: named as PyTorch prints it)
            self._step_shapes.append(tuple(tuple(d if isinstance(d, int) else str(d) for d in t.shape[1:])
                                           for t in tensors(args, kwargs) if isinstance(t, torch.Tensor)))

    def _advance(self, name: str) -> None:
        if self.advance is not None and name not in self._advanced:
            self._advanced.add(name)
            self.advance(name)


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
    plans: dict[str, PlanFactory] | None = None,
) -> ScriptAdvice:
    """Observe ``path`` and rank plans for it under ``budget`` (per rank).

    Simulated on ``target`` (default: the budget's GPU, else an RTX 4090) when
    no GPU is present or a target is named; measured on the local GPU otherwise.
    ``steps``: steps run per plan (the last is the plan's).
    """
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
    plans = plans or default_plans(world_size, gpu=gpu)
    if "baseline" not in plans:
        plans = {"baseline": list, **plans}
    built = {name: factory() for name, factory in plans.items()}
    schedule = _Schedule(built, steps, simulate, None)
    with _progress(progress, len(plans)) as advance:
        schedule.advance = advance
        meta = _run(schedule, path, args, gpu, simulate, timeout)
    baseline = schedule.baseline
    if baseline is None:
        skipped = (" and steps with an evaluation in them do not count, as one did here"
                   if schedule.evaluation_peak[0] else "")
        raise ScriptError(
            f"the script ended before memprof saw a step of it as it is: memprof advise needs {steps + 1} optimizer "
            f"steps of the script (the first finds the model{skipped}); run it for more steps, e.g. more iterations "
            "after --")
    if not simulate and not baseline.device.startswith("cuda"):
        raise ScriptError(
            f"the script trains on the {baseline.device}, not on this machine's GPU: memprof advises on CUDA training; "
            "run it the way it trains on a GPU (its device option after --), or add --target GPU to simulate one"
        )
    baseline.meta.update({k: meta[k] for k in ("script", "script_args", "target", "simulation_notes") if k in meta})
    baseline.meta.update(schedule.units)
    if simulate:
        baseline.source = "simulate"
    preds = _predictions(schedule, built, baseline, gpu)
    if "baseline" not in preds:  # every plan is ranked against it
        raise ScriptError(f"memprof could not take the script's step as it is: {schedule.failed.get('baseline')}")
    asked = schedule.facts is not None and schedule.facts.expandable_segments  # by the script itself
    changes = {name: plan_changes(built[name], baseline) for name in preds}
    changing = {name for name, c in changes.items() if c}
    extra = fragmented(preds, nbytes, margin, changing) if simulate and not asked else {}
    if extra:
        # Plans whose allocated memory fits but whose reserved memory does not: the script again, with
        # expandable segments from its start, for them (and its step as it is, which every run takes first).
        from memprof.strategies import ExpandableSegments

        again = {"baseline": [], **{p: built[p] for p in extra.values()}}
        more = _Schedule(again, steps, simulate, None)
        with _progress(progress, len(again)) as advance, ExpandableSegments().building():
            more.advance = advance
            _run(more, path, args, gpu, simulate, timeout)
        got = _predictions(more, again, baseline, gpu)
        for name, plan in extra.items():
            built[name] = [*built[plan], ExpandableSegments()]
            plans = {**plans, name: _with_expandable(plans[plan])}
            changes[name] = changes[plan]  # the segments change no operator
            if plan in got:
                preds[name] = got[plan]
            elif plan in more.failed:
                schedule.failed[name] = more.failed[plan]
    _coupled_batches(built, preds, schedule.skipped)
    table = rank(list(preds.items()), preds["baseline"], baseline, nbytes, margin, changes)
    return ScriptAdvice(nbytes, gpu, world_size, table, baseline, plans, script=str(path), simulated=simulate,
                        applied=built, facts=schedule.facts, failed=schedule.failed, skipped=schedule.skipped,
                        cache_excess=schedule.cache_excess, evaluation=schedule.evaluation_peak,
                        batch_shapes=sorted(schedule.shapes, key=_shape_order) if len(schedule.shapes) > 1 else [])


def _shape_order(shape: tuple) -> list:
    """Shapes in order, sizes by number, a nested tensor's symbolic ones (named) after them."""
    return [[(0, d) if isinstance(d, int) else (1, d) for d in sizes] for sizes in shape]


def _predictions(schedule: "_Schedule", built: dict[str, list], baseline: Report, gpu: GPU) -> dict:
    """Each plan's prediction from the steps ``schedule`` took, where its step finished."""
    preds = {}
    for name, strategies in built.items():
        key = schedule.keys[name]
        if key in schedule.views and name not in schedule.failed and name not in schedule.skipped:
            if schedule.views[key].steps.empty:  # begun, but the script ended before its step did
                schedule.failed[name] = "the script ended before this plan's step finished: run it for more steps"
                continue
            pred = _prediction(schedule.views[key], strategies, schedule.busy.get(key))
            if key:  # a plan's step ran on an emptied cache; a run of it from its start would not (on_step)
                pred = replace(pred, peak_reserved=pred.peak_reserved + schedule.cache_excess)
            preds[name] = _adjusted(pred, strategies, baseline, gpu)
    return preds


def _coupled_batches(built: dict[str, list], preds: dict, skipped: dict[str, str]) -> None:
    """Leave out the accumulation plans predicted much faster than the same plan without it.

    K micro-batches do the step's work K times on a K-th of the batch: no faster than the whole
    batch at once, unless the step's work grows faster than its batch because its samples
    interact (an exact Gaussian process's kernel matrix over the batch and its Cholesky, N^3):
    then each micro-batch computes another objective, not a part of the same one."""
    from memprof.strategies import Accumulation

    for name, strategies in built.items():
        plain = _name([s for s in strategies if not isinstance(s, Accumulation)])
        if name in preds and plain != name and plain in preds and preds[name].seconds < 0.8 * preds[plain].seconds:
            skipped[name] = (f"{name} is predicted {preds[plain].seconds / preds[name].seconds:.1f}x faster than "
                             f"{plain}: the step's work grows faster than its batch (its samples interact: a kernel "
                             "matrix, a factorization over the batch), so micro-batches would compute another "
                             "objective, not split this one")
            del preds[name]


def _run(schedule: _Schedule, path, args, gpu: GPU, simulate: bool, timeout) -> dict:
    """Run the script until every plan ran or failed; the first run's report's ``meta``."""
    meta = None
    while schedule.pending():
        before, ended = len(schedule.pending()), None
        try:
            report = observe_script(
                # once steps were left out (evaluations, short batches), a step more per plan
                path, args, steps=(schedule.steps + bool(schedule.left_out)) * before + 1, warmup=1, timeout=timeout,
                on_model=schedule.on_model, on_step=schedule.on_step, target=gpu.name if simulate else None,
                oom=False,  # a plan's full size is what is ranked, fitting or not
            )
        except ScriptError as exc:
            if schedule.baseline is None:
                schedule.end_run(None)
                raise  # the script as it is cannot be observed: nothing to advise on
            cause = exc.__cause__
            said = raised(cause, path) if cause is not None else str(exc)
            if schedule.started or len(schedule.pending()) == before:
                # In its step, or before its first forward with no plan's step done in this run: the
                # plan applied at the run's start broke what the script does before calling the model
                # (a check of the cut batch against targets memprof left whole), not the script's end.
                schedule.fail(said)
            else:  # after the last plan's step, before the next one began: the script's end, not the plan's
                log.warning("%s after its training steps; the plans not run yet run in another run of it", said)
                ended = said
            schedule.end_run(exc.report)
            report = exc.report
        else:
            schedule.end_run(report)
        meta = meta or (report.meta if report is not None else None)
        if len(schedule.pending()) == before:  # the script ended before the next plan could run
            for name in schedule.pending():
                schedule.failed[name] = ("the script ended before this plan could run: run it for more steps"
                                         if ended is None else f"{ended}, before this plan's first forward")
                schedule._advance(name)
    return meta or {}


def _prediction(view: Report, strategies: list, busy: float | None = None):
    from memprof.strategies import Prediction

    # Each observed step ran one of K micro-batches: a real step runs K.
    k = _micro_batches(strategies)
    return replace(Prediction.from_report(view, time_factor=k), device_seconds=None if busy is None else busy * k)


def verify_script(advice: ScriptAdvice, args: Sequence[str] = (), *, top: int = 3, steps: int = 3) -> pd.DataFrame:
    """Run the best plans for real on the local GPU (the script's own step), one run each, and measure them
    (the ``top`` fastest that fit and that run inside the script's loop: not sharding).

    Each run is a process of its own, started afresh as the user's run of the
    plan would be: a second run of a script in one process meets what the
    first left there (Accelerate's shared state, a process group, cached
    allocator segments): an Accelerate script's checkpointing measured 9.28 GiB
    allocated in the advising process, 7.71 GiB in its own
    (benchmarks/results/verify-fresh-runs.md)."""
    import multiprocessing

    if not torch.cuda.is_available():
        raise RuntimeError("--verify measures on a CUDA GPU and none is available here")
    # Sharding (ZeRO, state offload) replaces the parameters the script's own optimizer holds:
    # those plans run only as the user's code change, not inside the script's loop.
    runs = [n for n in advice.table.index[advice.table["fits"]]
            if n != "baseline" and all(s.simulated for s in advice.plans[n]())]
    names = ["baseline", *runs[:top]]
    rows = []
    spawn = multiprocessing.get_context("spawn")  # a fork would share this process's CUDA context
    for name in names:
        ours, theirs = spawn.Pipe(duplex=False)
        # Not a Pool's daemonic worker: the script's data loaders start processes of their own.
        child = spawn.Process(target=_measure_plan, args=(theirs, advice.script, list(args), advice.plans[name](),
                                                           advice.facts, steps))
        child.start()
        theirs.close()
        try:
            got = ours.recv()
        except EOFError:
            got = {"error": "its process ended without an answer (out of host memory?)"}
        child.join()
        if "error" in got:
            rows.append({"plan": name, "error": got["error"]})
            continue
        pred = advice.table.loc[name]
        measured_seconds = got["seconds"] * _micro_batches(advice.plans[name]())
        rows.append({
            "plan": name,
            "predicted_peak_reserved": int(pred["peak_reserved"]),
            "measured_peak_reserved": got["peak_reserved"],
            "predicted_peak_allocated": int(pred["peak_allocated"]),
            "measured_peak_allocated": got["peak_allocated"],
            "predicted_seconds": float(pred["seconds"]),
            "predicted_device_share": float(pred.get("device_share", float("nan"))),
            "measured_seconds": measured_seconds,
            "time_error": float(pred["seconds"]) / measured_seconds - 1,
            "measured_spread": got["spread"],
            "fits_budget": got["peak_reserved"] <= advice.budget,
        })
    advice.verified = pd.DataFrame(rows).set_index("plan")
    return advice.verified


def _measure_plan(conn, script: str, args: list, strategies: list, facts: "ScriptFacts | None", steps: int) -> None:
    """In a process of its own: sends the script's last tracked step with ``strategies`` applied, or the error."""
    import socket

    # A port of its own for a script that rendezvous through the environment (torchrun's
    # MASTER_PORT): the advice's own run of it may still hold the one it used.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from memprof.strategies import ExpandableSegments

    stack = ExitStack()
    changed = any(not isinstance(s, ExpandableSegments) for s in strategies)

    def on_model(model, opt):
        # The script's first step (how memprof finds the model) ran as it is; a run of the plan
        # from its start has none of what that step cached. Emptied, what is left is what the
        # advice's prediction of the plan's step starts from (_Schedule.on_step), less the
        # cache_excess it adds: kept, the step as it is would count in every plan's peak reserved
        # (GPT-2 on the H200, checkpointed: 11.94 GiB measured after it, 4.00 GiB predicted).
        apply_to_script(strategies, model, opt, False, stack, facts)
        if changed:  # not the step as it is, nor a setting in force from the script's start
            torch.cuda.empty_cache()

    try:
        with stack:
            for strategy in strategies:  # the allocator's settings, before the script starts CUDA
                stack.enter_context(strategy.building())
            r = observe_script(script, args, steps=steps, warmup=1, on_model=on_model)
    except Exception as exc:  # noqa: BLE001 - reported in the plan's row
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    last = r.steps.iloc[-1]
    # The steps after the first (profiled in full, the others cheaply): their median and spread.
    times = [float(t) for t in r.steps["seconds"].iloc[1:]] or [float(last["seconds"])]
    conn.send({"peak_reserved": int(last["peak_reserved"]), "peak_allocated": int(last["peak_allocated"]),
               "seconds": statistics.median(times), "spread": _spread(times)})


def _local_gpu() -> GPU:
    from .devices import detect_gpu

    gpu = detect_gpu()
    if gpu is None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = GPU(props.name, props.total_memory, 2_000_000_000_000, True, None, None, 60.0, 32_000_000_000, None,
                  (props.major, props.minor))
    return gpu
