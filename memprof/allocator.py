"""Counters of the device allocator: PyTorch's caching allocator and NVML.

``torch.cuda.memory_stats()`` flattens the allocator's nested statistics in
Python: 142 us a call on an H200 host, against 21 us for the nested dict it
starts from (benchmarks/results/profile_hooks-*.txt). The tracker reads
counters at every module boundary of a profiled step, so it reads the nested
dict directly where this PyTorch build has it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

__all__ = ["Counters", "DeviceCounters", "KeptPeaks", "counters_for", "cublas_workspace_bytes", "cublas_workspace_size", "nvml_used_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counters:
    allocated: int
    reserved: int
    #: Highest values since the last ``reset_peak``.
    peak_allocated: int
    peak_reserved: int


def _peak_stats(stats: dict) -> Iterator[tuple[tuple[str, str], dict]]:
    """Every statistic with a ``peak`` in an allocator's nested statistics
    (``"allocated_bytes" -> "all" -> {"current", "peak", ...}``, and the
    pool-less ``"oversize_allocations" -> {...}``), by its path."""
    for name, value in stats.items():
        if isinstance(value, dict):
            if "peak" in value:
                yield (name, ""), value
            else:
                for pool, d in value.items():
                    if isinstance(d, dict) and "peak" in d:
                        yield (name, pool), d


def _counters(stats: dict) -> Counters:
    a, r = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return Counters(a["current"], r["current"], a["peak"], r["peak"])


class KeptPeaks:
    """The highest value of every peak statistic across resets that the user
    did not ask for: what the allocator's peaks would read without them."""

    def __init__(self) -> None:
        self._peaks: dict[tuple[str, str], int] = {}

    def fold(self, stats: dict) -> None:
        """Keep the peaks of ``stats``, read just before a reset."""
        kept = self._peaks
        for key, d in _peak_stats(stats):
            if d["peak"] > kept.get(key, -1):
                kept[key] = d["peak"]

    def apply(self, stats: dict) -> dict:
        """``stats`` with every peak raised to the kept one (in place)."""
        kept = self._peaks
        if kept:
            for key, d in _peak_stats(stats):
                k = kept.get(key)
                if k is not None and k > d["peak"]:
                    d["peak"] = k
        return stats

    def clear(self) -> None:
        """The user reset the peaks: nothing before that counts any more."""
        self._peaks.clear()


# The bindings through which torch.cuda (memory_stats, max_memory_allocated,
# memory_summary, ...) and torch.accelerator read and reset the caching
# allocator's statistics, taken at import so that the tracker always calls
# the real ones.
_STATS = {n: getattr(torch._C, n, None) for n in ("_cuda_memoryStats", "_accelerator_getDeviceStats")}
_RESETS = {n: getattr(torch._C, n, None) for n in ("_cuda_resetPeakMemoryStats", "_accelerator_resetPeakStats")}


