"""``torch.cuda`` and ``torch.accelerator`` as a simulated GPU answers them.

:class:`CudaRuntime` gives the functions and classes a script calls: device
properties from the GPU catalogue, memory from the simulated allocator,
streams (a current one per thread, whose blocks the allocator keeps apart)
that never capture a graph, events that time with the simulated clock, seeds
and synchronisation that do nothing. They replace PyTorch's own
for the duration of ``memprof.virtual_cuda.VirtualCUDA``, on a CPU-only build
of torch (which has no CUDA runtime) and on a CUDA build with no visible GPU
(whose runtime would fail) alike. :data:`TENSOR_API` holds what the runtime
does for tensors: page-locked host memory is host memory (the device pays
nothing for it); ``record_stream`` is the allocator's (:meth:`CudaRuntime.tensor_api`).
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable

import torch

from .devices import GPU

__all__ = ["CudaRuntime", "Generator", "LEGACY_TYPES", "TENSOR_API", "current_stream_id", "legacy_type"]

log = logging.getLogger(__name__)

_CUDA0 = torch.device("cuda", 0)


class Generator(torch.Generator):
    """``torch.Generator(device="cuda")`` (timm's ModelEmaV3, a script seeding its own GPU
    stream of numbers): a host generator, which the simulated device's random operators
    take as a GPU's would (they make no values)."""

    def __new__(cls, device: Any = "cpu"):
        device = torch.device(device) if isinstance(device, (str, int)) else device
        return super().__new__(cls, "cpu" if device is not None and device.type == "cuda" else device)


