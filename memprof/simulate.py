"""``memprof.simulate``: predict a training step's memory on a GPU you don't have.

The step runs on a simulated CUDA device (``memprof.virtual_cuda``): meta
tensors with the target's autocast, attention kernels and optimizer
implementations. A ``SimulatedAllocator`` sees every operator's outputs below
autograd, so it sees what the GPU's allocator would be asked for, in order,
and replays those requests through a model of PyTorch's caching allocator
(``memprof.caching``) for allocated and reserved bytes. ``memprof.track``
reads these counters as it reads CUDA's, so a simulation produces the same
``Report`` as a measurement: same categories, same module rows.

What a simulation cannot know: values. ``.item()`` returns 1 and ``bool()``
False, so data-dependent control flow takes the branch those take, and operators
whose output shape depends on data (``nonzero``, ``unique``, boolean
indexing) cannot run on meta tensors.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .allocator import Counters, cublas_workspace_bytes
from .aten_args import PYTORCH_NAMESPACES, decomposes, tensors
from .caching import (CachingAllocatorModel, SimulatedOOM, allocator_settings, expandable_segments_setting,
                      max_split_settings, unmodelled_settings)
from .cuda_api import current_stream_id
from .cudnn import CONVOLUTIONS, cudnn_layout, tf32_allowed
from .devices import GPU, get_gpu
from .meta_kernels import PLAIN_TENSORS, KernelCache
from .reductions import REDUCTIONS, staging_bytes
from .report import Report
from .kernel_copies import kernel_copies, takes_copies
from .tracker import track
from .virtual_cuda import VirtualCUDA

__all__ = ["SimulatedAllocator", "StepCounters", "TimeModel", "kept_blocks", "simulate", "replay_step", "usable_bytes"]

log = logging.getLogger(__name__)

# Device memory outside PyTorch's allocator: CUDA context, cuBLAS and NCCL
# handles. Measured on an H200 with torch 2.11 (NVML used - reserved):
# 1.33-1.35 GiB (benchmarks/results/attribution.json).
NON_PYTORCH_BYTES = 1_450_000_000


def usable_bytes(gpu: GPU) -> int:
    """The device memory PyTorch's allocator can reserve on ``gpu``: its memory less what lies outside PyTorch."""
    return gpu.memory_bytes - NON_PYTORCH_BYTES

_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addmv", "mv", "_addmm_activation",
               # torchvision's deformable convolution multiplies its im2col columns by the weight with
               # addmm_ (torchvision/csrc/ops/cuda/deform_conv2d_kernel.cu), in forward and in backward.
               "deform_conv2d", "_deform_conv2d_backward"}
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class TimeModel:
    """Step time as two clocks, the host's and the device's.

    The host issues every operator of the step, one after another, and each
    costs it a fixed time (Python, autograd and PyTorch's eager dispatch, the
    kernel's launch): ``host_forward`` where Python code drives the operators
    (the model's forward, the optimizer's step), ``host_backward`` where
    autograd's engine does (C++, no Python in between), ``host_convolution``
    for a convolution (cuDNN picks and builds a plan per call). Activation
    checkpointing's recomputation runs the forward's Python code again inside
    the engine: a recomputed operator costs ``host_forward`` plus
    ``host_recompute``. A script's saved-tensors hooks run Python per saved
    tensor (checkpointing's pack in forward, its pack again in the
    recomputation, its unpack): ``host_hook`` a call. The device runs each kernel once it is issued and the
    previous kernel is done: its roofline, the larger of its arithmetic at the
    dtype's rate and its bytes (inputs read once, outputs written once) at
    memory bandwidth, each at the share of the datasheet its kind of kernel
    reaches (:func:`_kernel_kind`), plus a fixed gap per kernel
    (``per_kernel``). A copy between
    host and device runs in stream order at the link's achieved rate; one
    that the host waits for (``SimulatedAllocator.transfer(synchronize=True)``)
    brings the two clocks together. A step ends when both are done (``verify`` times
    steps between synchronisations, ``memprof.track`` between CUDA events at
    a profiled step's ends: the device's span of it). So a step of large
    kernels costs their rooflines, and a step of small ones (small
    micro-batches, recomputation) costs what the host needs to issue them.

    The shares are measured kernel by kernel: 18 steps of 6 workloads
    profiled on an H200, each kind's time against its work
    (benchmarks/kernel_time.py); a 16-bit matrix product reaches 0.87 of
    the tensor-core rate, one with a dimension that is not a multiple of
    16 bytes 0.14 of it. The host's constants, ``per_kernel`` and the link's
    share are fitted to 114 steps of 5 workloads measured on an H200 over
    two days (median |error| 2.9 %) and checked on 100 steps of 5 other
    workloads they never saw (6.0 %, 82 within 15 %):
    benchmarks/results/step-time.md. The worst errors
    (50-65 %) are host-bound steps, whose measurement itself moves by up to
    2x between days. Copies reach ``link_efficiency`` of
    the link's nominal rate."""

    #: Shares of the datasheet a kernel reaches, by kind (:func:`_kernel_kind`):
    #: a matrix product on 16-bit tensor cores, on TF32 ones, in fp32 (no
    #: tensor cores), a convolution (cuDNN, NCHW), a fused attention kernel
    #: (flash, memory-efficient, cuDNN), each of its arithmetic rate;
    #: a product on tensor cores with a leading dimension that is not a multiple
    #: of 16 bytes, of the 16-bit rate whatever its precision (cuBLAS's kernels for
    #: such rows run at about the same rate in TF32 and bf16), twice that for a
    #: 16-bit product whose leading dimensions are all even (4-byte aligned:
    #: benchmarks/matmul_alignment.py, 72 products of each on an H200); an elementwise
    #: kernel, PyTorch's own batch norm (where cuDNN's is not used) and any other
    #: kernel (reductions, normalisations, softmax, gathers, scatters) of the
    #: memory bandwidth.
    flop_efficiency: float = 0.873
    tf32_flop_efficiency: float = 0.710
    fp32_flop_efficiency: float = 0.746
    misaligned_flop_efficiency: float = 0.126
    misaligned_even_flop_efficiency: float = 0.260
    convolution_flop_efficiency: float = 0.205
    attention_flop_efficiency: float = 0.480
    bandwidth_efficiency: float = 0.429
    streaming_bandwidth_efficiency: float = 0.730
    native_batch_norm_bandwidth_efficiency: float = 0.103
    per_kernel: float = 9.9e-6
    host_forward: float = 14.0e-6
    host_backward: float = 23.2e-6
    host_convolution: float = 94e-6
    host_recompute: float = 9.4e-6
    #: The share of the link's nominal rate a copy between the device and
    #: pinned host memory reaches (PCIe's packet and protocol overhead).
    link_efficiency: float = 0.82
    #: A call of a script's saved-tensors hook (Python, per saved tensor):
    #: activation checkpointing's pack in forward, its pack in the
    #: recomputation and its unpack (torch.utils.checkpoint's
    #: ``_checkpoint_hook`` and ``_recomputation_hook``), a compressing hook's.
    host_hook: float = 13.9e-6

    def host_seconds(self, convolution: bool, backward: bool, recompute: bool = False) -> float:
        """The host's time to issue one operator: ``backward`` when autograd's
        engine issues it, ``recompute`` when the engine runs forward code again
        (grad mode on inside backward: activation checkpointing)."""
        if convolution:
            seconds = self.host_convolution
        elif backward and not recompute:
            seconds = self.host_backward
        else:
            seconds = self.host_forward
        if recompute:
            seconds += self.host_recompute
        return seconds

    def seconds(self, gpu: GPU, flops: int, nbytes: int, dtype: torch.dtype | None, tf32: bool = False,
                kind: int = 0) -> float:
        """One kernel's device time; ``kind`` as :func:`_kernel_kind` gives it."""
        half = gpu.bf16_tflops or gpu.fp16_tflops or gpu.fp32_tflops
        tensor_cores = True
        if dtype in _HALF:
            rate, flop_efficiency = half, self.flop_efficiency
        elif dtype is not None and dtype.is_floating_point and dtype.itemsize == 1:
            # FP8 (torch._scaled_mm): dense FP8 tensor cores run at twice the 16-bit rate on Ada,
            # Hopper and Blackwell (H100 SXM: 1979 against 989 TFLOPS, NVIDIA's datasheet)
            rate, flop_efficiency = 2 * half, self.flop_efficiency
        elif tf32 and gpu.compute_capability >= (8, 0):
            # TF32 where PyTorch allows it: cuDNN's convolutions by default
            # (torch.backends.cudnn.allow_tf32), cuBLAS's matrix products when a
            # script asks (torch.backends.cuda.matmul.allow_tf32 or its fp32_precision,
            # set_float32_matmul_precision("high")); the TF32 tensor-core rate is
            # half the 16-bit one where the GPU gives none.
            rate, flop_efficiency = gpu.tf32_tflops or half / 2, self.tf32_flop_efficiency
        else:
            rate, flop_efficiency, tensor_cores = gpu.fp32_tflops, self.fp32_flop_efficiency, False
        if kind == CONVOLUTION:
            flop_efficiency = self.convolution_flop_efficiency
        elif kind == ATTENTION:
            flop_efficiency = self.attention_flop_efficiency
        elif kind == MISALIGNED and tensor_cores:
            rate, flop_efficiency = half, self.misaligned_flop_efficiency
        elif kind == MISALIGNED_EVEN and tensor_cores:
            rate, flop_efficiency = half, self.misaligned_even_flop_efficiency
        compute = flops / (rate * 1e12 * flop_efficiency) if flops else 0.0
        efficiency = self.bandwidth_efficiency
        if kind == STREAMING:
            efficiency = self.streaming_bandwidth_efficiency
        elif kind == NATIVE_BATCH_NORM:
            efficiency = self.native_batch_norm_bandwidth_efficiency
        memory = nbytes / (gpu.memory_bandwidth * efficiency)
        return max(compute, memory) + self.per_kernel


