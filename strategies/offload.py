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
    #: Whether ``save_on_cpu``'s pack waits for its copy: before torch 2.12 it
    #: copies into pinned memory with a plain ``copy_`` (no ``non_blocking``),
    #: which ends in a stream synchronisation, so every saved tensor makes the
    #: host wait for the device (pytorch/pytorch#175421 made it non-blocking).
    #: The simulated step times it so; set it to time another version's.
    synchronous_pack: bool = torch.__version__ < (2, 12)  # a TorchVersion: compares with tuples

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
        synchronize = self.synchronous_pack

        def pack(t: torch.Tensor):
            if not t.is_meta:
                return t
            if alloc is not None:  # the host issues torch.empty(pin_memory=True) and copy_
                alloc.transfer(t.numel() * t.element_size(), link, synchronize=synchronize, host_ops=2)
            return (tuple(t.shape), t.dtype)  # the device copy is freed

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            shape, dtype = packed
            # save_on_cpu packs into torch.empty(tensor.size()) and moves that back: contiguous,
            # a view's elements only (a fused qkv's value view is a third of its storage).
            with torch._C.DisableTorchFunction():  # the simulated GPU's, not a script's own meta tensor
                out = torch.empty(shape, dtype=dtype, device="meta")
            if alloc is not None:  # .to(device, non_blocking=True): the copy, its destination made above
                alloc.transfer(out.numel() * out.element_size(), link)
            return out

        pack.memprof_own = unpack.memprof_own = True  # they make their meta tensors themselves (virtual_cuda._in_mode)
        workload.saved_tensors_hooks = lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        workload.applied.append(self.name)
