"""CPU offload of saved activations (``save_on_cpu``), behind the PCIe link.

Parameters, gradients and optimizer state go to the host with FSDP2's
``CPUOffloadPolicy``: :class:`memprof.strategies.zero.StateOffload`."""

from __future__ import annotations

import torch
from torch.autograd.graph import save_on_cpu

from memprof.workload import Workload

from .base import Door, Strategy

__all__ = ["ActivationOffload"]


class ActivationOffload(Strategy):
    """Keep what forward saves for backward in (pinned) host memory.

    ``torch.autograd.graph.save_on_cpu``: every saved tensor goes to the host
    in forward and comes back in backward, over PCIe, which bounds the step.
    """

    name = "offload_act"

    def apply(self, workload: Workload) -> None:
        workload.saved_tensors_hooks = lambda: save_on_cpu(pin_memory=True)
        workload.applied.append(self.name)

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        door = Door.of(door)
        under = "`with torch.autograd.graph.save_on_cpu(pin_memory=True):`"
        if door is Door.LIGHTNING:
            return f"in training_step, run the forward pass and the loss under {under}"
        if door is Door.HF:
            return (f"subclass Trainer and run compute_loss under {under} "
                    "(return super().compute_loss(model, inputs, *args, **kwargs) inside it)")
        return f"run the forward pass under {under}"

    def apply_simulated(self, workload: Workload) -> None:
        from memprof.virtual_cuda import current

        vc = current()
        alloc = vc.allocator if vc is not None else None
        link = vc.gpu.pcie_bandwidth if vc is not None else 32e9

        def transfer(nbytes: int) -> None:
            if alloc is not None:
                alloc.transfer(nbytes, link)

        def pack(t: torch.Tensor):
            if not t.is_meta:
                return t
            transfer(t.numel() * t.element_size())
            return (tuple(t.shape), tuple(t.stride()), t.dtype)  # the device copy is freed

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            shape, stride, dtype = packed
            out = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            transfer(out.numel() * out.element_size())
            return out

        workload.saved_tensors_hooks = lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        workload.applied.append(self.name)
