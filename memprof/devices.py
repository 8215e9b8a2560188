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
  PCIe figures are the nominal 16/32/64 GB/s of a x16 link at gen 3/4/5 (after
  128b/130b encoding ~15.75/31.5/63 GB/s; real copies reach less).
* TFLOPS are *dense* tensor-core peaks (no 2:4 sparsity) with FP32 accumulation,
  the path mixed-precision training uses; ``fp32_tflops`` is the non-tensor FP32
  (CUDA-core) peak.

Sources: the team notes in ``seeds/000`` (section 3.2 memory table, section 7 GPU
comparison), ``seeds/001`` (RTX 4090 figures, H100/H200 text) and ``seeds/003``
(RTX 3060, PCIe 4.0); anything they do not give comes from NVIDIA's public
datasheets and is marked "datasheet" below. Data-centre entries are the SXM parts
the seeds describe, not the PCIe/NVL variants.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import pandas as pd

from .units import GiB

__all__ = ["GPU", "CATALOGUE", "get_gpu", "detect_gpu", "list_gpus"]

_GB = 10**9  # decimal: bandwidth units as vendors quote them
_PCIE3, _PCIE4, _PCIE5 = 16 * _GB, 32 * _GB, 64 * _GB  # x16, per direction


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
    #: Streaming multiprocessors (datasheet), as ``get_device_properties().multi_processor_count`` reports them.
    multiprocessors: int | None = None


def _gpu(name, mem_gib, bw_gbps, fp16, bf16, fp32, pcie, nvlink_total_gbps, cc, sms=None) -> GPU:
    """Build an entry from datasheet units (GiB, GB/s, bidirectional NVLink GB/s)."""
    return GPU(
        name=name,
        memory_bytes=mem_gib * GiB,
        memory_bandwidth=int(bw_gbps * _GB),
        bf16=bf16 is not None,
        fp16_tflops=fp16,
        bf16_tflops=bf16,
        fp32_tflops=fp32,
        pcie_bandwidth=pcie,
        nvlink_bandwidth=None if nvlink_total_gbps is None else int(nvlink_total_gbps * _GB) // 2,
        compute_capability=cc,
        multiprocessors=sms,
    )


CATALOGUE: dict[str, GPU] = {
    g.name: g
    for g in (
        # V100 SXM2: seed 000 s.7 (32 GB, 900 GB/s, 125 TFLOPS). FP32 15.7, NVLink 2.0
        # 300 GB/s, PCIe 3.0: datasheet. No BF16 before Ampere (seed 000 s.4.2).
        _gpu("V100-32GB", 32, 900, 125.0, None, 15.7, _PCIE3, 300, (7, 0), sms=80),
        # A100 SXM4 40GB: not in the seeds; datasheet (1,555 GB/s, 312 TFLOPS).
        _gpu("A100-40GB", 40, 1555, 312.0, 312.0, 19.5, _PCIE4, 600, (8, 0), sms=108),
        # A100 SXM4 80GB: seed 000 s.7 (2,039 GB/s, 312). FP32 19.5, NVLink 600: datasheet.
        _gpu("A100-80GB", 80, 2039, 312.0, 312.0, 19.5, _PCIE4, 600, (8, 0), sms=108),
        # H100 SXM5: seed 000 s.4.3/s.7 (3,350 GB/s, 989 dense, FP32 67), NVLink 4 900 GB/s
        # (seed 000 s.9.1). Seed 001 once says "494 dense / 989 sparse": that is TF32.
        _gpu("H100-80GB", 80, 3350, 989.0, 989.0, 67.0, _PCIE5, 900, (9, 0), sms=132),
        # H200 SXM: seed 000 s.7 and seed 001 (141 GB, 4,800 GB/s, 989).
        _gpu("H200-141GB", 141, 4800, 989.0, 989.0, 67.0, _PCIE5, 900, (9, 0), sms=132),
        # B200 (HGX, 1000 W): seed 000 s.7 (192 GB, 8,000 GB/s, 2,250), NVLink 5 1,800 GB/s
        # (s.9.1). FP32 80: datasheet. Host links run at PCIe 5.0 on HGX B200 boards.
        _gpu("B200-192GB", 192, 8000, 2250.0, 2250.0, 80.0, _PCIE5, 1800, (10, 0), sms=148),
        # L40S: seed 000 s.7 (48 GB, 864 GB/s, 366). Datasheet prints 362.05 dense;
        # FP32 91.6, PCIe 4.0, no NVLink: datasheet.
        _gpu("L40S-48GB", 48, 864, 366.0, 366.0, 91.6, _PCIE4, None, (8, 9), sms=142),
        # RTX 4090: seed 000 s.3.2 (1,008 GB/s), seed 001 (165 TFLOPS FP16 tensor).
        # FP32 82.6: datasheet. GeForce cards run FP32-accumulate at half the FP16 rate.
        _gpu("RTX4090-24GB", 24, 1008, 165.2, 165.2, 82.6, _PCIE4, None, (8, 9), sms=128),
        # RTX 3090: datasheet throughout (936 GB/s, 71 TFLOPS FP32-acc, 35.6 FP32);
        # NVLink bridge 112.5 GB/s both directions.
        _gpu("RTX3090-24GB", 24, 936, 71.0, 71.0, 35.6, _PCIE4, 112.5, (8, 6), sms=82),
        # RTX 3060 12GB: seed 003 s.1.2 (12 GB, 360 GB/s); 25.5 TFLOPS FP32-acc
        # (28 SMs x 512 FLOP/clk x 1.78 GHz) and FP32 12.7: datasheet.
        _gpu("RTX3060-12GB", 12, 360, 25.5, 25.5, 12.7, _PCIE4, None, (8, 6), sms=28),
    )
}


