"""ZeRO-1/2/3 over N ranks (Rajbhandari et al. 2020), and state offload to the host.

Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also
the parameters. Applied with PyTorch's own engines:

* stage 1: ``ZeroRedundancyOptimizer`` under ``DistributedDataParallel``
  (with ``gradient_as_bucket_view``, so gradients live in DDP's buckets and
  are not kept twice);
* stages 2 and 3: FSDP2 ``fully_shard`` on each repeated block and on the
  model, ``reshard_after_forward=False`` (2) or ``True`` (3); with
  ``offload=True`` its ``CPUOffloadPolicy`` keeps the shards and the optimizer
  step on the host. :class:`StateOffload` is that on one rank.

Simulated from one unsharded rank's step, sample by sample (the peak may move
to another moment): the sharded categories become their 1/N shard (none on
the device with offload), and what FSDP2 holds unsharded is added back. That
is, in forward and backward, every unit for stage 2 (gathered in forward,
kept until backward); for stage 3 the root module's own parameters (FSDP2
never reshards the root after forward), the unit being computed and the
next one prefetched; in backward, one unit's gradients before their
reduce-scatter. In the optimizer step, its temporaries shrink with the shard.
Communication and host transfers are charged to the step time.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from memprof.categories import Category
from memprof.report import Phase, Report, phase_kind, phase_module
from memprof.simulate import TimeModel
from memprof.workload import Workload

from .base import Door, Prediction, Strategy
from .checkpointing import find_blocks

__all__ = ["StateOffload", "ZeRO", "fsdp_units"]

# With offload each rank steps AdamW on the host over its own shard: about 28
# bytes per parameter (fp32 param, grad, m, v in; param, m, v out) at a rate
# set by the host threads the rank has. The median over the 14 offload plans
# of benchmarks/results/zero-{1,2}.md, one and two ranks with 16 threads each
# on the H200 host (OMP_NUM_THREADS=16; torchrun sets 1 unless told), was
# 22.6 GB/s a rank (17-29 GB/s), with the ranks' steps running side by side.
_HOST_ADAM_BYTES_PER_PARAM = 28
_HOST_ADAM_RATE = 22.6e9
# And a cost per parameter tensor: AdamW picks neither foreach nor fused for host tensors
# (torch.optim.optimizer._default_to_fused_or_foreach), so each sharded parameter runs its own
# eight or so operators, each through DTensor's Python dispatch. benchmarks/host_adam.py on the
# H200's host, FSDP2 CPUOffloadPolicy, 256 bias-free linears of width 128 and 256 (where the
# elements above cost 4-17 % of the step): 0.375-0.62 ms a tensor over two runs, median 0.44
# (results/host-adam.json). Without it the advisor's benchmark had its smaller models' offload
# steps 10-39 % fast (GPT-2, BERT, ViT-B/16: ~150-200 tensors of 0.4-0.8 M elements).
_HOST_ADAM_SECONDS_PER_TENSOR = 0.44e-3
# An optimizer that multiplies matrices (Muon's Newton-Schulz iterations, in bf16) is bound by the
# host's matrix products instead: their flops, as the simulated step counts them (PyTorch's flop
# counter), at 2.3 TFLOP/s. Measured on the H200's host, 16 threads (benchmarks/host_flops.py,
# results/host-flops-h200.json): torch.optim.Muon's whole step over 42.5 M parameters of GPT-2-sized
# matrices, 815 GFLOP of products, took 0.404 s; less its elementwise part at AdamW's rate above,
# 2.3 TFLOP/s (its bf16 products alone ran at 3.5, fp32 ones at 1.1; one thread: 0.87 and 0.16).
_HOST_MATMUL_RATE = 2.3e12

_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)
# Phases in which FSDP holds gathered parameters. A checkpointed block's
# recomputation counts as forward, as it did when it was named so.
_COMPUTING = (Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD)


def fsdp_units(model: nn.Module) -> dict:
    """How FSDP2 would cut ``model`` into units, for a report's ``meta``:
    ``blocks`` (the repeated blocks' names), ``largest_block_bytes`` (0
    without repeated blocks: the model is then one unit) and ``root_bytes``
    (the parameters outside every block, which the root unit gathers for the
    whole forward and backward), and ``trained_tensors`` (the parameters the
    optimizer steps, each of which an offloaded step runs on its own)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = find_blocks(model)
    sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in blocks]
    return {"blocks": [n for n, _ in blocks], "largest_block_bytes": max(sizes, default=0), "root_bytes": total - sum(sizes),
            "trained_tensors": sum(1 for p in model.parameters() if p.requires_grad)}


