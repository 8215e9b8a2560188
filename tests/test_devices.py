"""The GPU catalogue: seed and datasheet figures, name lookup, device matching, table."""

import pandas as pd
import pytest
import torch

from memprof.cli import main
from memprof.devices import (
    _ALIASES, CATALOGUE, GPU, Segment, Vendor, _family, _match_device, detect_gpu, get_gpu, list_gpus,
)

GiB = 2**30
GB = 10**9


def test_catalogue_is_keyed_by_canonical_name():
    assert list(CATALOGUE) == [
        "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB",
        "B200-192GB", "L40S-48GB", "RTX4090-24GB", "RTX3090-24GB", "RTX3060-12GB",
        # data centre
        "V100-16GB", "T4-16GB", "L4-24GB", "A10-24GB", "A10G-24GB", "A40-48GB", "H100PCIe-80GB",
        "H100NVL-94GB", "GH200-96GB", "H20-96GB", "MI300X-192GB",
        # workstation
        "RTXA6000-48GB", "RTX6000Ada-48GB", "RTXPRO6000-96GB",
        # consumer
        "RTX3080-10GB", "RTX4060-8GB", "RTX4060Ti-16GB", "RTX4070-12GB", "RTX4070TiSuper-16GB",
        "RTX4080-16GB", "RTX5080-16GB", "RTX5090-32GB",
    ]
    assert all(name == gpu.name for name, gpu in CATALOGUE.items())
    assert all(isinstance(g.memory_bytes, int) and isinstance(g.memory_bandwidth, int)
               for g in CATALOGUE.values())
    # FAMILY-SIZEGB, the size matching the capacity: what the aliases are built from.
    for g in CATALOGUE.values():
        family, size = g.name.split("-")
        assert family.isalnum() and size == f"{g.memory_bytes // GiB}GB"


def test_catalogue_covers_every_segment():
    assert len(CATALOGUE) >= 25
    by_segment = {s: [g.name for g in CATALOGUE.values() if g.segment is s] for s in Segment}
    assert all(by_segment.values()), by_segment
    assert {"T4-16GB", "L4-24GB", "A10G-24GB", "H20-96GB", "MI300X-192GB"} <= set(by_segment[Segment.DATACENTER])
    assert {"RTXA6000-48GB", "RTX6000Ada-48GB"} <= set(by_segment[Segment.WORKSTATION])
    assert {"RTX3060-12GB", "RTX4090-24GB", "RTX5090-32GB"} <= set(by_segment[Segment.CONSUMER])
    assert [Segment(s) for s in ("datacenter", "workstation", "consumer")] == list(Segment)


@pytest.mark.parametrize("gpu", CATALOGUE.values(), ids=list(CATALOGUE))
def test_every_entry_has_positive_figures(gpu):
    assert gpu.memory_bytes > 0 and gpu.memory_bandwidth > 0 and gpu.pcie_bandwidth > 0
    assert gpu.fp16_tflops > 0 and gpu.fp32_tflops > 0
    assert gpu.nvlink_bandwidth is None or gpu.nvlink_bandwidth > 0
    assert gpu.multiprocessors is None or gpu.multiprocessors > 0
    for rate in (gpu.bf16_tflops, gpu.tf32_tflops):
        assert rate is None or 0 < rate <= gpu.fp16_tflops
    # Tensor cores outrun the CUDA cores at 16 bits; TF32 runs at half the 16-bit rate.
    assert gpu.fp16_tflops > gpu.fp32_tflops
    if gpu.tf32_tflops is not None:
        assert gpu.tf32_tflops == pytest.approx(gpu.fp16_tflops / 2, rel=0.01)
    assert isinstance(gpu.segment, Segment) and isinstance(gpu.vendor, Vendor)


def test_bf16_and_tf32_arrived_together_on_nvidia():
    for gpu in CATALOGUE.values():
        if gpu.vendor is Vendor.NVIDIA:
            assert gpu.bf16 == (gpu.tf32_tflops is not None), gpu.name
    for name in ("V100-32GB", "V100-16GB", "T4-16GB"):  # Volta 7.0, Turing 7.5
        gpu = CATALOGUE[name]
        assert not gpu.bf16 and gpu.bf16_tflops is None and gpu.tf32_tflops is None