# Operators that launch no kernel: metadata only.
_NO_KERNEL = {"detach", "alias", "view", "_unsafe_view", "empty", "empty_strided", "empty_like", "lift_fresh", "_to_copy_meta"}


class SimulatedAllocator(TorchDispatchMode):
    """Counts the device memory a step on meta tensors would take on the target GPU."""

    available = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless told
        # otherwise (utils/_python_dispatch.py), a few microseconds on every operator of
        # every simulated step. Nothing compiles under the simulation (VirtualCUDA runs
        # torch.compile eagerly), so there is nothing to keep Dynamo out of.
        return False

    def __init__(self, gpu: GPU, capacity: int | None = None, time_model: TimeModel | None = None) -> None:
        super().__init__()
        self.gpu = gpu
        self.model = CachingAllocatorModel(capacity)
        self.time_model = time_model or TimeModel()
        #: The host's and the device's clocks (simulated seconds; see TimeModel).
        self.host = self.device = 0.0
        #: The seconds the device spent running kernels and copies: less than
        #: the step's where it waited for the host (a host-bound step).
        self.busy = 0.0
        #: What the device's work is made of.
        self.flops = 0
        self.bytes_moved = 0
        self.kernels = 0
        #: When a list, every device operator's (flops, bytes, precision: 2 half, 1 tf32, 0 fp32,
        #: -1 for an operator that launches no kernel, -2 for a host-device transfer, -3 for one
        #: the host waits for, -4 for a script's saved-tensors hook; is a convolution; runs in
        #: backward; is recomputed (grad mode on in backward); the operators the host issues for it: 1, more for a transfer; the kernel's kind,
        #: :func:`_kernel_kind`) is appended.
        self.trace: list[tuple[int, int, int, bool, bool, bool, int, int]] | None = None
        #: When a list, allocation and time events are appended: ``("m", handle,
        #: bytes, stream)``, ``("f", handle)``, ``("h", handle)`` (freed, held for
        #: another stream), ``("k", seconds, handles, host seconds)`` for a kernel
        #: (its device time, the handles of the outputs it allocated, the host's
        #: time to issue it), ``("o", host seconds)`` for an operator
        #: without a kernel, ``("t", seconds, host seconds, synchronize)`` for a
        #: transfer and ``("c", seconds, busy seconds)`` for time charged to both
        #: clocks (:meth:`charge`; see :func:`replay_step`).
        self.events: list[tuple] | None = None
        self._handles: dict[weakref.ref, int] = {}
        # A storage's weakref callback frees its block. The cyclic garbage collector runs at
        # any allocation of a Python object, the allocator model's own included, so a block
        # held only by a reference cycle can be freed in the middle of another malloc or
        # free: such frees wait here until the model's operation is done.
        self._in_model = False
        self._deferred: list[int] = []
        # A script's own threads (a prefetcher moving batches to the GPU) allocate too: one model
        # operation at a time, as CUDA's caching allocator takes its mutex.
        self._lock = threading.RLock()
        # Blocks a stream other than their own used (Tensor.record_stream), and those of them freed
        # while that stream's work queued so far was not done: (the device's time it is, handle).
        self._stream_uses: set[int] = set()
        self._pending: list[tuple[float, int]] = []
        #: cuBLAS's workspaces taken so far, by thread (autograd's: True, or the training thread's) and stream.
        self._workspaces: dict[tuple[bool, int], int] = {}
        self._cublas_bytes: int | None = None  # read at the first workspace, as PyTorch reads it
        self._cublas_deterministic: bool | None = None  # likewise, at the first product in deterministic mode
        # Peaks (allocated, reserved) folded in before memprof's own resets.
        self._kept = (0, 0)
        #: The script's own meta tensors, not the GPU's (``virtual_cuda.MetaTensors``), where told apart.
        self.script_meta = None
        # Whether the allocator's settings were read (at the first allocation, as PyTorch reads them).
        self._configured = False
        #: Where to say what runs differently here (``VirtualCUDA._note``: what, why), once a device is.
        self.note: Callable[[str, str], None] | None = None

    @property
    def seconds(self) -> float:
        """Simulated time: when both the host and the device are done."""
        return max(self.host, self.device)

    def charge(self, seconds: float, busy: float) -> None:
        """Time charged to the step as a whole (repeated micro-batches): both
        clocks move by ``seconds``, of which the device ran for ``busy``."""
        self.host += seconds
        self.device += seconds
        self.busy += busy
        if self.events is not None:
            self.events.append(("c", seconds, busy))

    def clock(self) -> float:
        """Simulated time, after a synchronisation: memprof.track times steps with it."""
        self.host = self.device = self.seconds
        return self.host

    def mark(self) -> tuple[float, float]:
        """A step's start for :meth:`since`: the clock (synchronised) and the busy seconds so far."""
        return self.clock(), self.busy

    def since(self, mark: tuple[float, float]) -> "StepCounters":
        """The peaks since the last reset; the seconds and the device's busy seconds since ``mark``."""
        return StepCounters(self.model.peak_allocated, self.model.peak_reserved, self.clock() - mark[0],
                            self.busy - mark[1])

    def transfer(self, nbytes: int, bandwidth: float, synchronize: bool = False, host_ops: int = 1) -> None:
        """A copy between host and device of ``nbytes`` at ``bandwidth`` bytes/s.

        The host issues it as ``host_ops`` operators (``copy_``, and the
        ``empty`` of its destination where the caller makes one) at the time
        model's cost for the phase; the device runs it in stream order after
        the kernels before it. With ``synchronize`` the host then waits until
        it is done, as for a copy to host memory without ``non_blocking``
        (``copy_`` ends in a stream synchronisation: aten's
        ``memcpy_and_sync``), so the device idles until the host issues more.
        """
        backward = torch._C._current_graph_task_id() != -1
        recompute = backward and torch.is_grad_enabled()
        host = host_ops * self.time_model.host_seconds(False, backward, recompute)
        seconds = nbytes / (bandwidth * self.time_model.link_efficiency)
        self.host += host
        self.device = max(self.device, self.host) + seconds
        self.busy += seconds
        if synchronize:
            self.host = self.device
        if self.events is not None:
            self.events.append(("t", seconds, host, synchronize))
        if self.trace is not None:
            self.trace.append((0, nbytes, -3 if synchronize else -2, False, backward, recompute, host_ops, 0))

    def hook_call(self) -> None:
        """The host runs a script's saved-tensors hook (Python): ``TimeModel.host_hook``, no kernel."""
        host = self.time_model.host_hook
        self.host += host
        if self.events is not None:
            self.events.append(("o", host))
        if self.trace is not None:
            backward = torch._C._current_graph_task_id() != -1
            self.trace.append((0, 0, -4, False, backward, backward and torch.is_grad_enabled(), 1, 0))

    def synchronize(self, nbytes: int = 0) -> None:
        """The host waits for the device: a value read back (``.item()``, ``bool()``, ``.cpu()``:
        ``nbytes`` copied, then the stream synchronised), an operator whose output size CUDA
        reads back (``nonzero``, ``x[mask]``), ``torch.cuda.synchronize()``. Until the device
        is done the host issues nothing, so the work before and after no longer overlaps."""
        self.transfer(nbytes, self.gpu.pcie_bandwidth, synchronize=True)

    # -- the counters memprof.track reads --------------------------------------
    def read(self) -> Counters:
        m = self.model
        return Counters(m.allocated, m.reserved, m.peak_allocated, m.peak_reserved)

    def read_and_reset(self) -> Counters:
        c = self.read()
        self.reset_peak()
        return c

    def reset_peak(self) -> None:
        """Reset the peaks for memprof, keeping what the script would read (see allocator.py)."""
        m = self.model
        self._kept = (max(self._kept[0], m.peak_allocated), max(self._kept[1], m.peak_reserved))
        m.reset_peak()

    def user_read(self) -> Counters:
        """The counters as the script reads them: peaks since its own last reset."""
        m = self.model
        return Counters(m.allocated, m.reserved, max(self._kept[0], m.peak_allocated), max(self._kept[1], m.peak_reserved))

    def user_reset_peak(self) -> None:
        self._kept = (0, 0)
        self.model.reset_peak()

    def user_view(self) -> nullcontext:
        # The simulated device's torch.cuda answers from user_read already.
        return nullcontext()

    def nvml_used(self) -> int:
        return self.model.reserved + NON_PYTORCH_BYTES

    def workspaces(self, known: Callable[[], set[int]]) -> int:
        """cuBLAS's workspaces: one per thread and stream that has run a matrix product."""
        return len(self._workspaces) * self._cublas_workspace_size()

    def _alert_cublas_not_deterministic(self) -> None:
        """``Context::alertCuBLASConfigNotDeterministic`` (aten/src/ATen/Context.cpp), which cuBLAS's
        products call: in deterministic mode with CUBLAS_WORKSPACE_CONFIG other than ``:4096:8`` or
        ``:16:8`` (read once, at the first), PyTorch's error, or its warning with ``warn_only=True``."""
        if self._cublas_deterministic is None:
            self._cublas_deterministic = os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")
        if self._cublas_deterministic:
            return
        msg = ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
               "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because "
               "it uses CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must "
               "set an environment variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 "
               "or CUBLAS_WORKSPACE_CONFIG=:16:8. For more information, go to "
               "https://docs.nvidia.com/cuda/cublas/index.html#results-reproducibility")
        if torch.is_deterministic_algorithms_warn_only_enabled():
            warnings.warn(msg)
        else:
            raise RuntimeError(msg)

    def _cublas_workspace_size(self) -> int:
        """Each cuBLAS workspace's bytes on the target: ``CUBLAS_WORKSPACE_CONFIG`` as the script's
        environment has it when the first is taken (getChosenWorkspaceSize), else the GPU's default."""
        if self._cublas_bytes is None:
            self._cublas_bytes = cublas_workspace_bytes(self.gpu.compute_capability,
                                                        os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return self._cublas_bytes

    def empty_cache(self) -> None:
        self._process_events(everything=True)
        self._model_call(self.model.empty_cache)

    def rewind(self, saved: CachingAllocatorModel) -> bool:
        """Put the allocator back in the state ``saved`` (a copy of :attr:`model`
        taken earlier), when every block live now was live then, save
        cuBLAS's workspaces, which a new process has only after its threads'
        first matrix products. Returns whether it could."""
        later = {h for h in self._workspaces.values() if h not in saved._handles}
        if set(self.model._handles) - later != set(saved._handles):
            return False
        self._workspaces = {k: h for k, h in self._workspaces.items() if h not in later}
        self.model = copy.deepcopy(saved)
        return True

    def replay(self, events: list[tuple]) -> list[int]:
        """Do again what ``events`` (a slice of :attr:`events` that frees only
        blocks it made) did: the same requests on the allocator model as it
        stands now, the same time on the clocks, recorded again where events
        are recorded. No tensor is made: returns the handles of the blocks
        left allocated, for the caller to free."""
        handles: dict[int, int] = {}
        for e in events:
            kind = e[0]
            if kind == "m":
                handles[e[1]] = self._malloc(e[2], e[3])
                continue
            if kind == "f":
                self.free(handles.pop(e[1]))
                continue
            if kind == "h":
                self._model_call(self.model.hold, handles[e[1]], event=lambda _, h=handles[e[1]]: ("h", h))
                continue
            if kind == "c":  # as charge() charges it
                self.host += e[1]
                self.device += e[1]
                self.busy += e[2]
            else:
                self.host, self.device = _tick(self.host, self.device, e)
                self.busy += _busy(e)
                if kind == "k":
                    e = ("k", e[1], [handles[h] for h in e[2]], e[3])
            if self.events is not None:
                self.events.append(e)
        return list(handles.values())

    # -- allocation events -----------------------------------------------------
    def adopt(self, tensors) -> None:
        """Count tensors that exist already (made before the simulation began)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_meta:
                for storage in _storages(t):
                    self._allocate(storage)

    def _model_call(self, op: Callable, *args, event: Callable[[Any], tuple] | None = None):
        """``op(*args)`` on the allocator model, its ``event(result)`` recorded where events
        are, and then the frees a garbage collection asked for meanwhile (see ``_deferred``)."""
        with self._lock:
            self._in_model = True
            try:
                result = op(*args)
            finally:
                self._in_model = False
            if event is not None and self.events is not None:
                self.events.append(event(result))
            while self._deferred:
                self.free(self._deferred.pop(0))
            return result

    def replay_step(self, events: list[tuple]) -> StepCounters | None:
        """:func:`replay_step` on this allocator's model."""
        return self._model_call(replay_step, self.model, events)

    def _malloc(self, nbytes: int, stream: int | None = None) -> int:
        """A block of ``nbytes`` for ``stream`` (default: this thread's current stream)."""
        if not self._configured:
            # PyTorch reads its allocator's settings at CUDA's first use, after a script's own
            # first lines (os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ...) have run.
            self.set_allocator_settings(*allocator_settings())
        if stream is None:
            stream = current_stream_id()
        if self._pending:
            self._process_events()
        def malloc() -> int:
            return self._model_call(self.model.malloc, nbytes, stream, event=lambda h: ("m", h, nbytes, stream))

        try:
            return malloc()
        except SimulatedOOM:
            if not self._pending:
                raise
            # release_cached_blocks waits for every stream first (synchronize_and_free_events)
            self._process_events(everything=True)
            return malloc()

    def record_stream(self, t: torch.Tensor, stream: int) -> None:
        """``t.record_stream(stream)``: where ``stream`` is not the one its block was allocated on, the
        block goes back to the cache, once freed, only when the work queued on ``stream`` by then is done."""
        handle = self.handle(t)
        if handle is not None and stream != self.model.stream_of(handle):
            self._stream_uses.add(handle)

    def _process_events(self, everything: bool = False) -> None:
        """``process_events``, at each malloc: the blocks freed while another stream used them go back
        to the cache once the device has run what was queued before their free (its clock then <= the
        host's now); all of them with ``everything`` (``synchronize_and_free_events``)."""
        done = [h for at, h in self._pending if everything or at <= self.host]
        self._pending = [(at, h) for at, h in self._pending if not (everything or at <= self.host)]
        for h in done:
            self.free(h)

    def set_allocator_settings(self, settings: str, name: str = "_set_allocator_settings") -> None:
        """``torch.cuda.memory._set_allocator_settings``: ``expandable_segments`` switched for the
        segments made from now on, where ``settings`` names it; settings the model does not follow
        are noted (:attr:`note`)."""
        expandable = expandable_segments_setting(settings, name)
        self._configured = True
        if expandable is not None:
            self.model.expandable_segments = expandable
        split, rounding = max_split_settings(settings, name)
        if split is not None:
            self.model.max_split_size = split
        if rounding is not None:
            self.model.max_non_split_rounding = rounding
        unmodelled = unmodelled_settings(settings)
        if unmodelled and self.note is not None:
            self.note("allocator settings", f"{', '.join(unmodelled)} ({name}) not modelled: reserved memory as "
                      "PyTorch's allocator reserves it without them")

    def free(self, handle: int) -> None:
        """Free the allocator model's block ``handle`` (one no tensor holds: a replayed
        step's, a kernel's transient block), recorded where events are recorded."""
        if self._in_model:
            self._deferred.append(handle)
        else:
            self._model_call(self.model.free, handle, event=lambda _: ("f", handle))

    def handle(self, t: torch.Tensor) -> int | None:
        """The allocator model's handle of the block holding ``t``, if the simulation made it."""
        return self._handles.get(weakref.ref(t.untyped_storage()))

    def kernel_event(self, func, args: tuple, backward: bool) -> tuple:
        """The ``("k", ...)`` event an in-place ``func(*args)`` (no output of its own) run by the
        host's Python code, or by autograd's engine with ``backward``, would record here, as
        :meth:`__torch_dispatch__` prices it, without running it."""
        flops, nbytes, dtype, conv, _, kind = _cost(func, args, {}, args[0])
        seconds = self.time_model.seconds(self.gpu, flops, nbytes, dtype, False, kind)
        return ("k", seconds, [], self.time_model.host_seconds(conv, backward))

    def _allocate(self, storage: torch.UntypedStorage) -> int | None:
        key = weakref.ref(storage)
        if key in self._handles:
            return None
        handle = self._malloc(storage.nbytes())
        self._handles[weakref.ref(storage, self._free)] = handle
        return handle

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place (``UntypedStorage.resize_``, which no dispatch mode
        sees): its block is freed, and one of its new size taken unless that is zero. FSDP2
        frees a layer's gathered parameters so after use and makes them again for the next
        all-gather (``torch.distributed.fsdp``'s ``free_storage``, ``alloc_storage``)."""
        self._free(weakref.ref(storage))
        if storage.nbytes():
            self._allocate(storage)

    def _transient(self, pieces: list[tuple[int, ...]], held: tuple[int, ...] = ()) -> None:
        """Blocks a kernel takes and gives back within its run: the ``held`` blocks around all
        of it (a reduction's accumulation buffer, a convolution's copies of its operands), and
        the blocks of each piece in turn (a reduction's staging buffer and semaphores, each
        cuDNN call's copies and workspace)."""
        around = [self._malloc(n) for n in held if n]
        for piece in pieces:
            handles = [self._malloc(n) for n in piece if n]
            for h in reversed(handles):
                self.free(h)
        for h in reversed(around):
            self.free(h)

    def _free(self, key: weakref.ref) -> None:
        handle = self._handles.pop(key, None)
        if handle in self._stream_uses:  # insert_events: an event on the stream that used it, at the free
            self._stream_uses.discard(handle)
            self._model_call(self.model.hold, handle, event=lambda _: ("h", handle))
            self._pending.append((self.device, handle))
        elif handle is not None:
            self.free(handle)

    #: Higher-order operators (flex attention) come to this mode too (see _higher_order).
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        if types and decomposes(types):  # a DTensor's own operators come back here one by one
            return NotImplemented
        if func._overloadpacket in _NO_HALF:
            _no_half(func, args)
        if func._overloadpacket in _SCALED_MM and self.gpu.compute_capability < (8, 9):
            # ATen's check (Blas.cpp, _scaled_mm_allowed_device): FP8 tensor cores from Ada and Hopper on
            raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
                               f"8.9, or ROCm MI300+ (simulated {self.gpu.name}: {self.gpu.compute_capability})")
        if func.namespace not in PYTORCH_NAMESPACES:
            implementation = _without_fake(func)
            if implementation is not None:  # its own operators, on this device
                if self.note is not None:
                    self.note(f"{func.name()} (a custom operator)", "registered without a fake implementation to "
                              "size its outputs: simulated by running its implementation's operators")
                with self:
                    return implementation(*args, **kwargs)
            if self.note is not None and not takes_copies(func) and (
                    _maybe_opdef(func) is not None or func.namespace in _LIBRARIES and any(True for _ in tensors(args))):
                # A library's kernels registered in C++ (torchvision's) are sized the same way; those
                # whose own blocks memprof.kernel_copies knows need no note.
                what = "a custom operator" if func.namespace not in _LIBRARIES else f"a {func.namespace} operator"
                self.note(f"{func.name()} ({what})", "sized by its fake implementation: its outputs "
                          "and what autograd saves of them are counted, its kernel's own scratch memory is not")
        out, cost = KERNELS.run(func, args, kwargs, _cost)
        own = self.script_meta
        if own is not None and own.claims(args, kwargs):  # the script's own meta tensors: no GPU memory, no kernel
            own.add(s for t in tensors(out) if t.is_meta for s in _storages(t))
            return out
        cudnn = None
        if func in CONVOLUTIONS and args[1].is_meta:
            out, *cudnn = cudnn_layout(func, args, out)
        backward = torch._C._current_graph_task_id() != -1  # autograd's engine is running
        matmul = func.__name__.split(".")[0] in _MATMUL_OPS or _nested_linear(func, args)
        if matmul and torch.are_deterministic_algorithms_enabled():
            self._alert_cublas_not_deterministic()
        if matmul and (key := (backward, current_stream_id())) not in self._workspaces:
            # PyTorch keeps a cuBLAS workspace per handle and stream, and a handle per thread
            # (aten/src/ATen/cuda/CublasHandlePool.cpp): the training thread's, and on a GPU
            # autograd's device thread's, which runs backward's kernels, each on every stream it
            # ran one on (a side stream's warm-up, a graph's capture). Each is taken at the
            # pair's first matrix product and kept for the process's life.
            self._workspaces[key] = self._malloc(self._cublas_workspace_size())
        made = [self._allocate(s) for t in tensors(out) if t.is_meta for s in _storages(t)]
        if func in REDUCTIONS and isinstance(out, torch.Tensor) and out.is_meta:
            staging = staging_bytes(func, args, out, self.gpu)
            self._transient(staging.pieces, (staging.accumulation,))
        if cudnn:  # the copies held for the call, and each cuDNN call's blocks in turn
            held, calls = cudnn
            self._transient(calls, held)
        if takes_copies(func) and args[0].is_meta:
            self._transient(kernel_copies(func, args))
        if cost is None:  # the host's own work (a data pipeline): no simulated time
            return out
        uploaded = _uploaded(func, args, kwargs)
        if uploaded is not None:  # from the host: over the link, not a kernel
            self.transfer(uploaded[0], self.gpu.pcie_bandwidth, synchronize=not uploaded[1])
            return out
        flops, nbytes, dtype, conv, kernel, kind = cost
        # The engine runs with grad mode off; checkpointing's recomputation turns it on to
        # record the block's forward again (so does a double backward, create_graph=True,
        # which is charged as recomputation too).
        recompute = backward and torch.is_grad_enabled()
        host = self.time_model.host_seconds(conv, backward, recompute)
        self.host += host
        if not kernel:
            if self.events is not None:
                self.events.append(("o", host))
            if self.trace is not None:
                self.trace.append((0, 0, -1, conv, backward, recompute, 1, 0))
            return out
        tf32 = tf32_allowed(conv=True) if conv else matmul and tf32_allowed(conv=False)
        self._launch(flops, nbytes, dtype, tf32, conv, kind, [h for h in made if h is not None], host)
        return out

    def _launch(self, flops: int, nbytes: int, dtype: torch.dtype | None, tf32: bool, conv: bool, kind: int,
                made: list[int], host: float) -> None:
        """A kernel the host issued (for ``host`` seconds): the device runs it once issued and free."""
        backward = torch._C._current_graph_task_id() != -1
        seconds = self.time_model.seconds(self.gpu, flops, nbytes, dtype, tf32, kind)
        self.device = max(self.device, self.host) + seconds
        self.busy += seconds
        if self.events is not None:
            self.events.append(("k", seconds, made, host))
        self.flops += flops
        self.bytes_moved += nbytes
        self.kernels += 1
        if self.trace is not None:
            self.trace.append((flops, nbytes, 2 if dtype in _HALF else (1 if tf32 else 0), conv, backward,
                               backward and torch.is_grad_enabled(), 1, kind))

    def _higher_order(self, func, args: tuple, kwargs: dict) -> Any:
        """A higher-order operator (flex attention's, forward and backward): the outputs of its
        fused kernel, as the fake implementation PyTorch registers for it makes them (on a GPU it
        runs compiled: torch.compile's Triton kernel, which keeps no scores), and its time as an
        attention kernel's, every query against every key (its block mask's sparsity unknown)."""
        from torch._higher_order_ops import utils

        fake = getattr(utils, "registered_hop_fake_fns", {}).get(func)
        if fake is None:
            raise NotImplementedError(
                f"{func.name()} (a higher-order operator) has no fake implementation to size its outputs with: "
                "memprof cannot simulate it; measure on a GPU")
        with self:
            out = fake(*args, **kwargs)
        q, v = args[0], args[2]
        # FlashAttention-2's count: 2 products forward; backward 2.5 times the forward's.
        flops = 4 * q.shape[0] * q.shape[1] * q.shape[2] * v.shape[2] * q.shape[3]
        if "backward" in func.name():
            flops = flops * 5 // 2
        nbytes = sum(t.numel() * t.element_size() for t in (*tensors(args[:7]), *tensors(out)))
        self.kernel(flops, nbytes, q.dtype, ATTENTION)
        return out

    def kernel(self, flops: int, nbytes: int, dtype: torch.dtype | None, kind: int) -> None:
        """A kernel no operator of PyTorch's runs (a fused higher-order operator's, a script's
        own Triton kernel): the host's time to issue it and the device's to run it."""
        backward = torch._C._current_graph_task_id() != -1
        host = self.time_model.host_seconds(False, backward, backward and torch.is_grad_enabled())
        self.host += host
        self._launch(flops, nbytes, dtype, False, False, kind, [], host)


# Libraries whose CUDA kernels are registered in C++ (no torch.library.custom_op to ask): their
# operators run on their meta kernels, which size the outputs only.
_LIBRARIES = frozenset(("torchvision", "torchaudio", "torchao", "fbgemm", "xformers", "mmcv"))


def _maybe_opdef(func) -> Any:
    """The ``torch.library.custom_op`` definition of ``func``, or None."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:
        return None
    return _maybe_get_opdef(func)


def _without_fake(func) -> Callable | None:
    """The implementation of a ``torch.library.custom_op`` registered without a fake one (its meta
    kernel raises "no fake impl registered"): on a GPU it runs eagerly all the same. Else None."""
    opdef = _maybe_opdef(func)
    if opdef is None or getattr(opdef, "_abstract_fn", True) is not None:
        return None
    backends = getattr(opdef, "_backend_fns", {})
    return backends.get("cuda") or backends.get(None) or getattr(opdef, "_init_fn", None)


def _uploaded(func, args: tuple, kwargs: dict) -> tuple[int, bool] | None:
    """A copy from the host to the device (``x.to("cuda")``, ``gpu.copy_(host)``): its bytes and
    whether it is ``non_blocking``; else None. (Copies to the host never reach this mode:
    memprof.values answers them.)"""
    if func is _TO_COPY and not args[0].is_meta:
        return args[0].numel() * args[0].element_size(), bool(kwargs.get("non_blocking", False))
    if func is _COPY and not args[1].is_meta and args[0].is_meta:
        return args[1].numel() * args[1].element_size(), bool(args[2] if len(args) > 2 else
                                                               kwargs.get("non_blocking", False))
    return None


_TO_COPY, _COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``t``'s memory. A wrapper subclass (a DTensor,
    PyTorch's ``__tensor_flatten__`` protocol) holds none of its own: its
    inner tensors do (a nested jagged tensor's, made by the operator this
    mode ran for it; a DTensor's come here one by one: aten_args.decomposes)."""
    if t.layout not in (torch.strided, torch.jagged):  # a sparse tensor (an nn.Embedding(sparse=True) gradient): its parts'
        parts = (t._indices(), t._values()) if t.is_sparse else (_compressed_indices(t) + (t.values(),))
        return [p.untyped_storage() for p in parts]
    if type(t) in PLAIN_TENSORS:
        return [t.untyped_storage()]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return [t.untyped_storage()]
    names, _ = flatten()
    inner = (getattr(t, name) for name in names)
    return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]


