"""The values of small tensors on the simulated GPU.

A simulated step runs on meta tensors, which have shapes but no values. Most of
a training step never needs values, but scripts and libraries branch on a few
small ones: an attention mask that is all ones (Hugging Face then drops it and
attention takes another kernel), a ``GradScaler``'s found-inf flag (the
optimizer steps only when it is zero), token ids turned into a boolean mask and
then indexed (``nonzero`` has a value-dependent shape).

So every meta storage of at most :data:`LIMIT` bytes whose inputs are known
keeps a CPU copy, a *shadow*: factories and copies from host tensors give
one, each operator whose tensor inputs all have shadows runs once more on
the shadows, and an in-place operator that cannot be followed drops the shadow
of what it writes. Shadows are kept per storage, so views and in-place updates
stay consistent. Operators whose output shape depends on values (PyTorch tags
them ``dynamic_output_shape``) run on the shadows and hand back meta tensors
of the shapes they produced; without shadows they cannot run and raise
:class:`UnknownValues`. Large tensors (activations, weights) never get shadows,
so the cost stays small.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .aten_args import PYTORCH_NAMESPACES, decomposes, leaves, map_leaves, tensors

__all__ = ["HOST_FLOPS", "LIMIT", "UnknownValues", "Values"]

log = logging.getLogger(__name__)

#: Largest storage, in bytes, whose values are followed: token ids and masks of a
#: batch, scalars, small index tensors.
LIMIT = 1 << 20

#: Most arithmetic (torch.utils.flop_counter's count) an operator may cost the host to follow
#: its values: a small output can take much work (a small network's convolutions and their
#: backward, in fp16, which the host computes slowly), and the values steps branch on come
#: from cheap operators (masks, indices, a router's product of a few experts' columns).
HOST_FLOPS = 1 << 24

_META = torch.device("meta")
_CPU = torch.device("cpu")


class UnknownValues(RuntimeError):
    """An operator needs values that the simulation does not have."""


def _flops(func, args: tuple, kwargs: dict, out: Any) -> int:
    """The operator's arithmetic, as the simulated GPU's time model counts it."""
    from .simulate import _flops  # (which imports this module)

    return _flops(func, args, kwargs, out)


def _writes(func) -> tuple[int, ...]:
    """Positions of the arguments ``func`` writes to (``add_``'s self, ``out=``)."""
    cached = _WRITES.get(func)
    if cached is None:
        cached = tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = cached
    return cached


_WRITES: dict[Any, tuple[int, ...]] = {}

_ops = torch.ops.aten
#: Factories of uninitialised memory: their values are not known (on the host they would be
#: whatever the memory held, and a kernel reading them, max-pooling's backward following
#: indices an offloaded activation left empty, would read out of bounds).
_UNINITIALISED = {_ops.empty.memory_format, _ops.empty_strided.default, _ops.new_empty.default,
                  _ops.new_empty_strided.default, _ops.empty_like.default, _ops.empty_permuted.default}
#: In-place operators that write every element of their first argument from the others alone
#: (or from the random generator: how a module initialises the parameters it made empty).
_OVERWRITES = {_ops.fill_.Scalar, _ops.fill_.Tensor, _ops.zero_.default, _ops.copy_.default, _ops.uniform_.default,
               _ops.normal_.default, _ops.random_.default, getattr(_ops.random_, "from"), _ops.random_.to,
               _ops.exponential_.default, _ops.bernoulli_.float, _ops.log_normal_.default, _ops.cauchy_.default,
               _ops.geometric_.default}


def _whole(t: Any, limit: int) -> bool:
    """Whether ``t`` is a meta tensor of at most ``limit`` bytes that is all of its storage."""
    return (isinstance(t, torch.Tensor) and t.is_meta and t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes() <= limit)


class Values(TorchDispatchMode):
    """Follows the values of small meta tensors (see the module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch._disable_dynamo around every operator: nothing compiles under the
        # simulation (see SimulatedAllocator._should_skip_dynamo).
        return False

    def __init__(self, limit: int = LIMIT, synchronize: Callable[[int], None] | None = None,
                 read_back: Callable[[int, bool], None] | None = None) -> None:
        super().__init__()
        self.limit = limit
        #: Called with the bytes read back where CUDA's kernel makes the host wait for a size
        #: it computed (``nonzero``, ``x[mask]``, ``unique``): the simulated clocks meet there.
        self.synchronize = synchronize
        #: Called with the bytes a copy from the device to the host moves, and whether the host waits.
        self.read_back = read_back
        self._shadows: dict[weakref.ref, torch.UntypedStorage] = {}
        # Truth tensors too large for a shadow whose every element is known (Values.assume).
        self._constants: dict[weakref.ref, bool] = {}
        # Indices made up spread evenly (topk, argmax of values not followed): noted once read.
        self._spread: dict[weakref.ref, None] = {}
        # Truths made up (Values.assume): a check the script raises on answers them otherwise.
        self._assumed: dict[weakref.ref, None] = {}

    def _spread_gone(self, key: weakref.ref) -> None:
        self._spread.pop(key, None)

    def _assumed_gone(self, key: weakref.ref) -> None:
        self._assumed.pop(key, None)

    # -- reading ---------------------------------------------------------------
    def shadow(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s values as a CPU tensor (``t`` itself when it is not a meta tensor), or None."""
        if not t.is_meta:
            return t
        key = weakref.ref(t.untyped_storage())
        storage = self._shadows.get(key)
        if storage is None:
            return None
        if self._spread and key in self._spread:
            _note("topk, argmax", "the indices of topk, argmax, argmin, max(dim) or min(dim) of values not "
                  "followed: spread evenly over their dimension (so a mixture of experts' router gives each "
                  "expert an equal share of the tokens)")
        return torch.empty(0, dtype=t.dtype, device=_CPU).set_(storage, t.storage_offset(), t.size(), t.stride())

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of the meta tensor ``t``: its values where known, else ones; where large, one
        element expanded to its shape (what an activation offloaded to the host becomes: no device
        memory and no host memory, read as ones like a small one, moved back whole)."""
        known = self.shadow(t)
        if known is not None:
            return known.clone()
        if t.numel() * t.element_size() <= MADE_UP_LIMIT:
            return torch.ones(t.shape, dtype=t.dtype, device=_CPU)
        return torch.ones((), dtype=t.dtype, device=_CPU).expand(t.shape)

    #: Higher-order operators (flex attention) pass through to the modes below.
    supports_higher_order_operators = True

    # -- following operators -----------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if types and decomposes(types):  # a DTensor's own operators come back here one by one
            return NotImplemented
        # The simulated device's torch-function mode is on where autograd's engine runs (backward):
        # here, and in the modes below, every tensor property read would go through it. In
        # forward the mode is off here already (it is handling the call that dispatched).
        with torch._C.DisableTorchFunction():
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func, args: tuple, kwargs: dict):
        out = self._follow(func, args, kwargs)
        if self.synchronize is not None and _reads_size_back(func, args) and any(
                isinstance(t, torch.Tensor) and t.is_meta for t in tensors(out)):
            self.synchronize(8)
        return out

    def _follow(self, func, args: tuple, kwargs: dict):
        kwargs = _host(kwargs)  # C++'s own calls, below the torch-function mode that strips it too
        flat = list(leaves(args, kwargs))
        metas = [a for a in flat if isinstance(a, torch.Tensor) and a.is_meta]
        on_meta = metas or any(a == _META for a in flat if isinstance(a, torch.device))
        if not on_meta:
            return func(*args, **kwargs)  # the host's own work: real tensors, real values
        name, dynamic = _op(func)
        if func is torch.ops.aten._to_copy.default and args[0].layout in _SPARSE_LAYOUTS:
            return _sparse_to_copy(*args, **kwargs)  # a host sparse tensor moved to the device, or a copy on it
        if any(t.layout not in (torch.strided, torch.jagged) for t in metas):  # sparse tensors: not followed
            sparse = _SPARSE.get(name)
            return sparse(*args, **kwargs) if sparse is not None else func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default and not args[0].is_meta:
            # A copy to the host (``host.copy_(x)`` in Python, DDP's reducer reading back the
            # bucket order it broadcast in C++, an activation offloaded to a pinned buffer): the
            # source's values where known, else the host tensor is left as it is.
            self._copied_to_host(args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            known = self.shadow(args[1])
            return args[0] if known is None else args[0].copy_(known)
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == _CPU:
            # x.to("cpu") from C++ or from a hook the torch-function mode does not see.
            self._copied_to_host(args[0], kwargs.get("non_blocking", False))
            copy = self.host_copy(args[0])
            return copy if kwargs.get("dtype") is None else copy.to(kwargs["dtype"])
        if func in _UNINITIALISED:
            return func(*args, **kwargs)  # no values to follow: its memory is whatever was there
        if func in _NO_META:
            out = _NO_META[func](*args, **kwargs)
            for a, t in zip(func._schema.arguments, args):  # what it wrote in place is not followed
                if a.alias_info is not None and a.alias_info.is_write and isinstance(t, torch.Tensor):
                    self._shadows.pop(weakref.ref(t.untyped_storage()), None)
            return out
        known = all(self._has(t) for t in metas)
        if func in _READS:  # a value for the host (C++'s item(), torch.equal): the shadows', else made up
            return func(*map_leaves(self._cpu, args), **kwargs) if known else _READS[func](*args, **kwargs)
        limit = self._limit(func, args)
        if (not known and func in _OVERWRITES and _whole(args[0], limit)
                and all(self._has(t) for t in metas[1:])):
            # Every element of the target written from known values (an empty tensor filled, copied
            # into): its old values do not matter, so it is known after.
            out = func(*args, **kwargs)
            host = torch.zeros(args[0].shape, dtype=args[0].dtype, device=_CPU)
            self._keep(out, func(host, *map_leaves(self._cpu, args[1:]), **_host(map_leaves(self._cpu, kwargs))), limit)
            return out
        if not known and name in _SPREAD and func._overloadname in _SPREAD[name]:
            out = func(*args, **kwargs)
            indices = out if isinstance(out, torch.Tensor) else out[1]
            if indices.dtype is torch.long and _whole(indices, self.limit):
                self._keep(indices, _spread(func, args, kwargs, indices))
                # Noted where they are read (shadow): max(dim).values of a stable softmax uses none
                self._spread[weakref.ref(indices.untyped_storage(), self._spread_gone)] = None
            return out
        if not known and name in _OF_CONSTANTS and func._overloadname != "out":
            value = self._constants.get(weakref.ref(metas[0].untyped_storage()))
            if value is not None:  # isnan(x).any() of an x too large to follow: no NaN
                out = func(*args, **kwargs)
                self.assume(out, value != (name in _NEGATIONS))
                return out
        if not known and name in _SUCCEEDS:
            out = func(*args, **kwargs)
            info = out[-1]
            if _whole(info, self.limit):
                self._keep(info, torch.zeros(info.shape, dtype=info.dtype, device=_CPU))
                _note("linalg info", "a factorization's info of values not followed: taken as success (0), as for "
                      "a well-conditioned matrix (a Cholesky with a jitter retry tries once)")
            return out
        if not known and name in _ASSUMED_TRUE:
            out = func(*args, **kwargs)
            if out.dim() == 0 and self.assume(out, True):
                _note("any()", "of values not followed: taken as true (a routing mask selects some tokens)")
            return out
        if not known and name in _ABSORBING:
            absorbed = self._absorbed(func, args, kwargs, metas)
            if absorbed is not None:
                return absorbed
        if not known and name in _BY_MASK and func._overloadname != "out":
            exact = self._by_known_mask(func, name, args)
            if exact is not None:
                return exact
        bound = _BOUNDED.get(name) if not known else None
        if bound is not None and func._overloadname != "out":
            return bound(func, *args, **kwargs)
        if dynamic:
            if not known:
                try:  # the shapes may decide all the same (x[idx] with integer indices)
                    return func(*args, **kwargs)
                except (NotImplementedError, RuntimeError) as exc:
                    if "meta" not in str(exc).lower():
                        raise
                raise UnknownValues(_unknown(func)) from None
            result = func(*map_leaves(self._cpu, args), **_host(map_leaves(self._cpu, kwargs)))
            out = map_leaves(_meta_like, result)
            self._keep(out, result)
            return out
        out = func(*args, **kwargs)
        # A factory has no inputs to be unknown (torch.randn of a batch): the size of what it
        # makes decides, so the host never computes a large tensor. A library's kernels (torchvision's
        # deform_conv2d) are not run on the host for values no shape depends on: they are not
        # PyTorch's, and torchvision's deformable convolution crashed the process on the shadows.
        known = (known and func.namespace in PYTORCH_NAMESPACES
                 and all(o.layout is torch.strided and o.untyped_storage().nbytes() <= limit
                         for o in tensors(out) if o.is_meta) and _flops(func, args, kwargs, out) <= HOST_FLOPS)
        if known:
            try:
                result = func(*map_leaves(self._cpu, args), **_host(map_leaves(self._cpu, kwargs)))
            except Exception:  # e.g. a kernel the host has no implementation of
                known = False
            else:
                self._keep(out, result, limit)
        if not known:
            for i in _writes(func):
                target = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
                for t in target if isinstance(target, (list, tuple)) else (target,):
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        self._shadows.pop(weakref.ref(t.untyped_storage()), None)
        return out

    def _absorbed(self, func, args: tuple, kwargs: dict, metas: list) -> Any:
        """``a | b`` with ``a`` known all true (``a & b``, all false) is known whatever ``b`` is:
        a stopping criterion that is met (Hugging Face's generate() ORs its max-length check with an
        end-of-sequence check on generated tokens, whose values are unknown, and stops once all are
        done). Else None."""
        value = _ABSORBING[_op(func)[0]]
        out_shape = torch.broadcast_shapes(*(t.shape for t in metas))
        if not any(t.dtype is torch.bool and t.shape == out_shape and self._has(t)
                   and bool((self.shadow(t) == value).all()) for t in metas):
            return None
        out = func(*args, **kwargs)
        self._shadows.pop(weakref.ref(out.untyped_storage()), None)  # in place: the target's is replaced
        if _whole(out, self.limit):
            self._keep(out, torch.full(out.shape, value, dtype=out.dtype, device=_CPU))
        return out

    def _by_known_mask(self, func, name: str, args: tuple) -> Any:
        """``x[mask]`` and ``x.masked_select(mask)`` where the mask's values are known and only
        ``x``'s are not (an identity mask's complement over a similarity matrix of features):
        the mask alone sizes the output, as ``nonzero`` of it indexes on CUDA (Indexing.cu
        expands a boolean index into its nonzero positions). Else None."""
        if name == "aten::masked_select":
            x, mask = args[0], args[1]
            known = self.shadow(mask)
            if known is None:
                return None
            n = int(known.expand(torch.broadcast_shapes(x.shape, mask.shape)).count_nonzero())
            return x.new_empty((n,))
        x, indices = args[0], args[1]
        full = []
        for i in indices:
            if i is not None and i.dtype in (torch.bool, torch.uint8):
                known = self.shadow(i)
                if known is None:
                    return None
                n = int(known.count_nonzero())
                full += [i.new_empty((n,), dtype=torch.long)] * i.dim()
            else:
                full.append(i)
        return func(x, full)

    def assume(self, t: torch.Tensor, value: bool) -> bool:
        """Take every element of ``t``, whose inputs' values are not followed, as ``value`` (a
        truth the step's code branches on). Where ``t`` is too large for a shadow, the value
        is kept for its reductions and negations only (``isnan(logits).any()``); False then."""
        if not _whole(t, self.limit):
            if t.is_meta and t.numel():
                self._constants[weakref.ref(t.untyped_storage(), self._forget_constant)] = value
            return False
        self._keep(t, torch.full(t.shape, value, dtype=t.dtype, device=_CPU))
        self._assumed[weakref.ref(t.untyped_storage(), self._assumed_gone)] = None
        return True

    def made_up(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s values are not the script's: not followed, or assumed."""
        return t.is_meta and (not self._has(t) or weakref.ref(t.untyped_storage()) in self._assumed)

    def forget(self, t: torch.Tensor) -> None:
        """``t``'s values are no longer known: written where the simulation does not see."""
        key = weakref.ref(t.untyped_storage())
        self._shadows.pop(key, None)
        self._constants.pop(key, None)

    def _copied_to_host(self, t: torch.Tensor, non_blocking: bool) -> None:
        if self.read_back is not None:
            self.read_back(t.numel() * t.element_size(), not non_blocking)

    def _forget_constant(self, key: weakref.ref) -> None:
        self._constants.pop(key, None)

    def _has(self, t: torch.Tensor) -> bool:
        return weakref.ref(t.untyped_storage()) in self._shadows

    def _cpu(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_meta:
            return self.shadow(a)
        if isinstance(a, torch.device) and a == _META:
            return _CPU
        return a

    def _limit(self, func, args: tuple) -> int:
        """The largest tensor ``func`` makes whose values are followed: larger for integers and
        truths copied from the host (a graph batch's node-to-graph index, an edge list): the host
        has them already, and the script's sizes are read from them (``batch.max() + 1`` graphs)."""
        source = args[0] if func is _TO_COPY else args[1] if func is _COPY and len(args) > 1 else None
        if (isinstance(source, torch.Tensor) and not source.is_meta and not source.is_floating_point()
                and not source.is_complex()):
            return max(self.limit, UPLOAD_LIMIT)
        return self.limit

    def _keep(self, out: Any, result: Any, limit: int | None = None) -> None:
        outs, results = tensors(out), tensors(result)
        for o, r in zip(outs, results):
            if not o.is_meta or self._has(o) or o.shape != r.shape:
                continue  # a view or in-place result: its storage's shadow was updated already
            storage = o.untyped_storage()
            if storage.nbytes() > (limit or self.limit):
                continue
            # On the host whatever the default device (a script's set_default_device("cuda") is meta here).
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device=_CPU).untyped_storage()
            view = torch.empty(0, dtype=o.dtype, device=_CPU).set_(host, o.storage_offset(), o.size(), o.stride())
            if torch._debug_has_internal_overlap(view) == 1:
                continue  # elements share memory (an expanded layout): copy_ refuses it, as PyTorch's own check says
            view.copy_(r)
            self._shadows[weakref.ref(storage, self._forget)] = host

    def _forget(self, key: weakref.ref) -> None:
        self._shadows.pop(key, None)


