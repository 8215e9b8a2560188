"""Counters of the device allocator: PyTorch's caching allocator and NVML.

Reading ``torch.cuda.memory_stats`` builds a dict of a few hundred entries,
so the tracker reads it at phase boundaries of profiled steps only and once
per step otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["Counters", "DeviceCounters", "nvml_used_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counters:
    allocated: int
    reserved: int
    #: Highest values since the last ``reset_peak``.
    peak_allocated: int
    peak_reserved: int


class DeviceCounters:
    """Allocator counters of one device; on the CPU there are none."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type == "cuda"

    def read(self) -> Counters | None:
        if not self.available:
            return None
        s = torch.cuda.memory_stats(self.device)
        return Counters(
            s.get("allocated_bytes.all.current", 0),
            s.get("reserved_bytes.all.current", 0),
            s.get("allocated_bytes.all.peak", 0),
            s.get("reserved_bytes.all.peak", 0),
        )

    def reset_peak(self) -> None:
        if self.available:
            torch.cuda.reset_peak_memory_stats(self.device)

    def nvml_used(self) -> int | None:
        return nvml_used_bytes(self.device) if self.available else None


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