def _compressed_indices(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


#: Factorizations and solves: CUDA runs them (cuSOLVER, MAGMA, cuBLAS's trsm) in float32, float64
#: and complex only, where PyTorch's meta kernels accept 16-bit inputs too (a kernel matrix made
#: under bf16 autocast, then factorized).
_NO_HALF = {getattr(torch.ops.aten, name) for name in (
    "linalg_cholesky_ex", "cholesky", "cholesky_solve", "cholesky_inverse", "linalg_solve_triangular",
    "triangular_solve", "linalg_lu_factor_ex", "linalg_lu", "linalg_lu_solve", "linalg_inv_ex", "_linalg_solve_ex",
    "linalg_ldl_factor_ex", "linalg_ldl_solve", "_linalg_eigh", "linalg_eig", "_linalg_svd", "linalg_qr",
    "geqrf", "ormqr", "linalg_householder_product", "_linalg_det", "_linalg_slogdet", "linalg_lstsq",
) if hasattr(torch.ops.aten, name)}


_SCALED_MM = {getattr(torch.ops.aten, name) for name in ("_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm")
              if hasattr(torch.ops.aten, name)}


def _no_half(func, args: tuple) -> None:
    """Raise CUDA's error for a 16-bit input to a factorization or solve."""
    half = next((t.dtype for t in tensors(args) if t.is_meta and t.dtype in (torch.float16, torch.bfloat16)), None)
    if half is not None:
        kind = {torch.float16: "Half", torch.bfloat16: "BFloat16"}[half]
        raise RuntimeError(f'"{func._overloadpacket.__name__}_cuda" not implemented for \'{kind}\' (simulated: '
                           "CUDA factorizes and solves in float32, float64 or complex; cast the matrix with .float())")


class StepCounters(NamedTuple):
    """A simulated step's peaks, its seconds, and the seconds the device was busy in it."""

    peak_allocated: int
    peak_reserved: int
    seconds: float
    busy: float


def replay_step(model: CachingAllocatorModel, events: list[tuple]) -> StepCounters | None:
    """The step after a simulated one, from its ``events`` alone.

    A training step's second run does what its first did, less what the
    first made for good: the optimizer's state, cuBLAS's workspace (the
    blocks the first run allocated and never freed). So the first run's
    events, without those, replayed on the allocator ``model`` as it stands
    after the first run, give the second run's counters, and its time is
    that of the first run's operators less the kernels that only made such
    blocks, on the two clocks of :class:`TimeModel`. Returns the second
    run's counters, or None where the events are not a step that repeats: one
    that frees a block made before it.
    """
    kept = kept_blocks(events)
    if kept is None:
        return None  # a block from before the step: the second run frees another one
    model.reset_peak()
    handles: dict[int, int] = {}
    host = device = busy = 0.0
    for e in events:
        kind = e[0]
        if kind == "m":
            if e[1] not in kept:
                handles[e[1]] = model.malloc(e[2], e[3])
        elif kind == "f":
            model.free(handles.pop(e[1]))
        elif kind == "h":
            model.hold(handles[e[1]])
        elif not (kind == "k" and e[2] and all(h in kept for h in e[2])):
            host, device = _tick(host, device, e)
            busy += _busy(e)
    return StepCounters(model.peak_allocated, model.peak_reserved, max(host, device), busy)


def kept_blocks(events: list[tuple]) -> set[int] | None:
    """The blocks ``events`` make and do not free, or None where they free a block made before them."""
    made, freed = {e[1] for e in events if e[0] == "m"}, {e[1] for e in events if e[0] == "f"}
    return made - freed if freed <= made else None


def _busy(e: tuple) -> float:
    """The device's busy seconds in the time event ``e``."""
    return e[2] if e[0] == "c" else e[1] if e[0] in ("k", "t") else 0.0


def _tick(host: float, device: float, e: tuple) -> tuple[float, float]:
    """The host's and the device's clocks after the time event ``e`` (see
    :attr:`SimulatedAllocator.events`)."""
    kind = e[0]
    if kind == "k":  # a kernel: issued by the host, run by the device once issued and free
        host += e[3]
        return host, max(device, host) + e[1]
    if kind == "o":
        return host + e[1], device
    if kind == "t":  # a transfer: issued by the host, run by the device, perhaps waited for
        host += e[2]
        device = max(device, host) + e[1]
        return (device if e[3] else host), device
    now = max(host, device) + e[1]  # "c": charged to both clocks
    return now, now


def _cost(func, args: tuple, kwargs: dict, out: Any):
    """A device operator's (flops, bytes read and written, input dtype, is a
    convolution, launches a kernel, :func:`_kernel_kind`), or None for the host's own work."""
    ins, outs = tensors(args, kwargs), tensors(out)
    # Only the device's work takes simulated time: the host's own tensors (a data pipeline) do not.
    if not (any(t.is_meta for t in outs) or any(t.is_meta for t in ins)):
        return None
    if getattr(func, "is_view", False) or func.__name__.split(".")[0] in _NO_KERNEL:
        return 0, 0, None, False, False, OTHER
    nbytes = sum(t.numel() * t.element_size() for t in (*ins, *outs))
    if takes_copies(func):  # its copies (memprof.kernel_copies), each written and read once more
        nbytes += 2 * sum(sum(stage) for stage in kernel_copies(func, args))
    dtype = next((t.dtype for t in ins if t.is_floating_point()), None)
    kind, flops = _kernel_kind(func, args), _flops(func, args, kwargs, out)
    if kind == ATTENTION:
        flops = int(flops * _causal_share(func, args, kwargs))
    return flops, nbytes, dtype, "convolution" in func.__name__, True, kind


def _causal_share(func, args: tuple, kwargs: dict) -> float:
    """The share of an attention kernel's full arithmetic (PyTorch's flop
    counter counts every query against every key) that a causal one does:
    flash-style kernels skip the tiles above the diagonal, n (n + 1) / 2 of
    n x n tiles of 128 queries (FlashAttention-2, section 3.1.1)."""
    names = [a.name for a in func._schema.arguments]
    if "is_causal" not in names:
        return 1.0
    i = names.index("is_causal")
    if not (args[i] if len(args) > i else kwargs.get("is_causal", False)):
        return 1.0
    query = args[1] if "backward" in func.__name__ else args[0]  # a backward's first argument is the output's gradient
    n = -(-query.shape[-2] // 128)
    return (n + 1) / (2 * n)


#: Kinds of kernel, by how much of the datasheet they reach (TimeModel).
OTHER, STREAMING, MISALIGNED, CONVOLUTION, ATTENTION, NATIVE_BATCH_NORM, MISALIGNED_EVEN = 0, 1, 2, 3, 4, 5, 6

# Kernels that read and write every element once, in order, with no reduction
# across elements, besides those PyTorch tags pointwise: copies and casts
# (TensorIterator's copy kernel), fills, and the optimizers' multi-tensor
# kernels (multi_tensor_apply: pointwise over a list of tensors).
_STREAMING = {"_to_copy", "copy_", "copy", "clone", "fill_", "zero_", "zeros_like", "ones_like", "full_like",
              "zeros", "ones", "full", "new_zeros", "new_ones", "new_full", "masked_fill_", "masked_fill"}
# The matrix operands of the matrix products (their other arguments are added or scaled).
_GEMM_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "_addmm_activation": (1, 2)}


# Batch norm's input and weight, by operator.
_BATCH_NORMS = {"native_batch_norm": (0, 1), "_native_batch_norm_legit": (0, 1),
                "_native_batch_norm_legit_no_training": (0, 1), "native_batch_norm_backward": (1, 2)}


def _cudnn_batch_norm(input: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether CUDA runs this batch norm with cuDNN: ``_batch_norm_impl_index``
    (aten/src/ATen/native/Normalization.cpp) takes cuDNN for an input and
    weight that are not bf16, a half input only with fp32 weights, and
    affine parameters; else PyTorch's own kernel, slower on NCHW (a bf16
    autocast step's batch norms: benchmarks/results/step-time.md)."""
    if weight is None:
        return False
    return input.dtype != torch.bfloat16 and weight.dtype != torch.bfloat16 and (
        input.dtype != torch.float16 or weight.dtype == torch.float32)


def _kernel_kind(func, args: tuple) -> int:
    """``STREAMING`` for an elementwise kernel, which streams its tensors
    through memory and reaches more of the bandwidth than reductions,
    normalisations, softmax, gathers and scatters (whose blocks wait on one
    another or read with strides); ``MISALIGNED`` for a matrix product
    with a leading dimension (an operand's row stride as cuBLAS gets it, or the
    result's row) that is not a multiple of 16 bytes: tensor cores
    (16-bit, TF32) need 16-byte aligned rows (NVIDIA's Matrix Multiplication
    Background guide, "Requirements to use Tensor Cores"), and cuBLAS falls
    back to slower kernels (a vocabulary of 50257 is why nanoGPT pads it to
    50304); ``MISALIGNED_EVEN`` for a 16-bit one whose leading dimensions are
    all even (BERT's 30522), which cuBLAS runs on kernels twice as fast as
    for odd ones; a dimension that is no operand's leading one (a linear
    layer's tokens) does not matter; ``CONVOLUTION`` for a convolution, ``ATTENTION`` for a fused
    attention kernel (two products with a softmax between them, in one
    kernel); ``NATIVE_BATCH_NORM`` for a batch norm that PyTorch runs with its
    own kernel instead of cuDNN's; else ``OTHER``."""
    name = func.__name__.split(".")[0]
    if "convolution" in name:
        return CONVOLUTION
    if "attention" in name:
        return ATTENTION
    if name in _BATCH_NORMS and not _cudnn_batch_norm(*(args[i] for i in _BATCH_NORMS[name])):
        return NATIVE_BATCH_NORM
    if name in _GEMM_OPERANDS:
        a, b = (args[i] for i in _GEMM_OPERANDS[name])
        size = a.element_size()
        rows = [_leading_dimension(a) * size, _leading_dimension(b) * size, b.shape[-1] * size]
        if not a.is_floating_point() or not any(r % 16 for r in rows):
            return OTHER
        # on tensor cores (16-bit, TF32): TimeModel.seconds
        return MISALIGNED_EVEN if size == 2 and not any(r % 4 for r in rows) else MISALIGNED
    if torch.Tag.pointwise in func.tags or name in _STREAMING or name.startswith("_foreach_"):
        return STREAMING
    return OTHER


def _leading_dimension(t: torch.Tensor) -> int:
    """The row stride cuBLAS gets for a matrix operand (its last two
    dimensions), as ATen's ``prepare_matrix_for_cublas`` (native/cuda/Blas.cpp)
    hands it over: a matrix with unit stride along one dimension and room
    along the other as it is (transposed or not), any other copied contiguous."""
    (rows, cols), (row_stride, col_stride) = t.shape[-2:], t.stride()[-2:]
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride
    return cols


#: Meta kernels' results by signature, shared by every simulation in the process.
KERNELS = KernelCache()


def _nested_linear(func, args: tuple) -> bool:
    """A linear layer (or its backward) on a nested jagged tensor, whose matrix products on its packed
    values run inside the nested tensor's own dispatch, below the simulation's modes."""
    return func in _NESTED_LINEAR and bool(args) and getattr(args[0], "is_nested", False)


_NESTED_LINEAR = {torch.ops.aten.linear.default, torch.ops.aten.linear_backward.default}


# Grouped matrix products, which PyTorch's flop counter has no formula for.
_GROUPED_MM = frozenset(("_grouped_mm", "_scaled_grouped_mm"))


def _flops(func, args: tuple, kwargs: dict, out: Any) -> int:
    """The operator's arithmetic, by PyTorch's flop counter (torch.utils.flop_counter)."""
    if _nested_linear(func, args):  # linear(x, w, b), linear_backward(x, grad, w, mask): products over the tokens
        values = args[0]._values
        product = 2 * (values.numel() // values.shape[-1]) * args[-2 if len(args) > 3 else 1].numel()
        mask = args[3] if len(args) > 3 else (True, False, False)
        return product * (1 if len(args) <= 3 else sum(map(bool, mask[:2])))
    if func._overloadpacket.__name__ in _GROUPED_MM:
        # A mixture's experts in one kernel (torchtitan): 2D x 2D splits the reduced dimension among
        # the groups (the weights' gradient), the other forms multiply each group's rows by its matrix.
        a, b = args[0], args[1]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1] if a.dim() == b.dim() == 2 else 2 * out.numel() * a.shape[-1]
    count = flop_registry.get(func._overloadpacket)
    if count is None:
        return 0
    try:
        return int(count(*args, **kwargs, out_val=out))
    except (AssertionError, RuntimeError, ValueError):
        # Older counters reject grouped-query attention (fewer key/value heads than query heads):
        # the kernel does the arithmetic of keys and values repeated to the query's heads.
        q = 1 if "backward" in func.__name__ else 0  # a backward's first argument is the output's gradient
        if "attention" not in func.__name__ or len(args) < q + 3 or args[q].dim() != 4:
            return 0
        heads = args[q].shape[1]
        k, v = (t.expand(t.shape[0], heads, *t.shape[2:]) for t in args[q + 1:q + 3])
        try:
            return int(count(*args[:q + 1], k, v, *args[q + 3:], **kwargs, out_val=out))
        except (AssertionError, RuntimeError, ValueError):
            return 0


def simulate(
    setup: Callable[[], Any],
    step: Callable[..., Any] | None = None,
    *,
    target: str | GPU = "H100-80GB",
    steps: int = 3,
    on_meta: bool = True,
    oom_dir: str | os.PathLike | None = ".",
) -> Report:
    """Predict the memory of ``steps`` training steps on ``target`` without running them there.

    ``setup()`` builds the model and optimizer, written as for the GPU
    (``.cuda()``, ``device="cuda"`` are fine), and returns ``(model,
    optimizer)`` or ``(model, optimizer, step)``; ``step()`` (or
    ``step(model, optimizer)``) runs one training step. With ``on_meta``
    (default) ``setup`` runs under ``torch.device("meta")``, so weights are
    never materialised and a 7 B model costs nothing to build.

    Returns the same :class:`memprof.Report` as :func:`memprof.track`, with
    ``source == "simulate"`` and the target in ``meta``. A step that does not
    fit raises ``torch.OutOfMemoryError`` (:class:`memprof.caching.SimulatedOOM`)
    at the allocation that would fail on the target (its memory less what
    lies outside PyTorch), after writing what was live then to ``oom_dir``,
    as :func:`memprof.track` does; :func:`memprof.advise` tells what a step
    needs beyond the capacity.
    """
    gpu = get_gpu(target)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    # The target's capacity: the step runs out of memory where the GPU would.
    allocator = SimulatedAllocator(gpu, capacity=usable_bytes(gpu))
    with VirtualCUDA(gpu, allocator=allocator) as device:
        with torch.device("meta") if on_meta else nullcontext():
            built = setup()
        model, optimizer, step = _unpack(built, step)
        # Tensors made before the simulation began (a model built on meta by
        # the caller) are device memory too.
        allocator.adopt(_state_tensors(model, optimizer))
        run = (lambda: step(model, optimizer)) if _takes_two(step) else step
        with track(model, optimizer, warmup=steps, every=1, timeline_steps=steps, full=True, oom_dir=oom_dir) as prof:
            for _ in range(steps):
                run()
    report = prof.report()
    report.source = "simulate"
    report.meta.update(target=gpu.name, host="cpu" if not torch.cuda.is_available() else "cuda")
    if device.notes:
        report.meta["simulation_notes"] = dict(device.notes)
    return report


def _state_tensors(model: nn.Module, optimizer: Any):
    yield from model.parameters()
    yield from model.buffers()
    yield from (p.grad for p in model.parameters() if p.grad is not None)
    if isinstance(optimizer, torch.optim.Optimizer):
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _unpack(built: Any, step: Callable | None):
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TypeError(
            f"setup() must return (model, optimizer) or (model, optimizer, step), got {type(built).__name__}"
        )
    model, optimizer = built[0], built[1]
    if len(built) == 3:
        if step is not None:
            raise TypeError("give the step either as simulate()'s step argument or in setup()'s result, not both")
        step = built[2]
    if step is None:
        raise TypeError("no step to simulate: pass step=... or return (model, optimizer, step) from setup()")
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup()'s first result must be an nn.Module, got {type(model).__name__}")
    return model, optimizer, step


def _takes_two(fn: Callable) -> bool:
    import inspect

    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 2