_INDEX_PUT = {"aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _masks(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _reads_size_back(func, args: tuple) -> bool:
    """Whether CUDA's kernel for this call copies a size to the host and waits for it: the
    value-shaped operators (``nonzero``, ``unique``, ``masked_select``), and indexing by a mask
    (``x[mask]``, ``x[mask] = v``: a ``nonzero`` of the mask first); integer indices do not."""
    name, dynamic = _op(func)
    if name == "aten::index" or name in _INDEX_PUT:
        return len(args) > 1 and _masks(args[1])
    return dynamic


def _op(func) -> tuple[str, bool]:
    """An operator's schema name and whether its output shape depends on values (PyTorch's
    ``dynamic_output_shape`` tag), learnt once: its tags cost 0.7 us a call, on every operator."""
    facts = _OPS.get(func)
    if facts is None:
        facts = _OPS[func] = (func._schema.name, torch.Tag.dynamic_output_shape in func.tags)
    return facts


_OPS: dict[Any, tuple[str, bool]] = {}


#: Largest host tensor made up (ones) for a copy to the host of a tensor whose values are unknown.
MADE_UP_LIMIT = 16 << 20
#: Largest tensor of integers or truths copied from the host whose values are followed (Values._limit).
UPLOAD_LIMIT = 64 << 20
_TO_COPY, _COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default


def _host(kwargs: dict) -> dict:
    # Page-locked host memory is no device memory, and a host without a GPU cannot pin.
    return {**kwargs, "pin_memory": False} if kwargs.get("pin_memory") else kwargs


def _meta_like(r: Any) -> Any:
    if isinstance(r, torch.Tensor):
        return torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
    return r


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``aten._ctc_loss`` of log-probabilities the simulation does not follow: its outputs as CUDA's
    kernel makes them (LossCTC.cu: the loss per sample, and log_alpha of batch x input length x
    (2 x the longest target + 1)). The longest target is read from the lengths where they are
    integers (``F.ctc_loss`` hands them to the kernel so, read back from the device: the values
    followed); with lengths in a tensor, as long as the targets allow (the padded width of 2-D
    targets, all of 1-D ones): an upper bound."""
    longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
    if isinstance(target_lengths, (list, tuple)) and target_lengths:
        longest = min(longest, max(target_lengths))
    else:
        log.info("CTC loss: target lengths unknown to the simulation; log_alpha sized for targets of %d", longest)
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    nll = log_probs.new_empty((batch,) if log_probs.dim() == 3 else ())
    log_alpha = log_probs.new_empty((batch, log_probs.shape[0], 2 * longest + 1))
    return nll, log_alpha


def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                       zero_infinity=False):
    """``aten._ctc_loss_backward``, which has no meta kernel: CUDA's (LossCTC.cu) makes the
    gradient of the log-probabilities and, while it runs, a log_beta as large as log_alpha."""
    log_beta = log_alpha.new_empty(log_alpha.shape)
    out = log_probs.new_empty(log_probs.shape)
    del log_beta
    return out


_warned: set[str] = set()


#: Operators that pick indices by values (a mixture's router: top-k experts per token), whose
#: indices are made up where the values are not followed: spread evenly over the dimension, each
#: row's k distinct. Sized for every token at every expert instead (x[mask] of a routing mask),
#: a mixture's experts held E / k times their activations (Mixtral: four times).
#: Operators whose result is indices, by overload: max and min over every element (their
#: "default") give a value, which stays unknown (a sampling loop's ``unfinished.max() == 0``).
_SPREAD = {"aten::topk": ("default",), "aten::argmax": ("default",), "aten::argmin": ("default",),
           "aten::max": ("dim",), "aten::min": ("dim",)}


def _spread(func, args: tuple, kwargs: dict, indices: torch.Tensor) -> torch.Tensor:
    """``func``'s indices spread evenly: row r (in C order over the other dimensions) takes
    r * k, r * k + 1, ... modulo the dimension's size, for k indices per row (topk's k, else 1)."""
    schema = func._schema.arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}  # topk's dim=-1
    given = {**defaults, **dict(zip((a.name for a in schema), args)), **kwargs}
    x, dim = given["self"], given.get("dim")
    if dim is None:  # argmax over all elements: one index
        return torch.zeros(indices.shape, dtype=torch.long, device=_CPU)
    dim = dim % max(x.dim(), 1)
    n = x.shape[dim] if x.dim() else 1
    k = given.get("k", 1) if func._schema.name == "aten::topk" else 1
    rows = indices.numel() // max(k, 1)
    spread = (torch.arange(rows, device=_CPU)[:, None] * k + torch.arange(k, device=_CPU)[None, :]) % max(n, 1)
    if func._schema.name == "aten::topk" or given.get("keepdim"):
        moved = list(indices.movedim(dim, -1).shape)
        return spread.reshape(moved).movedim(-1, dim)
    return spread.reshape(indices.shape)


#: Reductions to one truth value whose answer on values not followed is taken as true: a
#: routing mask selects some tokens (``if not mask.any(): continue`` skipped every expert of a
#: mixture). ``all()`` keeps the made-up False of any other truth: a decoding loop's ``if
#: done.all(): break`` runs on to its length, an upper bound.
_ASSUMED_TRUE = {"aten::any"}
#: Factorizations and solves that report failure in an ``info`` tensor, their last output,
#: instead of raising (GPyTorch's psd_safe_cholesky retries with more jitter while it is not 0).
_SUCCEEDS = {"aten::linalg_cholesky_ex", "aten::linalg_inv_ex", "aten::linalg_lu_factor_ex",
             "aten::linalg_ldl_factor_ex", "aten::linalg_solve_ex"}
#: What a truth tensor of one value everywhere (Values.assume) answers: the same value, negated
#: for the negations.
_NEGATIONS = {"aten::logical_not", "aten::bitwise_not"}
_OF_CONSTANTS = {"aten::any", "aten::all", *_NEGATIONS}

#: Boolean operators with an absorbing value: the result where one operand holds it everywhere.
_ABSORBING = {**dict.fromkeys(("aten::bitwise_or", "aten::bitwise_or_", "aten::__or__", "aten::__ior__",
                                "aten::logical_or", "aten::logical_or_"), True),
              **dict.fromkeys(("aten::bitwise_and", "aten::bitwise_and_", "aten::__and__", "aten::__iand__",
                               "aten::logical_and", "aten::logical_and_"), False)}


def _note(what: str, why: str, message: str | None = None) -> None:
    """In the report's notes of the simulated GPU running, and logged once a process (every
    step, every plan does it again)."""
    from .virtual_cuda import current  # imports this module

    device = current()
    if device is not None:
        device.notes.setdefault(what, why)
    if what not in _warned:
        _warned.add(what)
        log.warning("%s", message or f"{what}: {why}")


def _every_element(what: str, assumption: str = "every element were selected") -> None:
    # In the report's notes: its peak may be above the GPU's.
    _note(f"upper bound: {what}", f"on values not followed, sized as if {assumption}",
          f"{what} on values the simulation does not follow (computed from large tensors): sized as if "
          f"{assumption}, an upper bound")


def _nonzero(func, self):
    """``nonzero`` (``torch.where(mask)``, ``argwhere``): every element nonzero."""
    _every_element("nonzero (torch.where(mask))", "every element were nonzero")
    return self.new_empty((self.numel(), self.dim()), dtype=torch.long)


def _index(func, self, indices):
    """``x[mask]``: the mask taken all true, as ``nonzero`` of it would index (integer indices keep
    their shapes: the meta kernel sizes them)."""
    if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return func(self, indices)
    _every_element("x[mask]")
    full = []
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            full += [i.new_empty((i.numel(),), dtype=torch.long)] * i.dim()
        else:
            full.append(i)
    return func(self, full)


def _masked_select(func, self, mask):
    _every_element("masked_select")
    return self.new_empty((torch.broadcast_shapes(self.shape, mask.shape).numel(),))


def _unique(func, self, *args, **kwargs):
    """``unique`` and ``unique_consecutive`` over all elements: every element distinct; the inverse
    indices and counts as CUDA's kernels make them when asked for (Unique.cu), else empty."""
    names = [a.name for a in func._schema.arguments]
    given = {**dict(zip(names, (self, *args))), **kwargs}
    if given.get("dim") is not None:  # unique rows or columns: not bounded here
        raise UnknownValues(_unknown(func))
    _every_element("unique", "every element were distinct")
    inverse, counts = given.get("return_inverse", False), given.get("return_counts", False)
    n = self.numel()
    outs = [self.new_empty((n,)), self.new_empty(self.shape if inverse else (0,), dtype=torch.long)]
    if len(func._schema.returns) == 3:
        outs.append(self.new_empty((n,) if counts else (0,), dtype=torch.long))
    return tuple(outs)


