"""The GPU catalogue: capacity, bandwidth and peak throughput of common training GPUs.

Units and conventions (the same for every entry):

* ``memory_bytes`` is the vendor's "N GB" read as N GiB (N * 2**30). GPU DRAM is
  built from power-of-two dies, and ``nvidia-smi`` shows e.g. 81920 MiB (= 80 GiB)
  for an A100 80GB and 24576 MiB for an RTX 3090. It is the *nominal* capacity:
  what ``torch.cuda.get_device_properties().total_memory`` reports is somewhat
  less (driver reservation; ECC carve-out on GDDR cards such as the L40S; an HGX
  B200 exposes ~180 GB of its 192 GB). Measured on an H200 (torch 2.11, CUDA 13):
  ``nvidia-smi`` memory.total 143771 MiB = 150,754,820,096 B, torch ``total_memory``
  150,109,880,320 B (139.8 GiB), against the catalogue's 141 GiB = 151,397,597,184 B
  (0.85 % over torch). For exact headroom on a live device use
  ``torch.cuda.mem_get_info()``.
* Bandwidths are bytes/s in decimal units, as vendors quote them (1 GB/s = 1e9 B/s).
  ``pcie_bandwidth`` and ``nvlink_bandwidth`` are *per direction*: NVIDIA's
  "900 GB/s NVLink" for H100 is both directions added, so 450e9 here.
  ``pcie_bandwidth`` is the link to the host: the nominal 16/32/64 GB/s of a x16
  PCIe link at gen 3/4/5 (after 128b/130b encoding ~15.75/31.5/63 GB/s; real copies
  reach less), half that for the x8 cards (RTX 4060, 4060 Ti), and NVLink-C2C on
  the GH200. ``nvlink_bandwidth`` is the GPU-to-GPU link: NVLink (a two-card bridge
  on the RTX 3090, A40 and RTX A6000; the PCIe H100s' bridge too), AMD Infinity
  Fabric on the MI300X; None where there is none.
* TFLOPS are *dense* tensor-core peaks (no 2:4 sparsity; datasheets that print
  "N*" with sparsity give N/2 here) with FP32 accumulation, the path mixed-precision
  training uses. GeForce cards (and the A10G) run FP32-accumulate at half their
  FP16-accumulate rate, and that half is the figure here (NVIDIA's architecture
  whitepapers print both); other data-centre and professional cards run both at
  the same rate. ``tf32_tflops`` is the dense TF32
  tensor-core rate (None before Ampere, which has no TF32); ``fp32_tflops`` is the
  non-tensor FP32 (CUDA-core / vector) peak. ``bf16`` is whether the tensor cores
  take bfloat16 (Ampere, compute capability 8.0, and later; CDNA 3 on AMD).
* ``segment`` is the product line: data-centre accelerators (including cloud-only
  parts such as the A10G and the H20 export part), professional workstation cards
  (RTX A6000, RTX 6000 Ada, RTX PRO 6000) and consumer GeForce cards.
* ``compute_capability`` is what ``torch.cuda.get_device_capability()`` reports on
  the device. memprof reads it to pick PyTorch's attention kernel
  (``memprof.sdpa``), the cuBLAS workspace size and whether TF32 and bfloat16
  exist, by NVIDIA's rules. The one AMD entry, ``MI300X-192GB``
  (``vendor=Vendor.AMD``), carries (9, 4): ROCm builds of torch report the gfx942
  architecture as major 9, minor 4. It is no NVIDIA SM, and NVIDIA's rules treat
  it like a Hopper-class GPU: bfloat16 and TF32 available, a fused attention
  kernel (cuDNN's, which saves what ROCm's flash attention saves: the output and
  one log-sum-exp per query row), Hopper's 32 MiB cuBLAS workspace. That is as
  close as those rules come; a simulation of it is approximate where ROCm's
  libraries (hipBLASLt, MIOpen, its attention kernels) size their memory
  differently.

Sources: the team notes in ``seeds/000`` (section 3.2 memory table, section 7 GPU
comparison), ``seeds/001`` (RTX 4090 figures, H100/H200 text) and ``seeds/003``
(RTX 3060, PCIe 4.0); anything they do not give comes from the vendors' public
datasheets and product pages (NVIDIA's product datasheets and the Ampere GA102, Ada
and RTX Blackwell architecture whitepapers; AMD's Instinct MI300X datasheet) and is
marked "datasheet" below; "derived" marks a rate computed from the datasheet's
units and clock (SMs x tensor FLOP/clock x boost clock) where the datasheet prints
only a sparse or FP8/FP4 figure. Entries named after the family alone ("H100-80GB",
"A100-80GB", "V100-32GB", "H200-141GB", "B200-192GB") are the SXM parts; the PCIe
and NVL versions of the H100 are separate entries.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import Enum

import pandas as pd

from .units import GiB

__all__ = ["GPU", "Segment", "Vendor", "CATALOGUE", "get_gpu", "detect_gpu", "list_gpus"]

_GB = 10**9  # decimal: bandwidth units as vendors quote them
_PCIE3, _PCIE4, _PCIE5 = 16 * _GB, 32 * _GB, 64 * _GB  # x16, per direction
_PCIE4_X8 = _PCIE4 // 2  # RTX 4060 / 4060 Ti: a x8 link


class Segment(str, Enum):
    """The product line a GPU belongs to; ``memprof gpus`` groups by it, in this order."""

    DATACENTER = "datacenter"
    WORKSTATION = "workstation"
    CONSUMER = "consumer"

    def __str__(self) -> str:
        return self.value


class Vendor(str, Enum):
    """Who makes the GPU: ``compute_capability`` is an NVIDIA SM only for NVIDIA parts."""

    NVIDIA = "nvidia"
    AMD = "amd"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GPU:
    """One GPU model. Bytes are ints; rates are bytes/s; throughput is dense TFLOPS."""

    name: str
    memory_bytes: int
    memory_bandwidth: int
    bf16: bool
    fp16_tflops: float | None
    bf16_tflops: float | None
    fp32_tflops: float
    pcie_bandwidth: int
    nvlink_bandwidth: int | None
    compute_capability: tuple[int, int]
    #: Streaming multiprocessors (datasheet), as ``get_device_properties().multi_processor_count`` reports them
    #: (compute units on AMD).
    multiprocessors: int | None = None
    #: Dense TF32 tensor-core TFLOPS; None before Ampere (and for a GPU built outside the catalogue).
    tf32_tflops: float | None = None
    segment: Segment = Segment.DATACENTER
    vendor: Vendor = Vendor.NVIDIA


_DC, _WS, _CONSUMER = Segment.DATACENTER, Segment.WORKSTATION, Segment.CONSUMER


def _gpu(name, mem_gib, bw_gbps, fp16, bf16, tf32, fp32, pcie, nvlink_total_gbps, cc, sms, segment,
         vendor=Vendor.NVIDIA) -> GPU:
    """Build an entry from datasheet units (GiB, GB/s, bidirectional NVLink GB/s)."""
    return GPU(
        name=name,
        memory_bytes=mem_gib * GiB,
        memory_bandwidth=round(bw_gbps * _GB),
        bf16=bf16 is not None,
        fp16_tflops=fp16,
        bf16_tflops=bf16,
        fp32_tflops=fp32,
        pcie_bandwidth=pcie,
        nvlink_bandwidth=None if nvlink_total_gbps is None else int(nvlink_total_gbps * _GB) // 2,
        compute_capability=cc,
        multiprocessors=sms,
        tf32_tflops=tf32,
        segment=segment,
        vendor=vendor,
    )


# The first ten entries keep their order (error messages list the names in it); the
# others follow by segment. Columns: name, GiB, GB/s, FP16, BF16, TF32, FP32 TFLOPS,
# host link, NVLink GB/s both directions, compute capability, SMs, segment.
CATALOGUE: dict[str, GPU] = {
    g.name: g
    for g in (
        # V100 SXM2: seed 000 s.7 (32 GB, 900 GB/s, 125 TFLOPS). FP32 15.7, NVLink 2.0
        # 300 GB/s, PCIe 3.0: datasheet. No BF16 or TF32 before Ampere (seed 000 s.4.2).
        _gpu("V100-32GB", 32, 900, 125.0, None, None, 15.7, _PCIE3, 300, (7, 0), 80, _DC),
        # A100 SXM4 40GB: not in the seeds; datasheet (1,555 GB/s, 312 TFLOPS, TF32 156).
        _gpu("A100-40GB", 40, 1555, 312.0, 312.0, 156.0, 19.5, _PCIE4, 600, (8, 0), 108, _DC),
        # A100 SXM4 80GB: seed 000 s.7 (2,039 GB/s, 312). FP32 19.5, TF32 156, NVLink 600: datasheet.
        _gpu("A100-80GB", 80, 2039, 312.0, 312.0, 156.0, 19.5, _PCIE4, 600, (8, 0), 108, _DC),
        # H100 SXM5: seed 000 s.4.3/s.7 (3,350 GB/s, 989 dense, FP32 67), NVLink 4 900 GB/s
        # (seed 000 s.9.1). Seed 001 once says "494 dense / 989 sparse": that is TF32
        # (datasheet 989* with sparsity, so 494.5).
        _gpu("H100-80GB", 80, 3350, 989.0, 989.0, 494.5, 67.0, _PCIE5, 900, (9, 0), 132, _DC),
        # H200 SXM: seed 000 s.7 and seed 001 (141 GB, 4,800 GB/s, 989). TF32 as H100: datasheet.
        _gpu("H200-141GB", 141, 4800, 989.0, 989.0, 494.5, 67.0, _PCIE5, 900, (9, 0), 132, _DC),
        # B200 (HGX, 1000 W): seed 000 s.7 (192 GB, 8,000 GB/s, 2,250), NVLink 5 1,800 GB/s
        # (s.9.1). FP32 80: datasheet; TF32 1,125 (HGX B200 datasheet: 18 PFLOPS* for 8 GPUs).
        # Host links run at PCIe 5.0 on HGX B200 boards.
        _gpu("B200-192GB", 192, 8000, 2250.0, 2250.0, 1125.0, 80.0, _PCIE5, 1800, (10, 0), 148, _DC),
        # L40S: seed 000 s.7 (48 GB, 864 GB/s, 366). Datasheet prints 362.05 dense;
        # TF32 183 (366*), FP32 91.6, PCIe 4.0, no NVLink: datasheet.
        _gpu("L40S-48GB", 48, 864, 366.0, 366.0, 183.0, 91.6, _PCIE4, None, (8, 9), 142, _DC),
        # RTX 4090: seed 000 s.3.2 (1,008 GB/s), seed 001 (165 TFLOPS FP16 tensor).
        # FP32 82.6, TF32 82.6: datasheet (Ada whitepaper). FP32-accumulate at half the FP16 rate.
        _gpu("RTX4090-24GB", 24, 1008, 165.2, 165.2, 82.6, 82.6, _PCIE4, None, (8, 9), 128, _CONSUMER),
        # RTX 3090: datasheet throughout (GA102 whitepaper: 936 GB/s, 71 TFLOPS FP32-acc,
        # TF32 35.6, FP32 35.6); NVLink bridge 112.5 GB/s both directions.
        _gpu("RTX3090-24GB", 24, 936, 71.0, 71.0, 35.6, 35.6, _PCIE4, 112.5, (8, 6), 82, _CONSUMER),
        # RTX 3060 12GB: seed 003 s.1.2 (12 GB, 360 GB/s); 25.5 TFLOPS FP32-acc
        # (28 SMs x 512 FLOP/clk x 1.78 GHz), TF32 12.7 and FP32 12.7: datasheet / derived.
        _gpu("RTX3060-12GB", 12, 360, 25.5, 25.5, 12.7, 12.7, _PCIE4, None, (8, 6), 28, _CONSUMER),

        # -- data centre -------------------------------------------------------------
        # V100 SXM2 16GB: datasheet, the V100-32GB's figures with half the memory.
        _gpu("V100-16GB", 16, 900, 125.0, None, None, 15.7, _PCIE3, 300, (7, 0), 80, _DC),
        # T4 (Turing): datasheet: 16 GB GDDR6 at 320 GB/s (256-bit x 10 Gbps; the product
        # page says "320+ GB/s"), 65 TFLOPS mixed precision FP16/FP32, FP32 8.1, PCIe 3.0 x16.
        # No BF16 or TF32 (compute capability 7.5).
        _gpu("T4-16GB", 16, 320, 65.0, None, None, 8.1, _PCIE3, None, (7, 5), 40, _DC),
        # L4 (Ada): datasheet: 24 GB at 300 GB/s, FP32 30.3, TF32 120*, FP16/BF16 242*, PCIe 4.0.
        _gpu("L4-24GB", 24, 300, 121.0, 121.0, 60.0, 30.3, _PCIE4, None, (8, 9), 58, _DC),
        # A10 (Ampere GA102): datasheet: 24 GB at 600 GB/s, FP32 31.2, TF32 62.5, BF16/FP16 125, PCIe 4.0.
        _gpu("A10-24GB", 24, 600, 125.0, 125.0, 62.5, 31.2, _PCIE4, None, (8, 6), 72, _DC),
        # A10G (the AWS G5 part; NVIDIA publishes no datasheet): 24 GB at 600 GB/s as the A10;
        # 80 SMs at 1.71 GHz give FP32 35; its tensor cores run FP32-accumulate at half the
        # FP16-accumulate rate, as GeForce cards do: BF16/FP16 70, TF32 35 (the figures
        # published for G5 instances).
        _gpu("A10G-24GB", 24, 600, 70.0, 70.0, 35.0, 35.0, _PCIE4, None, (8, 6), 80, _DC),
        # A40 (Ampere GA102): datasheet: 48 GB at 696 GB/s, FP32 37.4, TF32 74.8,
        # BF16/FP16 149.7 with FP32 accumulate, NVLink bridge 112.5 GB/s bidirectional, PCIe 4.0.
        _gpu("A40-48GB", 48, 696, 149.7, 149.7, 74.8, 37.4, _PCIE4, 112.5, (8, 6), 84, _DC),
        # H100 PCIe: datasheet: 80 GB HBM2e at 2,000 GB/s, FP32 51, TF32 756*, BF16/FP16 1,513*,
        # NVLink bridge 600 GB/s, PCIe 5.0; 114 SMs.
        _gpu("H100PCIe-80GB", 80, 2000, 756.5, 756.5, 378.0, 51.0, _PCIE5, 600, (9, 0), 114, _DC),
        # H100 NVL: datasheet: 94 GB HBM3 at 3,900 GB/s, FP32 60, TF32 835*, BF16/FP16 1,671*,
        # NVLink bridge 600 GB/s, PCIe 5.0.
        _gpu("H100NVL-94GB", 94, 3900, 835.5, 835.5, 417.5, 60.0, _PCIE5, 600, (9, 0), 132, _DC),
        # GH200 (the Hopper GPU of the Grace Hopper superchip, 96 GB HBM3 version): datasheet:
        # 4,000 GB/s, FP32 67, TF32 494, BF16/FP16 990 dense, NVLink 900 GB/s. Its host link is
        # NVLink-C2C to the Grace CPU, 900 GB/s both directions, so 450 GB/s each way.
        _gpu("GH200-96GB", 96, 4000, 990.0, 990.0, 494.0, 67.0, 450 * _GB, 900, (9, 0), 132, _DC),
        # H20 (Hopper export part): NVIDIA's H20 specification: 96 GB HBM3 at 4,000 GB/s,
        # BF16/FP16 148, TF32 74, FP32 44 (dense), NVLink 900 GB/s, PCIe 5.0. SM count unpublished.
        _gpu("H20-96GB", 96, 4000, 148.0, 148.0, 74.0, 44.0, _PCIE5, 900, (9, 0), None, _DC),
        # MI300X (AMD CDNA 3, OAM): AMD datasheet: 192 GB HBM3 at 5.3 TB/s, 304 compute units,
        # FP16/BF16 1,307.4 and TF32 653.7 dense, FP32 vector 163.4, PCIe 5.0 x16, 7 Infinity
        # Fabric links of 128 GB/s (896 GB/s both directions). Compute capability: module docstring.
        _gpu("MI300X-192GB", 192, 5300, 1307.4, 1307.4, 653.7, 163.4, _PCIE5, 896, (9, 4), 304, _DC,
             Vendor.AMD),

        # -- workstation -------------------------------------------------------------
        # RTX A6000 (Ampere GA102): datasheet: 48 GB at 768 GB/s, FP32 38.7, tensor 309.7*
        # (so FP16/BF16 154.8 dense, full-rate FP32 accumulate as on the A40; TF32 77.4 derived),
        # NVLink bridge 112.5 GB/s bidirectional, PCIe 4.0.
        _gpu("RTXA6000-48GB", 48, 768, 154.8, 154.8, 77.4, 38.7, _PCIE4, 112.5, (8, 6), 84, _WS),
        # RTX 6000 Ada: datasheet: 48 GB at 960 GB/s, FP32 91.1, tensor 1,457 (FP8 with
        # sparsity); Ada whitepaper: FP16/BF16 with FP32 accumulate 364.2, TF32 182.1. PCIe 4.0.
        _gpu("RTX6000Ada-48GB", 48, 960, 364.2, 364.2, 182.1, 91.1, _PCIE4, None, (8, 9), 142, _WS),
        # RTX PRO 6000 Blackwell (Workstation Edition): datasheet: 96 GB GDDR7 at 1,792 GB/s,
        # 188 SMs, FP32 125, 4,000 AI TOPS (FP4 with sparsity), so FP16/BF16 500 dense (derived,
        # full-rate FP32 accumulate as on the professional Ada cards) and TF32 250. PCIe 5.0.
        _gpu("RTXPRO6000-96GB", 96, 1792, 500.0, 500.0, 250.0, 125.0, _PCIE5, None, (12, 0), 188, _WS),

        # -- consumer (GeForce; FP32-accumulate at half the FP16-accumulate rate) ---------
        # RTX 3080 10GB: GA102 whitepaper: 760 GB/s, FP16 (FP32 acc) 59.5, TF32 29.8, FP32 29.8.
        _gpu("RTX3080-10GB", 10, 760, 59.5, 59.5, 29.8, 29.8, _PCIE4, None, (8, 6), 68, _CONSUMER),
        # RTX 4060: datasheet: 8 GB at 272 GB/s, 242 AI TOPS (FP8*) so FP16 60.5 with FP16
        # accumulate, 30.2 with FP32; FP32 15.1; PCIe 4.0 x8.
        _gpu("RTX4060-8GB", 8, 272, 30.2, 30.2, 15.1, 15.1, _PCIE4_X8, None, (8, 9), 24, _CONSUMER),
        # RTX 4060 Ti 16GB: datasheet: 288 GB/s, 353 AI TOPS: FP16 (FP32 acc) 44.1, TF32 22.1,
        # FP32 22.1; PCIe 4.0 x8.
        _gpu("RTX4060Ti-16GB", 16, 288, 44.1, 44.1, 22.1, 22.1, _PCIE4_X8, None, (8, 9), 34, _CONSUMER),
        # RTX 4070: datasheet: 12 GB at 504 GB/s, 466 AI TOPS: FP16 (FP32 acc) 58.3, TF32 29.1, FP32 29.1.
        _gpu("RTX4070-12GB", 12, 504, 58.3, 58.3, 29.1, 29.1, _PCIE4, None, (8, 9), 46, _CONSUMER),
        # RTX 4070 Ti SUPER: datasheet: 16 GB at 672 GB/s, 706 AI TOPS: FP16 (FP32 acc) 88.2,
        # TF32 44.1, FP32 44.1.
        _gpu("RTX4070TiSuper-16GB", 16, 672, 88.2, 88.2, 44.1, 44.1, _PCIE4, None, (8, 9), 66, _CONSUMER),
        # RTX 4080: Ada whitepaper: 16 GB at 716.8 GB/s, FP16 (FP32 acc) 97.5, TF32 48.7, FP32 48.7.
        _gpu("RTX4080-16GB", 16, 716.8, 97.5, 97.5, 48.7, 48.7, _PCIE4, None, (8, 9), 76, _CONSUMER),
        # RTX 5080: datasheet: 16 GB GDDR7 at 960 GB/s, 1,801 AI TOPS (FP4*): FP16 225.1 with
        # FP16 accumulate, 112.6 with FP32; TF32 56.3, FP32 56.3 (derived, 84 SMs at 2.62 GHz); PCIe 5.0.
        _gpu("RTX5080-16GB", 16, 960, 112.6, 112.6, 56.3, 56.3, _PCIE5, None, (12, 0), 84, _CONSUMER),
        # RTX 5090: datasheet: 32 GB GDDR7 at 1,792 GB/s, 3,352 AI TOPS (FP4*), FP16 838* with
        # FP16 accumulate: 209.5 dense with FP32; TF32 104.8, FP32 104.8 (170 SMs at 2.41 GHz); PCIe 5.0.
        _gpu("RTX5090-32GB", 32, 1792, 209.5, 209.5, 104.8, 104.8, _PCIE5, None, (12, 0), 170, _CONSUMER),
    )
}


def _norm(s: str) -> str:
    """'NVIDIA GeForce RTX-4090' -> 'RTX4090': upper case, alphanumerics, no vendor words."""
    s = re.sub(r"[^A-Z0-9]", "", s.upper())
    for prefix in ("NVIDIA", "GEFORCE", "TESLA", "AMD", "INSTINCT"):
        s = s.removeprefix(prefix)
    return s


def _family(gpu: GPU) -> str:
    """'RTX4070TiSuper-16GB' -> '4070TISUPER': the model as the words of a device name spell it."""
    return gpu.name.split("-")[0].upper().removeprefix("RTX")


def _aliases(gpu: GPU) -> set[str]:
    """'RTX4090-24GB' -> RTX4090, 4090, RTX409024GB, 409024GB, RTX409024, 409024 (upper case)."""
    family, size = gpu.name.upper().split("-")  # "RTX4090", "24GB"
    forms = {family, family.removeprefix("RTX")}
    return {f + suffix for f in forms for suffix in ("", size, size.removesuffix("GB"))}


def _alias_table() -> dict[str, list[str]]:
    """Normalised alias -> canonical names; a list longer than one is ambiguous."""
    table: dict[str, list[str]] = {}
    for gpu in CATALOGUE.values():
        for alias in _aliases(gpu):
            table.setdefault(alias, []).append(gpu.name)
    return table


_ALIASES = _alias_table()


def get_gpu(name: str | GPU) -> GPU:
    """Look up a catalogue entry by canonical name or a forgiving alias.

    Case, spaces, '-' and '_' are ignored, as are the leading words
    NVIDIA/GeForce/Tesla and AMD/Instinct: ``"h100"``, ``"H100-80GB"``,
    ``"a100-40gb"``, ``"rtx4090"``, ``"4090"``, ``"rtx-4090"``, ``"t4"``,
    ``"4070 ti super"``, ``"rtx 6000 ada"`` and ``"mi300x"`` all work. A family with
    several sizes (``"a100"``, ``"v100"``) is ambiguous and raises, listing the
    candidates.
    """
    if isinstance(name, GPU):  # already resolved: lets callers accept either
        return name
    matches = _ALIASES.get(_norm(name)) if isinstance(name, str) else None
    if not matches:
        raise ValueError(
            f"unknown GPU {name!r}; valid names: {', '.join(CATALOGUE)} "
            "(case-insensitive; short forms such as 'h100' or '4090' also work)"
        )
    if len(matches) > 1:
        raise ValueError(
            f"GPU name {name!r} is ambiguous: it matches {', '.join(matches)}; "
            "pass one of those names"
        )
    return CATALOGUE[matches[0]]


# Words in a device name that mean a different product from a catalogue entry whose
# family does not spell them (3060 Ti, 4070 SUPER, 4090 D, laptop parts, the PCIe/NVL
# versions of SXM data-centre cards): "RTX4070TiSuper" spells TI and SUPER, "RTX4070"
# does not, so "NVIDIA GeForce RTX 4070 Ti SUPER" is the one and not the other.
_OTHER_VARIANT = {"TI", "SUPER", "D", "LAPTOP", "MOBILE", "PCIE", "NVL"}


def _spelled_by(words: list[str], family: str) -> tuple[int, int] | None:
    """Where consecutive ``words`` join into ``family`` (``[6000, ADA]`` for '6000ADA'), as a slice."""
    for i in range(len(words)):
        joined = ""
        for j in range(i, len(words)):
            joined += words[j]
            if joined == family:
                return i, j + 1
            if not family.startswith(joined):
                break
    return None


def _match_device(device_name: str, total_memory: int) -> GPU | None:
    """Catalogue entry for a CUDA device name, sizes told apart by ``total_memory``.

    A GPU matches when whole words of the name spell its family ("NVIDIA RTX 6000 Ada
    Generation" spells 6000ADA, "Tesla T4" T4, "NVIDIA GH200 480GB" GH200 but not
    H200) and no other word of the name marks another variant.
    """
    words = re.findall(r"[A-Z0-9]+", device_name.upper())
    candidates = []
    for g in CATALOGUE.values():
        span = _spelled_by(words, _family(g))
        if span is not None and not set(words[:span[0]] + words[span[1]:]) & _OTHER_VARIANT:
            candidates.append(g)
    if not candidates:
        return None
    best = min(candidates, key=lambda g: abs(g.memory_bytes - total_memory))
    # total_memory runs 0.5-7 % under the nominal size (see module docstring); a bigger
    # gap is another memory variant (an 8 GB RTX 3060) that the catalogue lacks.
    return best if abs(best.memory_bytes - total_memory) <= 0.10 * best.memory_bytes else None


def detect_gpu(device: int = 0) -> GPU | None:
    """The catalogue entry for CUDA device ``device``, or None (no CUDA, or not catalogued).

    Matches ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090", "Tesla T4", and on ROCm
    "AMD Instinct MI300X") and uses the reported
    capacity to tell memory sizes apart. The entry returned holds nominal specs;
    the live device's capacity is ``torch.cuda.get_device_properties().total_memory``.
    """
    import torch  # local: the catalogue itself needs no torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return _match_device(torch.cuda.get_device_name(device), props.total_memory)


def list_gpus() -> pd.DataFrame:
    """The catalogue as a table, one row per GPU indexed by name.

    Raw integer fields are kept; ``memory_gib`` (bytes / 2**30) and the ``*_gb_s``
    columns (bytes/s / 1e9) are added for display only. ``segment`` and ``vendor``
    hold the enums' string values ("datacenter", "nvidia", ...); a rate a GPU lacks
    (``bf16_tflops``, ``tf32_tflops``) is NaN.
    """
    df = pd.DataFrame([asdict(g) for g in CATALOGUE.values()]).set_index("name")
    df.insert(1, "memory_gib", df["memory_bytes"] / GiB)
    for col in ("nvlink_bandwidth", "multiprocessors"):
        df[col] = df[col].astype("Int64")  # None -> <NA>, not NaN
    for col in ("segment", "vendor"):
        df[col] = df[col].map(str)
    for src, col in (("memory_bandwidth", "mem_gb_s"), ("pcie_bandwidth", "pcie_gb_s"),
                     ("nvlink_bandwidth", "nvlink_gb_s")):
        df[col] = df[src] / _GB
    return df