@pytest.mark.parametrize(
    "name, gib, bandwidth_gb_s, fp16, tf32, fp32",
    [   # vendors' datasheets (dense: half the "with sparsity" figures)
        ("T4-16GB", 16, 320, 65, None, 8.1),
        ("L4-24GB", 24, 300, 121, 60, 30.3),
        ("A10-24GB", 24, 600, 125, 62.5, 31.2),
        ("A40-48GB", 48, 696, 149.7, 74.8, 37.4),
        ("H100PCIe-80GB", 80, 2000, 756.5, 378, 51),
        ("H20-96GB", 96, 4000, 148, 74, 44),
        ("GH200-96GB", 96, 4000, 990, 494, 67),
        ("MI300X-192GB", 192, 5300, 1307.4, 653.7, 163.4),
        ("RTXA6000-48GB", 48, 768, 154.8, 77.4, 38.7),
        ("RTX6000Ada-48GB", 48, 960, 364.2, 182.1, 91.1),
        ("RTX4080-16GB", 16, 716.8, 97.5, 48.7, 48.7),
        ("RTX5090-32GB", 32, 1792, 209.5, 104.8, 104.8),
        ("A100-80GB", 80, 2039, 312, 156, 19.5),
        ("H100-80GB", 80, 3350, 989, 494.5, 67),
        ("RTX4090-24GB", 24, 1008, 165.2, 82.6, 82.6),
    ],
)
def test_datasheet_figures(name, gib, bandwidth_gb_s, fp16, tf32, fp32):
    gpu = CATALOGUE[name]
    assert gpu.memory_bytes == gib * GiB
    assert gpu.memory_bandwidth == round(bandwidth_gb_s * GB)
    assert (gpu.fp16_tflops, gpu.tf32_tflops, gpu.fp32_tflops) == (fp16, tf32, fp32)


def test_mi300x_is_amd_with_rocm_capability():
    mi300x = get_gpu("mi300x")
    assert mi300x.vendor is Vendor.AMD and mi300x.compute_capability == (9, 4)  # gfx942 as ROCm's torch reports it
    assert mi300x.multiprocessors == 304 and mi300x.nvlink_bandwidth == 448 * GB  # Infinity Fabric 896 GB/s both ways
    assert [g.name for g in CATALOGUE.values() if g.vendor is Vendor.AMD] == ["MI300X-192GB"]


def test_host_links():
    assert get_gpu("GH200").pcie_bandwidth == 450 * GB  # NVLink-C2C, 900 GB/s both directions
    assert get_gpu("4060").pcie_bandwidth == get_gpu("4060 ti").pcie_bandwidth == 16 * GB  # PCIe 4.0 x8
    assert get_gpu("t4").pcie_bandwidth == 16 * GB  # PCIe 3.0 x16
    assert get_gpu("5090").pcie_bandwidth == 64 * GB  # PCIe 5.0 x16


def test_memory_is_marketed_gb_read_as_gib():
    assert get_gpu("4090").memory_bytes == 24 * GiB == 25_769_803_776
    assert get_gpu("h100").memory_bytes == 80 * GiB
    assert get_gpu("h200").memory_bytes == 141 * GiB


@pytest.mark.parametrize(
    "name, bandwidth_gb_s, fp16_tflops",
    [   # seeds/000 s.7 (and s.3.2 for the 4090's bandwidth), seeds/001 (4090 TFLOPS),
        # seeds/003 s.1.2 (RTX 3060 bandwidth)
        ("V100-32GB", 900, 125),
        ("A100-80GB", 2039, 312),
        ("H100-80GB", 3350, 989),
        ("H200-141GB", 4800, 989),
        ("B200-192GB", 8000, 2250),
        ("L40S-48GB", 864, 366),
        ("RTX4090-24GB", 1008, 165.2),
        ("RTX3060-12GB", 360, 25.5),
    ],
)
def test_seed_figures(name, bandwidth_gb_s, fp16_tflops):
    gpu = CATALOGUE[name]
    assert gpu.memory_bandwidth == bandwidth_gb_s * GB
    assert gpu.fp16_tflops == fp16_tflops