def _bincount(func, self, weights=None, minlength=0):
    """``bincount(x, minlength=n)``: the values taken below ``minlength``, as its callers mean them
    (class or node counts); without it there is no bound."""
    if not minlength:
        raise UnknownValues(_unknown(func))
    _every_element("bincount", "every value were below its minlength")
    return self.new_empty((minlength,), dtype=torch.long if weights is None else weights.dtype)


def _nms(func, boxes, scores, iou_threshold):
    """torchvision's ``nms``: every box kept."""
    _every_element("torchvision's nms", "every box were kept")
    return boxes.new_empty((boxes.shape[0],), dtype=torch.long)


#: Value-shaped operators that a known mask sizes whatever the data's values (Values._by_known_mask).
_BY_MASK = ("aten::index", "aten::masked_select")

#: Operators whose output shape depends on values, with an upper bound for when they are
#: unknown, by name (torchvision's without importing it).
_BOUNDED = {"aten::_ctc_loss": lambda func, *a, **k: _ctc_loss(*a, **k), "aten::nonzero": _nonzero,
            "aten::index": _index, "aten::masked_select": _masked_select, "aten::_unique": _unique,
            "aten::_unique2": _unique, "aten::unique_consecutive": _unique,
            "aten::bincount": _bincount, "torchvision::nms": _nms}