def _norm(s: str) -> str:
    """'NVIDIA GeForce RTX-4090' -> 'RTX4090': upper case, alphanumerics, no vendor words."""
    s = re.sub(r"[^A-Z0-9]", "", s.upper())
    for prefix in ("NVIDIA", "GEFORCE", "TESLA"):
        s = s.removeprefix(prefix)
    return s


def _aliases(gpu: GPU) -> set[str]:
    """'RTX4090-24GB' -> RTX4090, 4090, RTX409024GB, 409024GB, RTX409024, 409024."""
    family, size = gpu.name.split("-")  # "RTX4090", "24GB"
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

    Case, spaces, '-' and '_' are ignored, as are the words NVIDIA/GeForce/Tesla:
    ``"h100"``, ``"H100-80GB"``, ``"a100-40gb"``, ``"rtx4090"``, ``"4090"`` and
    ``"rtx-4090"`` all work. A family with several sizes (``"a100"``) is ambiguous
    and raises, listing the candidates.
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


# Words in a device name that mean a different product from our catalogue entry
# (3060 Ti, 4090 D, laptop parts, the PCIe/NVL versions of SXM data-centre cards).
_OTHER_VARIANT = {"TI", "SUPER", "D", "LAPTOP", "MOBILE", "PCIE", "NVL"}


def _match_device(device_name: str, total_memory: int) -> GPU | None:
    """Catalogue entry for a CUDA device name, sizes told apart by ``total_memory``."""
    words = set(re.findall(r"[A-Z0-9]+", device_name.upper()))
    if words & _OTHER_VARIANT:
        return None
    candidates = [g for g in CATALOGUE.values() if g.name.split("-")[0].removeprefix("RTX") in words]
    if not candidates:
        return None
    best = min(candidates, key=lambda g: abs(g.memory_bytes - total_memory))
    # total_memory runs 0.5-7 % under the nominal size (see module docstring); a bigger
    # gap is another memory variant (an 8 GB RTX 3060) that the catalogue lacks.
    return best if abs(best.memory_bytes - total_memory) <= 0.10 * best.memory_bytes else None


def detect_gpu(device: int = 0) -> GPU | None:
    """The catalogue entry for CUDA device ``device``, or None (no CUDA, or not catalogued).

    Matches ``torch.cuda.get_device_name()`` (e.g. "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090") and uses the reported
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
    columns (bytes/s / 1e9) are added for display only.
    """
    df = pd.DataFrame([asdict(g) for g in CATALOGUE.values()]).set_index("name")
    df.insert(1, "memory_gib", df["memory_bytes"] / GiB)
    df["nvlink_bandwidth"] = df["nvlink_bandwidth"].astype("Int64")  # None -> <NA>, not NaN
    for src, col in (("memory_bandwidth", "mem_gb_s"), ("pcie_bandwidth", "pcie_gb_s"),
                     ("nvlink_bandwidth", "nvlink_gb_s")):
        df[col] = df[src] / _GB
    return df
