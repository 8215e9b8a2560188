"""A simulated CUDA device for machines without one (or to stand in for another GPU).

Inside ``VirtualCUDA(target)`` a training step written for CUDA runs on meta
tensors, which carry shapes and dtypes but no data, so nothing is computed
and any model size fits:

* ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` make meta tensors;
  ``torch.cuda.is_available()`` and friends describe the target GPU, so
  scripts pick the code path they would take there;
* CUDA autocast's policy is applied (``memprof.autocast_policy``), since
  PyTorch's autocast only acts on real CUDA tensors;
* ``scaled_dot_product_attention`` runs the kernel the target would pick
  (flash, memory-efficient or math, by dtype, head size, mask and compute
  capability), so the simulated step saves what that kernel saves;
* optimizers that would default to their ``foreach`` implementation on CUDA
  use it here too (on meta tensors PyTorch falls back to per-tensor loops,
  which allocate different temporaries);
* ``.item()``, ``float()``, ``int()`` of a simulated tensor return 1 and
  ``bool()`` returns False, so logging and simple data-dependent branches run
  (they take the branch those values take).

The ``torch.cuda`` functions are replaced for the duration of the block: on a
CPU-only build there is no CUDA runtime to hook, and a simulation must answer
the script's questions the way the target would. Everything is restored on
exit, exceptions included. Memory is counted by a ``SimulatedAllocator``
(``memprof.simulate``) that the block installs.
"""

from __future__ import annotations

import logging
from types import FunctionType, SimpleNamespace
from contextlib import ExitStack
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from .autocast_policy import AutocastPolicy
from .devices import GPU, get_gpu

__all__ = ["VirtualCUDA", "current", "sdpa_backend"]

log = logging.getLogger(__name__)

_current: "VirtualCUDA | None" = None

_HALF = (torch.float16, torch.bfloat16)


def current() -> "VirtualCUDA | None":
    """The active virtual device, if any."""
    return _current


def sdpa_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    capability: tuple[int, int],
    enable_gqa: bool = False,
) -> str:
    """The attention kernel PyTorch would pick on a GPU of ``capability``.

    The main eligibility checks of aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp, in its priority order (flash, then memory-efficient, then
    math): flash needs fp16/bf16, sm80+, no explicit mask, a head size that is
    a multiple of 8 up to 256; memory-efficient takes fp32 too and a mask,
    with the head size a multiple of 8 (half) or 4 (float), but not grouped
    heads.
    """
    d = q.shape[-1]
    same = q.dtype == k.dtype == v.dtype and k.shape[-1] == d and v.shape[-1] == d
    grouped = enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]
    if same and q.dtype in _HALF and capability >= (8, 0) and attn_mask is None and d % 8 == 0 and d <= 256:
        return "flash"
    if same and not grouped and capability >= (5, 0):
        align = 8 if q.dtype in _HALF else 4
        if d % align == 0 and (q.dtype is not torch.bfloat16 or capability >= (8, 0)):
            return "efficient"
    return "math"


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _Mode(TorchFunctionMode):
    """Device redirection, fake scalars, autocast and SDPA choice, at the torch-function level."""

    def __init__(self, vc: "VirtualCUDA") -> None:
        super().__init__()
        self.vc = vc
        self.autocast = AutocastPolicy("meta")

    def _backward(self, *args, **kwargs):
        return _run_backward(self, *args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "meta"}
        if name == "cuda":
            return torch.Tensor.to(args[0], "meta")
        if name == "to":
            args = tuple("meta" if _is_cuda(a) else a for a in args)
        elif name == "cpu" and args[0].device.type == "meta":
            return args[0]
        elif name in ("item", "__float__", "__int__", "__index__", "__bool__") and _on_meta(args[0]):
            return _fake_scalar(args[0], name)
        elif name == "tolist" and _on_meta(args[0]):
            return torch.ones(args[0].shape, dtype=args[0].dtype).tolist()
        elif name.startswith("_amp_") or name == "_foreach_non_finite_check_and_unscale_":
            return None  # GradScaler's inf checks: in place, no memory, no data to check
        casted = self.autocast(name, args, kwargs)
        if casted is not None:
            args, kwargs = casted
        if name == "scaled_dot_product_attention":
            return self.vc._sdpa(*args, **kwargs)
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        if isinstance(func, FunctionType) and func.__module__ in _PYTHON_FUNCTIONALS and _checks(func):
            # A Python function such as F.multi_head_attention_forward calls
            # more torch functions (linear, scaled_dot_product_attention), and
            # those must meet autocast and the kernel choice too; the mode is
            # off while it handles this call, so run the body with it on.
            with self:
                return _unchecked(func)(*args, **kwargs)
        return func(*args, **kwargs)