def _sample_like(self, *args, **kwargs):
    return self.new_empty(self.shape)


def _binomial(count, prob, generator=None):
    return count.new_empty(torch.broadcast_shapes(count.shape, prob.shape))


def _fused_observer_fake_quant(self, observer_on, fake_quant_on, running_min, running_max, scale, zero_point,
                               *args, **kwargs):
    """Quantization-aware training's fused observer: a per-channel one's empty statistics first
    take the channels' size, as the CUDA kernel sizes them (FusedObsFakeQuant.cu), which
    PyTorch's meta kernel does not (the weights' observers stayed empty, and convert() failed)."""
    per_channel, ch_axis = kwargs.get("per_row_fake_quant", args[4] if len(args) > 4 else False), (
        kwargs.get("ch_axis", args[3] if len(args) > 3 else 0))
    if per_channel and running_min.numel() == 0:
        for t in (running_min, running_max, scale, zero_point):
            t.resize_(self.size(ch_axis))
    return torch.ops.aten._fused_moving_avg_obs_fq_helper.default(
        self, observer_on, fake_quant_on, running_min, running_max, scale, zero_point, *args, **kwargs)


#: Operators without a meta kernel, or whose meta kernel leaves out what CUDA's does, as CUDA's
#: kernels allocate (through the modes below this one): CTC's backward, the samplers of
#: torch.distributions' Beta, Dirichlet and Binomial, quantization-aware training's observer.
_NO_META = {torch.ops.aten._ctc_loss_backward.Tensor: _ctc_loss_backward,
            torch.ops.aten._ctc_loss_backward.default: _ctc_loss_backward,
            torch.ops.aten._sample_dirichlet.default: _sample_like,
            torch.ops.aten.binomial.default: _binomial,
            torch.ops.aten._fused_moving_avg_obs_fq_helper.default: _fused_observer_fake_quant}