def test_interconnect_is_per_direction():
    h100 = get_gpu("H100-80GB")
    assert h100.nvlink_bandwidth == 450 * GB  # seeds/000 s.9.1: 900 GB/s full duplex
    assert h100.pcie_bandwidth == 64 * GB  # PCIe 5.0 x16: seeds/000 s.9.1 128 GB/s both ways
    assert get_gpu("4090").pcie_bandwidth == 32 * GB  # PCIe 4.0 x16, seeds/003 s.1.3
    assert get_gpu("4090").nvlink_bandwidth is None


def test_bf16_support_follows_compute_capability():
    # seeds/001: compute capability 8.0 (Ampere) added BF16 tensor cores.
    for gpu in CATALOGUE.values():
        if gpu.vendor is Vendor.NVIDIA:
            assert gpu.bf16 == (gpu.compute_capability >= (8, 0))
        assert (gpu.bf16_tflops is None) == (not gpu.bf16)


@pytest.mark.parametrize(
    "alias, name",
    [
        ("h100", "H100-80GB"), ("H100-80GB", "H100-80GB"), ("a100-40gb", "A100-40GB"),
        ("A100 80GB", "A100-80GB"), ("a100_80", "A100-80GB"), ("rtx4090", "RTX4090-24GB"),
        ("4090", "RTX4090-24GB"), ("rtx-4090", "RTX4090-24GB"), ("RTX 3060", "RTX3060-12GB"),
        ("NVIDIA GeForce RTX 3090", "RTX3090-24GB"), ("l40s", "L40S-48GB"), ("b200", "B200-192GB"),
        ("Tesla V100 32GB", "V100-32GB"), ("v100-16gb", "V100-16GB"), ("v100_16", "V100-16GB"),
        ("t4", "T4-16GB"), ("Tesla T4", "T4-16GB"), ("l4", "L4-24GB"), ("NVIDIA L4", "L4-24GB"),
        ("a10", "A10-24GB"), ("a10g", "A10G-24GB"), ("A40", "A40-48GB"), ("h20", "H20-96GB"),
        ("gh200", "GH200-96GB"), ("h100 pcie", "H100PCIe-80GB"), ("h100nvl", "H100NVL-94GB"),
        ("mi300x", "MI300X-192GB"), ("AMD Instinct MI300X", "MI300X-192GB"), ("a6000", "RTXA6000-48GB"),
        ("RTX A6000", "RTXA6000-48GB"), ("rtx 6000 ada", "RTX6000Ada-48GB"), ("6000ada", "RTX6000Ada-48GB"),
        ("rtx pro 6000", "RTXPRO6000-96GB"), ("5090", "RTX5090-32GB"), ("rtx5080", "RTX5080-16GB"),
        ("4080", "RTX4080-16GB"), ("4070", "RTX4070-12GB"), ("4070 Ti Super", "RTX4070TiSuper-16GB"),
        ("rtx4060ti", "RTX4060Ti-16GB"), ("4060 ti 16gb", "RTX4060Ti-16GB"), ("4060", "RTX4060-8GB"),
        ("3080", "RTX3080-10GB"), ("RTX4070TiSuper-16GB", "RTX4070TiSuper-16GB"),
    ],
)
def test_get_gpu_aliases(alias, name):
    assert get_gpu(alias) is CATALOGUE[name]


def test_get_gpu_passes_a_gpu_through():
    assert get_gpu(CATALOGUE["H200-141GB"]) is CATALOGUE["H200-141GB"]


def test_ambiguous_family_lists_candidates():
    with pytest.raises(ValueError, match=r"'a100' is ambiguous: it matches A100-40GB, A100-80GB"):
        get_gpu("a100")
    with pytest.raises(ValueError, match=r"'Tesla V100' is ambiguous: it matches V100-32GB, V100-16GB"):
        get_gpu("Tesla V100")


def test_aliases_are_ambiguous_only_within_a_family():
    # Only the sizes of one family share an alias: "h20" is not "h200", "a10" not "a100", "l4" not "l40s".
    for alias, names in _ALIASES.items():
        assert len({_family(CATALOGUE[n]) for n in names}) == 1, (alias, names)
    assert {alias for alias, names in _ALIASES.items() if len(names) > 1} == {"A100", "V100"}