class CudaRuntime:
    """The CUDA runtime of one simulated ``gpu`` whose memory ``allocator`` counts (or None)."""

    def __init__(self, gpu: GPU, allocator: Any = None) -> None:
        self.gpu, self.allocator = gpu, allocator
        #: torch.cuda.set_per_process_memory_fraction's (1.0: the whole device, as PyTorch starts)
        self.fraction = 1.0

    def cuda(self) -> dict[str, Any]:
        """``torch.cuda``'s functions and classes."""
        gpu, vc = self.gpu, self
        props = SimpleNamespace(
            name=gpu.name,
            total_memory=gpu.memory_bytes,
            major=gpu.compute_capability[0],
            minor=gpu.compute_capability[1],
            multi_processor_count=gpu.multiprocessors or 1,
            is_integrated=False,
            is_multi_gpu_board=False,
            max_threads_per_multi_processor=2048,
            warp_size=32,
            uuid="00000000-0000-0000-0000-000000000000",
            pci_bus_id=0,
            pci_device_id=0,
            pci_domain_id=0,
            gcnArchName=gpu.name,
        )
        return {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "_lazy_init": lambda: None,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            # CUDA's own parsing: "cuda" without an index raises there as on a GPU (torch.cuda.set_device).
            "set_device": lambda device: torch.cuda._utils._get_device_index(device) and None,
            "synchronize": self._call("synchronize"),
            "ipc_collect": lambda: None,
            "get_device_name": lambda device=None: gpu.name,
            "get_device_capability": lambda device=None: gpu.compute_capability,
            "get_device_properties": lambda device=None: props,
            "get_arch_list": lambda: [f"sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}"],
            "is_bf16_supported": lambda including_emulation=True: gpu.bf16,
            "is_tf32_supported": lambda: gpu.compute_capability >= (8, 0),
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "seed": lambda: None,
            "seed_all": lambda: None,
            "initial_seed": lambda: 0,
            "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8, device="cpu"),
            "set_rng_state": lambda state, device="cuda": None,
            "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8, device="cpu")],
            "set_rng_state_all": lambda states: None,
            "default_generators": (torch.Generator(),),
            "device": _NoDevice,
            "device_of": _NoDevice,
            "Stream": _Stream,
            "ExternalStream": _Stream,
            "Event": lambda *a, **k: _Event(vc.clock),
            "stream": _StreamContext,
            "StreamContext": _StreamContext,
            "current_stream": _current_stream,
            "default_stream": lambda device=None: _STREAM,
            "set_stream": _set_stream,
            "is_current_stream_capturing": lambda: False,
            "CUDAGraph": _Graph,
            "graph": _Capture,
            "graph_pool_handle": _graph_pool_handle,
            "make_graphed_callables": _make_graphed_callables,
            **self._memory(),
            "memory_cached": vc._count("reserved"),
            "max_memory_cached": vc._count("peak_reserved"),
            "reset_max_memory_allocated": vc._call("user_reset_peak"),
            "reset_accumulated_memory_stats": lambda device=None: None,
            "memory_summary": lambda device=None, abbreviated=False: vc.memory_summary(),
            "mem_get_info": lambda device=None: vc.mem_get_info(),
            "set_per_process_memory_fraction": self.set_memory_fraction,
            "get_per_process_memory_fraction": lambda device=None: self.fraction,
            "_set_allocator_settings": self.set_allocator_settings,
            "utilization": lambda device=None: 100,
            "list_gpu_processes": lambda device=None: f"GPU:0 (simulated {gpu.name})\nno processes are running",
            **LEGACY_TYPES,
        }

    @staticmethod
    def nvtx() -> dict[str, Any]:
        """``torch.cuda.nvtx``'s markers: nothing to mark on a simulated GPU (a CPU build has no NVTX)."""
        return {
            "range_push": lambda msg, *args, **kwargs: 0,
            "range_pop": lambda: 0,
            "range_start": lambda msg, *args, **kwargs: 0,
            "range_end": lambda range_id: None,
            "mark": lambda msg, *args, **kwargs: None,
        }

    def accelerator(self) -> dict[str, Any]:
        """``torch.accelerator``'s (and ``torch.accelerator.memory``'s) functions."""
        vc = self
        return {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "current_device_index": lambda: 0,
            "current_device_idx": lambda: 0,
            "set_device_index": lambda device: None,
            "set_device_idx": lambda device: None,
            "device_index": _NoDevice,
            "current_stream": _current_stream,
            "set_stream": _set_stream,
            "synchronize": self._call("synchronize"),
            **self._memory(),
            "get_memory_info": _ignoring_args(vc.mem_get_info),
        }

    def set_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction``, with its checks: the simulated allocator
        fails a new segment, as c10's ``alloc_block`` does, once its reserved memory and the segment
        would pass ``fraction`` of the device's total memory (a script sharing a GPU caps itself so)."""
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction
        model = getattr(self.allocator, "model", None)
        if model is not None:
            model.limit = int(fraction * self.gpu.memory_bytes)

    def tensor_api(self) -> dict[str, Callable]:
        """``torch.Tensor``'s CUDA methods: :data:`TENSOR_API`'s, and ``record_stream``, told to the
        allocator (where there is none, or it keeps no streams, it does nothing)."""
        allocator = self.allocator

        def record_stream(t: torch.Tensor, stream: Any) -> None:
            if t.is_meta and hasattr(allocator, "record_stream"):
                allocator.record_stream(t, getattr(stream, "stream_id", 0))

        return {**TENSOR_API, "record_stream": record_stream}

    def set_allocator_settings(self, settings: str) -> None:
        """``torch.cuda.memory._set_allocator_settings`` and ``torch._C._accelerator_setAllocatorSettings``:
        the simulated allocator's settings (expandable segments), from now on."""
        getattr(self.allocator, "set_allocator_settings", lambda settings: None)(settings)

    def _memory(self) -> dict[str, Any]:
        """Memory queries that torch.cuda and torch.accelerator share, answered by the simulated allocator."""
        return {
            "empty_cache": self._call("empty_cache"),
            "memory_allocated": self._count("allocated"),
            "max_memory_allocated": self._count("peak_allocated"),
            "memory_reserved": self._count("reserved"),
            "max_memory_reserved": self._count("peak_reserved"),
            "reset_peak_memory_stats": self._call("user_reset_peak"),
            "memory_stats": _ignoring_args(self.memory_stats),
            # The allocator's snapshot, as memory debugging asks for it (torch.cuda.memory's
            # _record_memory_history / _dump_snapshot): the simulated allocator's segments and
            # blocks; no history of allocations is kept.
            "memory_snapshot": _ignoring_args(self.memory_snapshot),
            "_snapshot": _ignoring_args(lambda: {"segments": self.memory_snapshot(), "device_traces": [[]]}),
            "_record_memory_history": _ignoring_args(lambda: None),
            "_dump_snapshot": self._dump_snapshot,
        }

    def memory_snapshot(self) -> list[dict]:
        return self.allocator.model.snapshot() if self.allocator is not None else []

    def _dump_snapshot(self, filename: str = "dump_snapshot.pickle") -> None:
        with open(filename, "wb") as f:
            pickle.dump({"segments": self.memory_snapshot(), "device_traces": [[]]}, f)
        log.info("wrote the simulated allocator's segments to %s (no history of allocations)", filename)

    def _count(self, field: str) -> Callable[..., int]:
        """A query answering the allocator's counter ``field`` (0 without an allocator)."""
        return _ignoring_args(lambda: getattr(self.allocator.user_read(), field) if self.allocator is not None else 0)

    def _call(self, method: str) -> Callable[..., None]:
        """A call of the allocator's ``method`` (nothing without an allocator, or one without it)."""
        return _ignoring_args(lambda: getattr(self.allocator, method, _nothing)())

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as ``cudaMemGetInfo`` would answer on the target: total less what is in use."""
        total = self.gpu.memory_bytes
        used = self.allocator.nvml_used() if self.allocator is not None else 0
        return max(total - used, 0), total

    def memory_stats(self) -> dict[str, int]:
        """The main keys of ``torch.cuda.memory_stats()``, from the simulated allocator."""
        if self.allocator is None:
            return {}
        c = self.allocator.user_read()
        stats = {}
        for key, current, peak in (("allocated_bytes", c.allocated, c.peak_allocated),
                                   ("reserved_bytes", c.reserved, c.peak_reserved),
                                   ("active_bytes", c.allocated, c.peak_allocated)):
            for pool in ("all", "large_pool", "small_pool"):
                stats[f"{key}.{pool}.current"] = current if pool == "all" else 0
                stats[f"{key}.{pool}.peak"] = peak if pool == "all" else 0
        m = self.allocator.model
        stats.update(num_alloc_retries=m.num_alloc_retries, num_ooms=m.num_ooms, num_sync_all_streams=0,
                     num_device_alloc=m.num_device_alloc, num_device_free=m.num_device_free)
        return stats

    def memory_summary(self) -> str:
        c = self.allocator.user_read() if self.allocator is not None else None
        if c is None:
            return f"simulated {self.gpu.name}: no allocator"
        return (f"simulated {self.gpu.name}: allocated {c.allocated} B (peak {c.peak_allocated} B), "
                f"reserved {c.reserved} B (peak {c.peak_reserved} B)")

    def clock(self) -> float:
        return self.allocator.clock() if self.allocator is not None else 0.0


def _nothing() -> None:
    return None


def _ignoring_args(answer: Callable[[], Any]) -> Callable[..., Any]:
    """``answer`` for a query that takes a device (one simulated device: any answers alike)."""
    return lambda *args, **kwargs: answer()


class _NoDevice:
    """``torch.cuda.device(i)``: one simulated device, nothing to switch."""

    def __init__(self, device: Any = None) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Graph:
    """``torch.cuda.CUDAGraph`` on the simulated device: what a capture records runs once,
    eagerly (its memory is the step's); a replay runs nothing again, so the steps a script
    replays are not seen (only those it ran eagerly, its warm-up's and the capture)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pool = _graph_pool_handle()  # a graph captured without a pool gets a private one

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        return None

    def capture_end(self) -> None:
        return None

    def replay(self) -> None:
        _replays_not_simulated()

    def reset(self) -> None:
        return None

    def pool(self) -> tuple[int, int]:
        return self._pool

    def enable_debug_mode(self) -> None:
        return None

    def debug_dump(self, path: str) -> None:
        return None


_graph_pools = itertools.count(1)
_pool_streams: dict[Any, "_Stream"] = {}


def _graph_pool_handle() -> tuple[int, int]:
    return (0, next(_graph_pools))


class _Capture:
    """``with torch.cuda.graph(g, pool=None, stream=None):`` as PyTorch's (torch/cuda/graphs.py): the
    device synchronised and its cache emptied first ("free as much memory as we can for the graph"),
    then the block runs eagerly (see :class:`_Graph`). What it allocates comes from the graph's
    private pool (the graph's own, or ``pool`` shared with other graphs), which eager work does not
    reuse: a stream of the pool's own stands for it."""

    def __init__(self, cuda_graph: Any, pool: Any = None, stream: Any = None, **kwargs: Any) -> None:
        pool = cuda_graph.pool() if pool is None and isinstance(cuda_graph, _Graph) else pool
        if pool not in _pool_streams:
            _pool_streams[pool] = _Stream()
        self._context = _StreamContext(_pool_streams[pool])

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)


def _make_graphed_callables(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.cuda.make_graphed_callables``: PyTorch's own (torch/cuda/graphs.py) over the simulated
    graphs. Its warm-up runs on a side stream; its captures run once, allocating the static outputs,
    what the forward saves and the static gradients from one private pool that eager work does not
    reuse, where they stay; a call returns the static outputs and its backward the static gradients
    (a replay runs nothing: see :class:`_Graph`)."""
    from torch.cuda import graphs

    original = graphs.graph_pool_handle  # its module's name, torch._C's (no pool without CUDA)
    graphs.graph_pool_handle = _graph_pool_handle
    try:
        return graphs.make_graphed_callables(callables, sample_args, *args, **kwargs)
    finally:
        graphs.graph_pool_handle = original


_warned_replay: list[bool] = []


def _replays_not_simulated() -> None:
    if not _warned_replay:  # once a process
        _warned_replay.append(True)
        log.warning("CUDA graph replays are not simulated: the steps the script runs eagerly (its warm-up, the "
                    "capture) stand for them")


class _Stream:
    """A CUDA stream of the simulated device, never capturing a graph. Its work runs on the
    device's one simulated queue; its id tells the caching allocator which blocks it may
    reuse (blocks serve the stream they were allocated on, as in CUDA's)."""

    device = _CUDA0
    cuda_stream = 0
    stream_id = 0  # the default stream's
    device_index = 0
    device_type = 1
    priority = 0

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority
        self.stream_id = self.cuda_stream = next(_stream_ids)

    def is_capturing(self) -> bool:
        return False

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def __enter__(self) -> "_Stream":  # torch.Stream's: the current stream until exit
        self._previous = _current_stream()
        _set_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _set_stream(self.__dict__.pop("_previous", _STREAM))


_stream_ids = itertools.count(1)
_STREAM = object.__new__(_Stream)  # the default stream (id 0)
_current = threading.local()  # each thread's current stream: CUDA keeps one per thread, the default at its start


def _current_stream(device: Any = None) -> _Stream:
    return getattr(_current, "stream", _STREAM)


def _set_stream(stream: Any) -> None:
    if stream is not None:  # torch.cuda.set_stream(None) does nothing
        _current.stream = stream


def current_stream_id() -> int:
    """The id of this thread's current stream on the simulated device (0: the default stream)."""
    return getattr(_current, "stream", _STREAM).stream_id


class _StreamContext:
    """``with torch.cuda.stream(s):`` (``None``: no change)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        self._previous = _current_stream()
        _set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        _set_stream(self._previous)


class _Event:
    """A CUDA event on the simulated device: ``elapsed_time`` is the simulated time between records."""

    def __init__(self, clock: Callable[[], float] = lambda: 0.0) -> None:
        self._clock = clock
        self._at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._at = self._clock()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._clock()  # the host waits for the device (the simulated clocks meet)

    def elapsed_time(self, end: "_Event") -> float:
        """Milliseconds, as CUDA events report them."""
        if self._at is None or end._at is None:
            raise RuntimeError("both events must be recorded before elapsed_time(): call record() on each")
        return 1e3 * (end._at - self._at)


_pinned: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    # Page-locked host memory is host memory: the device pays nothing for it.
    if not self.is_meta:
        _pinned.add(self)
    return self


def _is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    return self in _pinned


class _LegacyTypeMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.is_cuda and obj.dtype == cls.dtype

    def __repr__(cls) -> str:
        return f"<class 'torch.cuda.{cls.__name__}'>"


class _LegacyType(metaclass=_LegacyTypeMeta):
    """``torch.cuda.FloatTensor`` and its kin, as older scripts use them
    (``Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor``): the
    legacy constructor (``Tensor(2, 3)``: uninitialised; ``Tensor(data)``: a
    copy of a sequence or array) and ``isinstance``, on the simulated GPU (the
    real ones initialise CUDA)."""

    dtype: torch.dtype
    is_cuda = True

    def __new__(cls, *args: Any, device: Any = None) -> torch.Tensor:  # type: ignore[misc]
        # ``device``: an index of the GPUs the script sees; all of them are the simulated one.
        if len(args) == 1 and not isinstance(args[0], (int, torch.Size)):
            data = args[0]
            if isinstance(data, torch.Tensor):
                return data.to("cuda", cls.dtype)
            return torch.tensor(data, dtype=cls.dtype, device="cuda")
        sizes = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else args
        return torch.empty(sizes, dtype=cls.dtype, device="cuda")


#: torch.cuda's legacy tensor types by name.
LEGACY_TYPES: dict[str, type] = {
    name: _LegacyTypeMeta(name, (_LegacyType,), {"dtype": dtype})
    for name, dtype in (("FloatTensor", torch.float32), ("DoubleTensor", torch.float64), ("HalfTensor", torch.float16),
                        ("BFloat16Tensor", torch.bfloat16), ("ByteTensor", torch.uint8), ("CharTensor", torch.int8),
                        ("ShortTensor", torch.int16), ("IntTensor", torch.int32), ("LongTensor", torch.int64),
                        ("BoolTensor", torch.bool))
}
_TYPE = torch.Tensor.type


def legacy_type(t: Any) -> "_LegacyTypeMeta | None":
    """The simulated GPU's legacy type ``t`` is or names (``"torch.cuda.FloatTensor"``), else None."""
    if isinstance(t, str):
        return LEGACY_TYPES.get(t[len("torch.cuda."):]) if t.startswith("torch.cuda.") else None
    return t if isinstance(t, _LegacyTypeMeta) else None


def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """``Tensor.type``: a simulated tensor's name is CUDA's, and a CUDA type (legacy
    class or its name) converts to the simulated GPU."""
    if dtype is None:
        name = _TYPE(self)
        return name.replace("torch.meta.", "torch.cuda.") if self.is_meta else name
    legacy = legacy_type(dtype)
    if legacy is not None:
        return self.to("cuda", legacy.dtype, non_blocking=non_blocking)
    return _TYPE(self, dtype, non_blocking, **kwargs)


#: Tensor methods as the simulated runtime has them, set on the class: modes are
#: per thread, and a DataLoader pins in a thread of its own.
TENSOR_API = {"pin_memory": _pin_memory, "is_pinned": _is_pinned, "type": _type}  # and record_stream: tensor_api