def _made_up_scalar(t: torch.Tensor) -> Any:
    # As VirtualCUDA's .item() of an unknown tensor: False for truth tests, else one.
    return False if t.dtype is torch.bool else 1 if not t.is_floating_point() and not t.is_complex() else 1.0


def _coalesce(self):
    """A sparse COO tensor's ``coalesce()``: no entry taken for a duplicate (an upper bound)."""
    return _clone(self, coalesced=True)


def _clone(self, *args, coalesced: bool | None = None, **kwargs):
    """A sparse COO tensor's copy, with as many entries (PyTorch's meta kernel makes one without any:
    autograd's copy of an embedding's sparse gradient was empty, and SparseAdam skipped it)."""
    indices, values = self._indices(), self._values()
    return torch.sparse_coo_tensor(indices.new_empty(indices.shape), values.new_empty(values.shape), self.shape,
                                   is_coalesced=self.is_coalesced() if coalesced is None else coalesced,
                                   check_invariants=False)


def _sparse_mask(self, mask):
    """``dense.sparse_mask(sparse)``: ``self``'s values at ``mask``'s entries (SparseAdam's moments at the gradient's)."""
    indices = mask._indices()
    values = self.new_empty((indices.shape[1], *self.shape[indices.shape[0]:]))
    return torch.sparse_coo_tensor(indices.new_empty(indices.shape), values, self.shape, is_coalesced=mask.is_coalesced(),
                                   check_invariants=False)