def optimizer_settings(opt: torch.optim.Optimizer) -> dict:
    """``opt``'s settings, to build it again over the sharded parameters: the
    entries of its ``defaults`` its constructor takes (AdamW's defaults hold
    one that, in some torch versions, it does not)."""
    accepted = inspect.signature(type(opt).__init__).parameters
    return {k: v for k, v in opt.defaults.items() if k in accepted}


def _in_block(phase: str, blocks: list[str]) -> bool:
    """Whether a sample's phase (``backward Model.layers.3.mlp``) falls inside one of ``blocks``."""
    path = phase_module(phase).partition(".")[2]
    return bool(path) and any(path == b or path.startswith(b + ".") for b in blocks)


def _ceil_div(a: int, n: int) -> int:
    return -(-a // n)


class ZeRO(Strategy):
    """ZeRO stage ``stage`` over ``world_size`` ranks; ``offload``: shards and
    optimizer step on the host (stages 2 and 3)."""

    simulated = False  # one rank's step runs unsharded; adjust() shards it

    def __init__(self, stage: int, world_size: int, offload: bool = False) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
        if offload and stage == 1:
            raise ValueError(
                "offload=True needs ZeRO stage 2 or 3 (FSDP2's CPUOffloadPolicy); "
                "ZeroRedundancyOptimizer (stage 1) keeps its shard on the GPU"
            )
        self.stage, self.world_size, self.offload = stage, world_size, offload
        self.name = f"zero{stage}x{world_size}" + ("_offload" if offload else "")
        self.classes: list[str] = []  # the sharded blocks' classes (a wrapping policy names them)

    # -- for real ------------------------------------------------------------
    def apply(self, workload: Workload) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                f"{self.name} uses torch.distributed: start the ranks with torchrun and call "
                "torch.distributed.init_process_group() before applying it (world size 1 is fine)"
            )
        model, opt = workload.model, workload.optimizer
        if self.stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            workload.model = DistributedDataParallel(model, gradient_as_bucket_view=True)
            workload.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(opt), **optimizer_settings(opt))
        else:
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            kwargs = dict(reshard_after_forward=self.stage == 3, offload_policy=CPUOffloadPolicy() if self.offload else OffloadPolicy())
            for _, block in find_blocks(model):
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            workload.optimizer = type(opt)(model.parameters(), **optimizer_settings(opt))
        workload.applied.append(self.name)

    # -- simulated -----------------------------------------------------------
    def apply_simulated(self, workload: Workload) -> None:
        if self.stage >= 2:
            _check_shardable(workload.model)
        self.classes = sorted({type(b).__name__ for _, b in find_blocks(workload.model)})
        workload.applied.append(self.name)

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        door, n = Door.of(door), self.world_size
        policy = "{" + ", ".join(self.classes) + "}" if self.classes else "{<block class>}"
        if door is Door.LIGHTNING:
            if self.stage == 1 or (self.stage == 2 and self.offload):
                offload = ", offload_optimizer=True" if self.offload else ""
                return f"Trainer(devices={n}, strategy=DeepSpeedStrategy(stage={self.stage}{offload}))"
            sharding = "FULL_SHARD" if self.stage == 3 else "SHARD_GRAD_OP"
            offload = ", cpu_offload=True" if self.offload else ""
            return (f"Trainer(devices={n}, strategy=FSDPStrategy(sharding_strategy={sharding!r}, "
                    f"auto_wrap_policy={policy}{offload}))")
        if door is Door.HF:
            launch = f" under torchrun --nproc-per-node {n}"
            if self.stage == 1 or (self.stage == 2 and self.offload):
                offload = ', "offload_optimizer": {"device": "cpu"}' if self.offload else ""
                return f'TrainingArguments(deepspeed={{"zero_optimization": {{"stage": {self.stage}{offload}}}}}){launch}'
            how = ("full_shard" if self.stage == 3 else "shard_grad_op") + (" offload" if self.offload else "")
            return (f"TrainingArguments(fsdp={how + ' auto_wrap'!r}, fsdp_config={{'transformer_layer_cls_to_wrap': "
                    f"{sorted(self.classes) or ['<block class>']}}}){launch}")
        if self.stage == 1:
            how = "torch.distributed.optim.ZeroRedundancyOptimizer around the optimizer, under DistributedDataParallel"
        else:
            how = (f"torch.distributed.fsdp.fully_shard(block, reshard_after_forward={self.stage == 3}"
                   + (", offload_policy=CPUOffloadPolicy()" if self.offload else "") + ") on each block, then on the model")
        # The host's AdamW runs on the rank's threads: torchrun gives each one thread unless told.
        threads = " and OMP_NUM_THREADS set to the host's cores per rank" if self.offload else ""
        return (f"shard over {self.world_size} ranks (torchrun --nproc-per-node {self.world_size}{threads}) with {how} "
                "(Lightning: strategy='fsdp'; Hugging Face: fsdp='full_shard')")

    def adjust(self, prediction: Prediction, baseline: Report, gpu) -> Prediction:
        n = self.world_size
        if n == 1 and not self.offload:
            return prediction  # nothing to shard
        report = prediction.report if prediction.report is not None else baseline
        params = int(baseline.modules["parameters"].iloc[0])  # the root row: the whole model
        t = report.timeline
        last = t[t["step"] == t["step"].max()]
        # The optimizer's own temporaries fall after its sample (taken as it
        # starts); the step's peak shows them where no sample reaches it.
        step_peak = int(report.steps["peak_allocated"].iloc[-1])
        unsampled = len(last) > 0 and step_peak > int(last["interval_peak"].max())
        values, computing = [], False
        for s in last.to_dict("records"):  # rows as dicts: iterrows makes a Series per row
            kind = phase_kind(str(s["phase"]))
            # FSDP gathers from the first forward to the end of backward (the
            # loss between them runs outside the model, in phase "loss").
            computing = kind in _COMPUTING or computing and kind in (Phase.LOSS, Phase.ZERO_GRAD)
            values.append(self._bytes(s, kind, computing, params, baseline, step_peak if unsampled else 0))
        peak = max(values, default=step_peak)
        # The optimizers' matrix products (Muon's Newton-Schulz iterations), as the simulated step counted them.
        flops = int(report.meta.get("optimizer_flops", baseline.meta.get("optimizer_flops", 0)))
        moved, host = self._seconds(params, gpu, flops, int(baseline.meta.get("trained_tensors", 0)))
        return prediction.minus(prediction.peak_allocated - peak, moved + host, busy=moved)

    def _bytes(self, sample, kind: Phase | None, computing: bool, params: int, baseline: Report, step_peak: int) -> int:
        """This rank's peak bytes in the interval ending at ``sample`` (for the
        optimizer's sample, also in the step it starts, which peaks at ``step_peak`` when known)."""
        n = self.world_size
        b = {c: int(sample[c.value]) for c in _STATES}
        allocated, before = int(sample["allocated"]), int(sample["interval_peak"]) - int(sample["allocated"])
        if self.stage == 1:
            # DDP's buckets hold every gradient for the whole step; each rank keeps
            # (and steps) the optimizer state of 1/N of the parameters.
            extra = params - b[Category.GRADIENTS] + _ceil_div(b[Category.OPTIMIZER_STATE], n) - b[Category.OPTIMIZER_STATE]
            keep = 1
        else:
            keep = 0 if self.offload else 1
            extra = sum(keep * _ceil_div(v, n) - v for v in b.values())
        if kind is Phase.OPTIMIZER_STEP:  # everything resharded; the step runs on the shards (on the host with offload)
            during = max(step_peak - allocated, 0)
            return allocated + extra + max(before, keep * _ceil_div(during, n))
        if self.stage >= 2 and computing:
            block, root = int(baseline.meta.get("largest_block_bytes", 0)), int(baseline.meta.get("root_bytes", params))
            in_block = _in_block(str(sample["phase"]), baseline.meta.get("blocks", []))
            if self.stage == 2:
                extra += params
            else:  # a block is gathered while it computes; in backward the next one is prefetched
                extra += root + (2 if in_block and kind is Phase.BACKWARD else 1) * block
            if kind is Phase.BACKWARD and (in_block or not block):
                extra += block or params  # the block's gradients before their reduce-scatter
        return allocated + before + extra

    def _seconds(self, params: int, gpu, optimizer_flops: int = 0, tensors: int = 0) -> tuple[float, float]:
        """Seconds a step adds: moving parameters and gradients (the device's
        links), and the host's optimizer step with offload (the device idles):
        its bytes, its matrix products (``optimizer_flops``) at the host's rate,
        and its ``tensors`` (every rank steps a shard of each)."""
        n = self.world_size
        # Parameter volumes moved a step: DDP's all-reduce (2) and the optimizer's
        # broadcast (1) for stage 1; reduce-scatter + one all-gather (2) for stage
        # 2; + the backward's second all-gather (3) for stage 3; (N-1)/N of each.
        volumes = 2 if self.stage == 2 else 3
        seconds = volumes * params * (n - 1) / n / (gpu.nvlink_bandwidth or gpu.pcie_bandwidth)
        if self.offload:
            gathers = 2 if self.stage == 3 else 1
            shard = params / n
            link = gpu.pcie_bandwidth * TimeModel.link_efficiency
            seconds += (gathers + 1) * shard / link  # shards in, gradients out
            host = (shard / 4 * _HOST_ADAM_BYTES_PER_PARAM / _HOST_ADAM_RATE + tensors * _HOST_ADAM_SECONDS_PER_TENSOR
                    + optimizer_flops / n / _HOST_MATMUL_RATE)
            return seconds, host  # this rank's shard, on its threads
        return seconds, 0.0


