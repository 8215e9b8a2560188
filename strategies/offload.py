"""CPU offload: saved activations (``save_on_cpu``), or parameters, gradients
and optimizer state (FSDP2's ``CPUOffloadPolicy``), behind the PCIe link."""

from __future__ import annotations

import torch
from torch.autograd.graph import save_on_cpu

from memprof.categories import Category
from memprof.report import Report
from memprof.workload import Workload

from .base import Prediction, Strategy
from .checkpointing import find_blocks

__all__ = ["ActivationOffload", "StateOffload", "largest_block_bytes"]

# Host-side Adam reads and writes about 28 bytes per parameter (fp32 param,
# grad, m, v in; param, m, v out) at a few tens of GB/s.
_HOST_ADAM_BYTES_PER_PARAM = 28
_HOST_BANDWIDTH = 20e9


def largest_block_bytes(model) -> int:
    """Parameter bytes of the largest repeated block, what FSDP holds unsharded
    at once; 0 when the model has no repeated blocks (it is then one unit)."""
    blocks = find_blocks(model)
    return max((sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in blocks), default=0)


def _unit(baseline: Report) -> tuple[int, bool]:
    """(bytes of the largest unit FSDP gathers at once, whether there are several units).

    The advisor records the largest block when it simulates the baseline;
    without repeated blocks the whole model is the one unit.
    """
    block = int(baseline.meta.get("largest_block_bytes", 0))
    if block:
        return block, True
    return int(baseline.modules["parameters"].sum()), False


class ActivationOffload(Strategy):
    """Keep what forward saves for backward in (pinned) host memory.

    ``torch.autograd.graph.save_on_cpu``: every saved tensor goes to the host
    in forward and comes back in backward, over PCIe, which bounds the step.
    """

    name = "offload_act"

    def apply(self, workload: Workload) -> None:
        workload.saved_tensors_hooks = lambda: save_on_cpu(pin_memory=True)
        workload.applied.append(self.name)

    def apply_simulated(self, workload: Workload) -> None:
        from memprof.virtual_cuda import current

        vc = current()
        alloc = vc.allocator if vc is not None else None
        link = vc.gpu.pcie_bandwidth if vc is not None else 32e9

        def transfer(nbytes: int) -> None:
            if alloc is not None:
                alloc.seconds += nbytes / link

        def pack(t: torch.Tensor):
            if t.device.type != "meta":
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


class StateOffload(Strategy):
    """Parameters, gradients and optimizer state on the host; FSDP2 brings
    each block's parameters over for its forward and backward and the
    optimizer steps on the CPU (``fully_shard(..., offload_policy=CPUOffloadPolicy())``).
    Needs an initialised ``torch.distributed`` process group (one rank is fine).
    """

    name = "offload_states"

    def apply(self, workload: Workload) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if not dist.is_initialized():
            raise RuntimeError(
                "StateOffload uses FSDP2, which needs torch.distributed: call "
                "torch.distributed.init_process_group() first (world size 1 is fine)"
            )
        model = workload.model
        for _, block in find_blocks(model):
            fully_shard(block, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        opt = workload.optimizer
        workload.optimizer = type(opt)(model.parameters(), **opt.defaults)
        workload.applied.append(self.name)

    def apply_simulated(self, workload: Workload) -> None:
        workload.applied.append(self.name)  # accounted for in adjust(): nothing to run differently

    def adjust(self, prediction: Prediction, baseline: Report, gpu) -> Prediction:
        peak = prediction.report.peak if prediction.report is not None else baseline.peak
        states = sum(peak.bytes.get(c.value, 0) for c in (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE))
        block, several = _unit(baseline)
        params = int(baseline.modules["parameters"].sum())
        # Device keeps one gathered unit and, with several, the next (prefetch), plus one unit's gradients.
        saved = states - (3 if several else 2) * block
        moved = 3 * params  # parameters in for forward and for backward, gradients out
        seconds = moved / gpu.pcie_bandwidth + params / 4 * _HOST_ADAM_BYTES_PER_PARAM / _HOST_BANDWIDTH
        return prediction.minus(max(saved, 0), seconds)