class DeviceCounters:
    """Allocator counters of one device; on the CPU there are none."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type == "cuda"
        self._index = device.index if device.index is not None else 0
        self._nested = _STATS["_cuda_memoryStats"]
        self._reset = _RESETS["_cuda_resetPeakMemoryStats"]
        self.kept = KeptPeaks()

    def _stats(self) -> dict:
        if self._nested is not None:
            return self._nested(self._index)
        return torch.cuda.memory_stats_as_nested_dict(self.device)

    def read(self) -> Counters | None:
        if not self.available:
            return None
        return _counters(self._stats())

    def read_and_reset(self) -> Counters | None:
        """:meth:`read`, then :meth:`reset_peak`, with one read of the statistics."""
        if not self.available:
            return None
        s = self._stats()
        self.kept.fold(s)
        self._reset_raw()
        return _counters(s)

    def reset_peak(self) -> None:
        """Reset the peaks for the tracker, keeping what the user would read."""
        if self.available:
            self.kept.fold(self._stats())
            self._reset_raw()

    def _reset_raw(self) -> None:
        if self._reset is not None:
            self._reset(self._index)
        else:
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def user_view(self) -> Iterator[None]:
        """While open, the script reads and resets the peaks as if memprof never had."""
        if not self.available:
            yield
            return
        index, kept = self._index, self.kept
        patched: dict[str, Any] = {}

        def reading(original):
            def stats(device: int) -> dict:
                s = original(device)
                return kept.apply(s) if device == index else s

            return stats

        def resetting(original):
            def reset(device: int) -> None:
                if device == index:
                    kept.clear()
                return original(device)

            return reset

        for table, wrap in ((_STATS, reading), (_RESETS, resetting)):
            for name, original in table.items():
                if original is not None and getattr(torch._C, name, None) is original:
                    patched[name] = original
                    setattr(torch._C, name, wrap(original))
        try:
            yield
        finally:
            for name, original in patched.items():
                setattr(torch._C, name, original)

    def nvml_used(self) -> int | None:
        return nvml_used_bytes(self.device) if self.available else None

    def workspaces(self, known: Callable[[], set[int]]) -> int:
        """Bytes of cuBLAS's workspaces on this device: the allocator's live
        blocks of exactly a workspace's size that no storage at an address
        ``known()`` returns holds. PyTorch takes one such block per cuBLAS
        handle and stream and never frees it
        (aten/src/ATen/cuda/CublasHandlePool.cpp); a tensor of the same size
        that memprof does not know would be counted too."""
        size = cublas_workspace_size(self._index) if self.available else 0
        if not size:
            return 0
        addresses = known()
        total = 0
        for segment in torch.cuda.memory_snapshot():
            if segment.get("device", self._index) != self._index:
                continue
            for block in segment["blocks"]:
                if (block["state"] == "active_allocated" and block.get("requested_size", block["size"]) == size
                        and block["address"] not in addresses):
                    total += block["size"]
        return total


#: A ``:SIZE_KiB:COUNT`` pair of ``CUBLAS_WORKSPACE_CONFIG``.
_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """The workspace PyTorch takes from its caching allocator for each cuBLAS
    handle and stream, on a GPU of compute ``capability``: the sum of the
    ``:SIZE_KiB:COUNT`` pairs of ``config`` (``CUBLAS_WORKSPACE_CONFIG``; one
    with no pair is PyTorch's "Could not parse" warning and the default), by
    default ``:4096:8`` from Hopper on and ``:4096:2:16:8`` before
    (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize)."""
    default = ":4096:8" if tuple(capability) >= (9, 0) else ":4096:2:16:8"
    pairs = _PAIR.findall(default if config is None else config) or _PAIR.findall(default)
    return sum(int(kib) * 1024 * int(count) for kib, count in pairs)


def cublas_workspace_size(index: int) -> int:
    """The workspace PyTorch gives each cuBLAS handle and stream on device
    ``index``: ``torch.backends.cuda.cublas_workspace_size()`` where the build
    has it, else PyTorch's rule (:func:`cublas_workspace_bytes`). cuBLASLt
    shares it, or (builds before that getter) has one of its own, 1 MiB by
    default: a size too common among tensors to name a block by, so that one
    stays with the temporaries."""
    get = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)
    if get is not None:
        return int(get())
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")  # the device matters only without a pair in it
    parsed = config is not None and _PAIR.search(config)
    return cublas_workspace_bytes((0, 0) if parsed else torch.cuda.get_device_capability(index), config)


_device_counters: dict[int, DeviceCounters] = {}


def counters_for(device: torch.device):
    """The counters of ``device``: CUDA's, a simulated GPU's (meta tensors), or none.

    One :class:`DeviceCounters` per CUDA device for the process: the peaks it keeps for the
    script (what ``torch.cuda.max_memory_allocated`` would read without memprof) outlive the
    tracker that reset them, as the allocator's own peaks outlive any reader."""
    if device.type == "meta":
        from .virtual_cuda import current

        vc = current()
        if vc is not None and vc.allocator is not None:
            return vc.allocator
    if device.type != "cuda":
        return DeviceCounters(device)
    index = device.index if device.index is not None else 0
    if index not in _device_counters:
        _device_counters[index] = DeviceCounters(torch.device("cuda", index))
    return _device_counters[index]


_nvml_handles: dict[str, object] = {}


def nvml_used_bytes(device: torch.device) -> int | None:
    """Device memory in use as NVML sees it (all processes), or None.

    The handle is found by the device's UUID, so CUDA_VISIBLE_DEVICES
    reordering cannot point NVML at another GPU.
    """
    try:
        import pynvml
    except ImportError:
        log.info("nvidia-ml-py is not installed (pip install nvidia-ml-py): non_pytorch memory is not reported")
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = _nvml_handles.get(uuid)
        if handle is None:
            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid)
            except pynvml.NVMLError:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            _nvml_handles[uuid] = handle
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception as exc:  # NVML missing from the driver, no permission, ...
        log.info("NVML could not be read (%s): non_pytorch memory is not reported", exc)
        return None