def _add(self, other, *args, **kwargs):
    """``sparse + sparse``: CUDA's kernel concatenates the two operands' indices and values instead
    of merging them (SparseCUDATensorMath.cu, ``add_out_sparse_cuda``), uncoalesced: the gradient of
    an embedding looked up twice (a knowledge graph's head and tail entities) has both lookups'
    rows. PyTorch's meta kernel makes it without any. ``dense + sparse``: dense, as CUDA's."""
    if self.layout is torch.strided:
        return torch.empty_like(self, dtype=torch.result_type(self, other))
    indices, values = self._indices(), self._values()
    nnz = indices.shape[1] + other._indices().shape[1]
    return torch.sparse_coo_tensor(indices.new_empty((indices.shape[0], nnz)),
                                   values.new_empty((nnz, *values.shape[1:]), dtype=torch.result_type(self, other)),
                                   self.shape, is_coalesced=False, check_invariants=False)


def _add_(self, other, *args, **kwargs):
    """``dense.add_(sparse)`` (SparseAdam's update, the parameter's ``add_``): in place, where
    PyTorch's kernel would coalesce on the meta device, which it cannot. ``sparse.add_(sparse)``
    (autograd accumulating a sparse gradient): ``self`` holds the two concatenated (:func:`_add`)."""
    if self.layout is torch.strided:
        return self
    return torch.ops.aten.copy_sparse_to_sparse_(self, _add(self, other))