def _check_shardable(model: nn.Module) -> None:
    """FSDP2 shards parameters along their first dimension and refuses a non-contiguous one
    (``fully_shard``: "FSDP does not support non-contiguous parameters yet"), and its backward
    reduces gradients by concatenating them, which a sparse gradient cannot be ("Could not run
    'fsdp::chunk_cat' with arguments from the 'SparseCPU' backend", likewise on CUDA): a plan that
    needs it fails here, as it would on the GPU, rather than being advised."""
    for name, m in model.named_modules():
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters(recurse=False)):
            raise ValueError(
                f"module {name or type(m).__name__} ({type(m).__name__}) makes sparse gradients (sparse=True), and "
                "FSDP2's fully_shard, which ZeRO-2/3 and state offload use, reduces dense gradients only: build it "
                "with sparse=False (and a dense optimizer) to shard it")
    for name, p in model.named_parameters():
        if not p.is_contiguous():
            layout = ("channels_last" if p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) else
                      "channels_last_3d" if p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d) else
                      f"strides {tuple(p.stride())}")
            raise ValueError(
                f"parameter {name} is not contiguous ({layout}), and FSDP2's fully_shard, which ZeRO-2/3 and state "
                "offload use, shards contiguous parameters only")


class StateOffload(ZeRO):
    """Parameters, gradients and optimizer state on the host; FSDP2 brings
    each block's parameters over for its forward and backward and the
    optimizer steps on the CPU: ZeRO-3 with offload on one rank. Needs an
    initialised ``torch.distributed`` process group (one rank is fine)."""

    def __init__(self) -> None:
        super().__init__(3, 1, offload=True)
        self.name = "offload_states"

    def code_change(self, facts=None, door: Door | str = Door.SCRIPT) -> str:
        if Door.of(door) is not Door.SCRIPT:
            return super().code_change(facts, door)  # ZeRO-3 with offload on one rank, in the trainer's terms
        return (
            "keep parameters, gradients and optimizer state on the host: torch.distributed.fsdp.fully_shard(block, "
            "offload_policy=CPUOffloadPolicy()) on each block, then on the model, in a one-rank process group"
        )