_PYTHON_FUNCTIONALS = frozenset({"torch.nn.functional", "torch.functional"})
_unchecked_cache: dict[Callable, Callable] = {}


def _no_torch_function(*args: Any, **kwargs: Any) -> bool:
    return False


def _checks(func: FunctionType) -> bool:
    """Whether ``func`` hands itself to torch-function modes (as F.* functions do)."""
    return any(n in _CHECKS for n in func.__code__.co_names)


_CHECKS = frozenset({"has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"})


def _unchecked(func: FunctionType) -> FunctionType:
    """``func`` without its own has_torch_function check, which would hand it back to the mode."""
    fn = _unchecked_cache.get(func)
    if fn is None:
        scope = dict(func.__globals__)
        for name in _CHECKS:
            scope[name] = _no_torch_function
        fn = FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
        fn.__kwdefaults__ = func.__kwdefaults__
        _unchecked_cache[func] = fn
    return fn


def _run_backward(mode: "_Mode", tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    # A mode is off while it handles a call, but backward may re-run forward
    # code (activation checkpointing) that must see the same device, so the
    # engine runs with the mode on. Both Tensor.backward and
    # torch.autograd.backward would hand the call back to the mode; the
    # engine entry point below is what torch.autograd.backward ends in.
    from torch.autograd import _make_grads
    from torch.autograd.graph import _engine_run_backward

    grads = _make_grads((tensor,), (gradient,), is_grads_batched=False)
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    with mode:
        _engine_run_backward(
            (tensor,), grads, create_graph if retain_graph is None else retain_graph, create_graph, inputs,
            allow_unreachable=True, accumulate_grad=True,
        )


def _on_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _fake_scalar(t: torch.Tensor, name: str) -> Any:
    # One, not zero: a step counter or a norm read back for a division must
    # not divide by zero. Truth tests answer False (no NaN found, no early stop).
    if name == "__bool__" or t.dtype is torch.bool:
        return False
    if name in ("__int__", "__index__") or not t.is_floating_point():
        return 1
    return 1.0


class VirtualCUDA:
    """Run CUDA training code on meta tensors as if on ``target`` (see the module docstring)."""

    def __init__(self, target: str | GPU = "H100-80GB", allocator: Any = None) -> None:
        self.gpu = get_gpu(target)
        self.allocator = allocator
        self._stack: ExitStack | None = None

    # -- the torch.cuda API as the target answers it ---------------------------
    def _cuda_api(self) -> dict[str, Callable]:
        gpu, alloc = self.gpu, self.allocator
        props = SimpleNamespace(
            name=gpu.name,
            total_memory=gpu.memory_bytes,
            major=gpu.compute_capability[0],
            minor=gpu.compute_capability[1],
            multi_processor_count=132,
            is_integrated=False,
        )
        api: dict[str, Callable] = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "_lazy_init": lambda: None,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "get_device_name": lambda device=None: gpu.name,
            "get_device_capability": lambda device=None: gpu.compute_capability,
            "get_device_properties": lambda device=None: props,
            "is_bf16_supported": lambda including_emulation=True: gpu.bf16,
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "seed": lambda: None,
            "initial_seed": lambda: 0,
            "get_rng_state": lambda device=None: torch.zeros(16, dtype=torch.uint8, device="cpu"),
            "set_rng_state": lambda state, device=None: None,
            "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8, device="cpu")],
            "set_rng_state_all": lambda states: None,
            "device": _NoDevice,
            "empty_cache": lambda: alloc.empty_cache() if alloc else None,
        }
        if alloc is not None:
            api.update(
                memory_allocated=lambda device=None: alloc.read().allocated,
                max_memory_allocated=lambda device=None: alloc.read().peak_allocated,
                memory_reserved=lambda device=None: alloc.read().reserved,
                max_memory_reserved=lambda device=None: alloc.read().peak_reserved,
                reset_peak_memory_stats=lambda device=None: alloc.reset_peak(),
                mem_get_info=lambda device=None: (gpu.memory_bytes - alloc.read().reserved, gpu.memory_bytes),
            )
        return api

    def __enter__(self) -> "VirtualCUDA":
        global _current
        if _current is not None:
            raise RuntimeError("a simulated CUDA device is already active; simulations cannot be nested")
        stack = ExitStack()
        try:
            for attr, fn in self._cuda_api().items():
                stack.enter_context(_replace(torch.cuda, attr, fn))
            # Activation checkpointing restores the autocast state and RNG of
            # its inputs' device for recomputation: that device is CUDA here.
            import torch.utils.checkpoint as ckpt

            infer = getattr(ckpt, "_infer_device_type", None)
            if infer is not None:
                stack.enter_context(
                    _replace(ckpt, "_infer_device_type", lambda *a: "cuda" if infer(*a) == "meta" else infer(*a))
                )
            accelerator = getattr(torch, "accelerator", None)
            if accelerator is not None:  # torch >= 2.6 asks it, e.g. in the optimizer's graph-capture check
                for attr, fn in _ACCELERATOR_API.items():
                    if hasattr(accelerator, attr):
                        stack.enter_context(_replace(accelerator, attr, fn))
            stack.callback(register_optimizer_step_pre_hook(_prefer_foreach).remove)
            if self.allocator is not None:
                stack.enter_context(self.allocator)
            mode = _Mode(self)
            clear = torch.clear_autocast_cache

            def clear_autocast_cache() -> None:  # autocast calls it as its outermost region ends
                clear()
                mode.autocast.clear()

            stack.enter_context(_replace(torch, "clear_autocast_cache", clear_autocast_cache))
            stack.enter_context(mode)
            _current = self
            stack.callback(_clear_current)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    # -- kernels the target would pick ----------------------------------------
    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = sdpa_backend(query, key, value, attn_mask, self.gpu.compute_capability, enable_gqa)
        ops = torch.ops.aten
        if backend == "flash":
            if enable_gqa and key.shape[-3] != query.shape[-3]:  # flash reads grouped heads in place
                rep = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
            return ops._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if backend == "efficient":
            need_lse = query.requires_grad or key.requires_grad or value.requires_grad
            return ops._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, need_lse, dropout_p, is_causal, scale=scale
            )[0]
        return ops._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]


class _NoDevice:
    """``torch.cuda.device(i)``: one simulated device, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Stream:
    """The default stream of the simulated device: never capturing a graph."""

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


_ACCELERATOR_API: dict[str, Callable] = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device_index": lambda: 0,
    "current_stream": lambda device=None: _Stream(),
    "synchronize": lambda device=None: None,
}


def _prefer_foreach(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    # torch.optim picks foreach for CUDA tensors when neither foreach nor fused
    # is set (_default_to_fused_or_foreach); on meta tensors it would not.
    for group in opt.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def _clear_current() -> None:
    global _current
    _current = None


class _replace:
    """Set ``obj.attr`` for the duration of a with block."""

    def __init__(self, obj: Any, attr: str, value: Any) -> None:
        self.obj, self.attr, self.value = obj, attr, value

    def __enter__(self) -> None:
        self.had = hasattr(self.obj, self.attr)
        self.old = getattr(self.obj, self.attr, None)
        setattr(self.obj, self.attr, self.value)

    def __exit__(self, *exc: object) -> None:
        if self.had:
            setattr(self.obj, self.attr, self.old)
        else:
            delattr(self.obj, self.attr)