def _sparse_product(self, *args, **kwargs):
    """A product with a sparse operand (``torch.sparse.mm(adjacency, x)``, its backward's
    ``adjacency.t() @ grad``): the dense result, as cuSPARSE writes it."""
    m1, m2 = (self, args[0]) if len(args) == 1 else args[:2]
    dense = m2 if m2.layout is torch.strided else m1
    return dense.new_empty((m1.shape[0], m2.shape[1]))


_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _sparse_to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
                    memory_format=None):
    """A sparse tensor's copy to the device (pygcn's ``adj.cuda()``) or on it (``adj.to(dtype)``): its
    parts copied, as CUDA's copy keeps them; PyTorch's kernel for the meta device makes one without any
    entries (nnz 0), so the adjacency took no memory and its products no time."""
    device = device if device is not None else self.device
    dtype = dtype if dtype is not None else self.dtype
    if layout not in (None, self.layout):
        raise NotImplementedError(f"a sparse tensor's copy to layout {layout} on the simulated GPU")
    if self.layout is torch.sparse_coo:
        return torch.sparse_coo_tensor(self._indices().to(device, non_blocking=non_blocking),
                                       self._values().to(device, dtype, non_blocking=non_blocking), self.shape,
                                       is_coalesced=self.is_coalesced(), check_invariants=False)
    compressed, plain = ((self.crow_indices(), self.col_indices()) if self.layout in (torch.sparse_csr, torch.sparse_bsr)
                         else (self.ccol_indices(), self.row_indices()))
    return torch.sparse_compressed_tensor(compressed.to(device), plain.to(device), self.values().to(device, dtype),
                                          self.shape, layout=self.layout, check_invariants=False)


