"""A script's own Triton kernels on the simulated GPU: launched, not run.

Training code written for speed launches its own Triton kernels (the Triton
tutorials' fused softmax and layer norm, Liger's and Unsloth's fused losses):
``kernel[grid](x, y, ...)`` goes to ``JITFunction.run``, which compiles for
the GPU Triton's driver finds and launches there. A Triton kernel takes no
memory of PyTorch's allocator (what it writes, the script allocated with
``torch.empty`` and the like, which the simulation counts), so on the
simulated GPU a launch is charged to the clocks and not run:

* its time: one operator's issue on the host and a kernel on the device
  that reads and writes every tensor it is given once, at the bandwidth
  PyTorch's own non-elementwise kernels reach (the simulation does not
  know which part of a tensor the kernel touches);
* its values: the tensors it is given are no longer followed (it may have
  written any of them), so what the script reads back of them is made up,
  as for any tensor whose values the simulation does not know;
* autotuning (``triton.autotune``) benchmarks nothing: the first
  configuration left after pruning is taken;
* Triton's driver answers for the simulated GPU (the tutorials' ``DEVICE =
  triton.runtime.driver.active.get_active_torch_device()``, Liger's and
  Unsloth's ``get_device_properties(...)["multiprocessor_count"]``), from
  the catalogue.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from .devices import GPU

__all__ = ["triton_launches"]

log = logging.getLogger(__name__)

#: Shared memory a block may opt in to, by compute capability (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability"): what Triton's driver reports as max_shared_mem.
_SHARED_MEMORY = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376,
                  (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}


@contextmanager
def triton_launches(gpu: GPU, allocator: Any, values: Any, note) -> Iterator[None]:
    """Triton's launches charged to ``allocator`` (a SimulatedAllocator, or None) and its
    tensors' values forgotten in ``values`` while the block runs; ``note(what, why)`` is
    told of the first launch. Nothing is changed where Triton is not installed."""
    if "triton" not in sys.modules and importlib.util.find_spec("triton") is None:
        yield
        return
    from .simulate import OTHER  # simulate needs this module's importer, virtual_cuda

    try:
        from triton.runtime import driver
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except Exception as exc:  # noqa: BLE001 - a broken Triton is the script's to find, not the simulation's
        log.debug("Triton is installed but does not import (%s): its kernels are not simulated", exc)
        yield
        return

    def launch(args: tuple, kwargs: dict) -> None:
        note("Triton kernels", "launched, not run: each charged as one kernel that reads and writes its tensors "
             "once; the values of the tensors it is given are not known after it")
        ts = [t for t in _tensors((*args, *kwargs.values())) if t.is_meta]
        for t in ts:
            values.forget(t)
        if allocator is not None:
            allocator.kernel(0, sum(t.numel() * t.element_size() for t in ts),
                             next((t.dtype for t in ts if t.is_floating_point()), None), OTHER)

    def run(fn, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if not warmup:
            launch(args, kwargs)
        return _Compiled(launch)

    from .virtual_cuda import _replace

    with ExitStack() as stack:
        stack.enter_context(_replace(JITFunction, "run", run))
        # Autotuning times each configuration on the device: none here, every one the same.
        stack.enter_context(_replace(Autotuner, "_bench", lambda tuner, *args, config, **kwargs: [0.0, 0.0, 0.0]))
        stack.enter_context(_replace(driver, "_active", _Driver(gpu)))
        yield


def _tensors(args) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(getattr(a, "base", None), torch.Tensor):  # a TensorDescriptor
            yield a.base


class _Compiled:
    """What a launch returns (a compiled kernel): launched again with ``kernel[grid](...)``,
    and what the Triton tutorials read of it to size their grid (registers, shared memory)."""

    n_regs, n_spills = 32, 0
    metadata = SimpleNamespace(shared=1024, num_warps=4, num_stages=2)

    def __init__(self, launch) -> None:
        self._launch = launch

    def _init_handles(self) -> None:
        pass

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: self._launch(args, kwargs)


class _Driver:
    """Triton's active driver, for the simulated GPU."""

    def __init__(self, gpu: GPU) -> None:
        cc = gpu.compute_capability
        # Registers per multiprocessor: 64 K 32-bit registers on every GPU of the catalogue (same table).
        properties = {"max_shared_mem": _SHARED_MEMORY.get(tuple(cc), 101376),
                      "multiprocessor_count": gpu.multiprocessors or 1, "max_num_regs": 65536, "warpSize": 32}
        self.utils = SimpleNamespace(get_device_properties=lambda device=0: dict(properties))
        self._target = cc[0] * 10 + cc[1]

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self._target, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda", 0)

    def get_device_interface(self):
        return torch.cuda

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True
