"""ZeRO-1/2/3 over N ranks (Rajbhandari et al. 2020): optimizer state (1),
+ gradients (2), + parameters (3) sharded N ways.

Applied with PyTorch's own engines: ``ZeroRedundancyOptimizer`` (with DDP)
for stage 1, FSDP2 ``fully_shard`` with ``reshard_after_forward=False``
(stage 2) or ``True`` (stage 3). Simulated from one rank's step: the sharded
categories at the peak shrink to 1/N, and what FSDP holds unsharded at once
(one block's parameters and gradients, and the next block's prefetched
parameters) is added back; communication (reduce-scatter of gradients and
all-gather of parameters: 2 parameter volumes a step for stages 1-2, 3 for
stage 3, each moving (N-1)/N of it) is charged at the NVLink bandwidth.
"""

from __future__ import annotations

from memprof.categories import Category
from memprof.report import Report
from memprof.workload import Workload

from .base import Prediction, Strategy
from .checkpointing import find_blocks
from .offload import _unit

__all__ = ["ZeRO"]


class ZeRO(Strategy):
    def __init__(self, stage: int, world_size: int) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
        self.stage, self.world_size = stage, world_size
        self.name = f"zero{stage}x{world_size}"

    def sharded(self) -> tuple[Category, ...]:
        return (Category.OPTIMIZER_STATE, Category.GRADIENTS, Category.PARAMETERS)[: self.stage]

    def apply(self, workload: Workload) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                f"{self.name} runs on {self.world_size} ranks: start them with torchrun and call "
                "torch.distributed.init_process_group() before applying it"
            )
        model, opt = workload.model, workload.optimizer
        if self.stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            workload.model = DistributedDataParallel(model)
            workload.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(opt), **opt.defaults)
        else:
            from torch.distributed.fsdp import fully_shard

            reshard = self.stage == 3
            for _, block in find_blocks(model):
                fully_shard(block, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            workload.optimizer = type(opt)(model.parameters(), **opt.defaults)
        workload.applied.append(self.name)

    def apply_simulated(self, workload: Workload) -> None:
        workload.applied.append(self.name)  # one rank's step runs unchanged; adjust() shards it

    def adjust(self, prediction: Prediction, baseline: Report, gpu) -> Prediction:
        n = self.world_size
        peak = prediction.report.peak if prediction.report is not None else baseline.peak
        removed = sum(peak.bytes.get(c.value, 0) - -(-peak.bytes.get(c.value, 0) // n) for c in self.sharded())
        block, several = _unit(baseline)
        added = 0
        if self.stage >= 2 and n > 1:
            added += block  # one unit's gradients before their reduce-scatter
        if self.stage == 3 and n > 1:
            added += (2 if several else 1) * block  # the gathered unit, and the prefetched next one if any
        params = int(baseline.modules["parameters"].sum())
        volume = (3 if self.stage == 3 else 2) * params * (n - 1) / n
        link = gpu.nvlink_bandwidth or gpu.pcie_bandwidth
        return prediction.minus(removed - added, volume / link if n > 1 else 0.0)