#: Operators on sparse COO tensors that PyTorch's meta kernels lack ("Could not run 'aten::_coalesce'
#: with arguments from the 'SparseMeta' backend"): a graph's adjacency built by the script.
_SPARSE = {"aten::_coalesce": _coalesce, "aten::mm": _sparse_product, "aten::addmm": _sparse_product,
           "aten::_sparse_addmm": _sparse_product, "aten::_sparse_mm": _sparse_product, "aten::clone": _clone,
           "aten::sparse_mask": _sparse_mask, "aten::add": _add, "aten::add_": _add_}


#: Operators that hand values to the host, called from C++ (``istft``'s checks of its window):
#: the shadows' values, else a made-up one as for ``.item()`` from Python.
_READS = {torch.ops.aten._local_scalar_dense.default: _made_up_scalar,
          torch.ops.aten.equal.default: lambda a, b: a.shape == b.shape and a.dtype == b.dtype}


def _unknown(func) -> str:
    name = func.__name__.split(".")[0]
    return (
        f"aten.{name} makes an output whose shape depends on the values of its input (a boolean mask, nonzero, "
        f"unique), and the simulated GPU knows values only of tensors up to {LIMIT >> 20} MiB computed from known "
        "data; give the output a fixed shape (e.g. torch.where(mask, x, 0) instead of x[mask]) or measure on a GPU"
    )