@pytest.mark.parametrize("bad", ["h800", "4050", "4070 super", "rtx6000", "l40", "mi250x", "", None, 80])
def test_unknown_gpu_names_value_and_valid_names(bad):
    with pytest.raises(ValueError, match=r"unknown GPU .*valid names: V100-32GB, A100-40GB, .*RTX3060-12GB") as e:
        get_gpu(bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize(
    "device_name, total_memory, expected",
    [   # total_memory is what torch reports: a little under the nominal size
        ("NVIDIA H100 80GB HBM3", 79 * GiB, "H100-80GB"),
        ("NVIDIA H200", 150_109_880_320, "H200-141GB"),  # measured: torch 2.11 on an H200
        ("NVIDIA A100-SXM4-40GB", int(39.4 * GiB), "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", int(79.2 * GiB), "A100-80GB"),
        ("Tesla V100-SXM2-32GB", int(31.7 * GiB), "V100-32GB"),
        ("NVIDIA B200", 179 * GiB, "B200-192GB"),
        ("NVIDIA L40S", 45 * GiB, "L40S-48GB"),  # ECC carve-out on GDDR6
        ("NVIDIA GeForce RTX 4090", int(23.6 * GiB), "RTX4090-24GB"),
        ("NVIDIA GeForce RTX 3060", int(11.7 * GiB), "RTX3060-12GB"),
        # Different products that share a family number: not catalogued.
        ("NVIDIA GeForce RTX 3060", int(7.8 * GiB), None),  # the 8 GB 3060
        ("NVIDIA GeForce RTX 3060 Ti", int(7.8 * GiB), None),
        ("NVIDIA GeForce RTX 4090 D", int(23.6 * GiB), None),
        ("NVIDIA H200 NVL", 140 * GiB, None),
        ("NVIDIA A100 80GB PCIe", int(79.2 * GiB), None),
        ("NVIDIA A100-PCIE-40GB", int(39.4 * GiB), None),
        # Entries added with the wider catalogue.
        ("Tesla T4", int(14.6 * GiB), "T4-16GB"),
        ("NVIDIA L4", int(22.0 * GiB), "L4-24GB"),
        ("NVIDIA A10G", int(22.1 * GiB), "A10G-24GB"),
        ("NVIDIA A10", int(22.1 * GiB), "A10-24GB"),
        ("NVIDIA A40", int(44.4 * GiB), "A40-48GB"),
        ("Tesla V100-SXM2-16GB", int(15.8 * GiB), "V100-16GB"),
        ("Tesla V100-SXM2-32GB", int(31.7 * GiB), "V100-32GB"),
        ("NVIDIA H100 PCIe", 79 * GiB, "H100PCIe-80GB"),
        ("NVIDIA H100 NVL", int(93.1 * GiB), "H100NVL-94GB"),
        ("NVIDIA H20", int(95.0 * GiB), "H20-96GB"),
        ("NVIDIA GH200 480GB", 95 * GiB, "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", int(139.8 * GiB), None),  # the 144 GB GH200 is not catalogued
        ("AMD Instinct MI300X", int(191.98 * GiB), "MI300X-192GB"),
        ("NVIDIA RTX A6000", 47 * GiB, "RTXA6000-48GB"),
        ("NVIDIA RTX 6000 Ada Generation", int(47.4 * GiB), "RTX6000Ada-48GB"),
        ("Quadro RTX 6000", int(23.6 * GiB), None),  # Turing, not the Ada card
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", int(94.5 * GiB), "RTXPRO6000-96GB"),
        ("NVIDIA GeForce RTX 5090", int(31.4 * GiB), "RTX5090-32GB"),
        ("NVIDIA GeForce RTX 5090 D", int(31.4 * GiB), None),
        ("NVIDIA GeForce RTX 5080", int(15.5 * GiB), "RTX5080-16GB"),
        ("NVIDIA GeForce RTX 4080", int(15.6 * GiB), "RTX4080-16GB"),
        ("NVIDIA GeForce RTX 4080 SUPER", int(15.6 * GiB), None),
        ("NVIDIA GeForce RTX 4070", int(11.6 * GiB), "RTX4070-12GB"),
        ("NVIDIA GeForce RTX 4070 Ti", int(11.6 * GiB), None),
        ("NVIDIA GeForce RTX 4070 SUPER", int(11.6 * GiB), None),
        ("NVIDIA GeForce RTX 4070 Ti SUPER", int(15.6 * GiB), "RTX4070TiSuper-16GB"),
        ("NVIDIA GeForce RTX 4060 Ti", int(15.6 * GiB), "RTX4060Ti-16GB"),
        ("NVIDIA GeForce RTX 4060 Ti", int(7.6 * GiB), None),  # the 8 GB 4060 Ti
        ("NVIDIA GeForce RTX 4060", int(7.6 * GiB), "RTX4060-8GB"),
        ("NVIDIA GeForce RTX 4060 Laptop GPU", int(7.6 * GiB), None),
        ("NVIDIA GeForce RTX 3080", int(9.8 * GiB), "RTX3080-10GB"),
        ("NVIDIA GeForce RTX 3080", int(11.7 * GiB), None),  # the 12 GB 3080
        ("NVIDIA L40", int(44.4 * GiB), None),  # not the L4, not the L40S
    ],
)
def test_match_device(device_name, total_memory, expected):
    gpu = _match_device(device_name, total_memory)
    assert (gpu.name if gpu else None) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_detect_gpu_without_cuda_is_none():
    assert detect_gpu() is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_detect_gpu_on_cuda():
    gpu = detect_gpu()
    total = torch.cuda.get_device_properties(0).total_memory
    assert gpu is None or isinstance(gpu, GPU) and abs(gpu.memory_bytes - total) <= 0.1 * gpu.memory_bytes


def test_list_gpus_table():
    df = list_gpus()
    assert isinstance(df, pd.DataFrame) and list(df.index) == list(CATALOGUE)
    assert df.loc["RTX4090-24GB", "memory_gib"] == 24.0
    assert df.loc["RTX4090-24GB", "memory_bytes"] == 24 * GiB
    assert df.loc["H100-80GB", "mem_gb_s"] == 3350.0
    assert df.loc["H100-80GB", "nvlink_gb_s"] == 450.0
    assert pd.isna(df.loc["L40S-48GB", "nvlink_bandwidth"])
    assert df.loc["B200-192GB", "compute_capability"] == (10, 0)
    assert df.loc["H100-80GB", "tf32_tflops"] == 494.5 and pd.isna(df.loc["T4-16GB", "tf32_tflops"])
    assert df.loc["T4-16GB", "segment"] == "datacenter" and df.loc["RTX5090-32GB", "segment"] == "consumer"
    assert df.loc["MI300X-192GB", "vendor"] == "amd" and df.loc["H20-96GB", "vendor"] == "nvidia"
    assert set(df["segment"]) == {"datacenter", "workstation", "consumer"}
    assert pd.isna(df.loc["H20-96GB", "multiprocessors"])


def test_memprof_gpus_groups_by_segment(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["gpus"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert lines[0].startswith("GPU catalogue: dense tensor-core TFLOPS")
    header = next(i for i, line in enumerate(lines) if line.startswith("GPU ") and "FP16" in line)
    assert lines[header].split() == ["GPU", "GiB", "GB/s", "FP16", "BF16", "TF32", "FP32", "GB/s", "GB/s", "CC"]
    sections = [i for i, line in enumerate(lines) if line.strip() in {"datacenter", "workstation", "consumer"}]
    assert [lines[i].strip() for i in sections] == ["datacenter", "workstation", "consumer"]
    rows = {line.split()[0]: (i, line.split()) for i, line in enumerate(lines)
            if line.split() and line.split()[0] in CATALOGUE}
    assert set(rows) == set(CATALOGUE)  # every GPU once, no name cut short
    for name, (i, cells) in rows.items():  # each under its segment's heading
        segment = CATALOGUE[name].segment.value
        assert lines[max(s for s in sections if s < i)].strip() == segment
    assert rows["T4-16GB"][1][1:] == ["16", "320", "65", "no", "no", "8.1", "16", "-", "7.5"]
    assert rows["H100-80GB"][1][1:] == ["80", "3350", "989", "yes", "494", "67", "64", "450", "9.0"]
    assert rows["RTX5090-32GB"][1][1:] == ["32", "1792", "210", "yes", "105", "105", "64", "-", "12.0"]
    assert rows["MI300X-192GB"][1][-1] == "9.4"
