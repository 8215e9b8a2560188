"""The GPU catalogue: seed figures, name lookup, device matching, table."""

import pandas as pd
import pytest
import torch

from memprof.devices import CATALOGUE, GPU, _match_device, detect_gpu, get_gpu, list_gpus

GiB = 2**30
GB = 10**9


def test_catalogue_is_keyed_by_canonical_name():
    assert list(CATALOGUE) == [
        "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB",
        "B200-192GB", "L40S-48GB", "RTX4090-24GB", "RTX3090-24GB", "RTX3060-12GB",
    ]
    assert all(name == gpu.name for name, gpu in CATALOGUE.items())
    assert all(isinstance(g.memory_bytes, int) and isinstance(g.memory_bandwidth, int)
               for g in CATALOGUE.values())


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
        assert gpu.bf16 == (gpu.compute_capability >= (8, 0))
        assert (gpu.bf16_tflops is None) == (not gpu.bf16)


@pytest.mark.parametrize(
    "alias, name",
    [
        ("h100", "H100-80GB"), ("H100-80GB", "H100-80GB"), ("a100-40gb", "A100-40GB"),
        ("A100 80GB", "A100-80GB"), ("a100_80", "A100-80GB"), ("rtx4090", "RTX4090-24GB"),
        ("4090", "RTX4090-24GB"), ("rtx-4090", "RTX4090-24GB"), ("RTX 3060", "RTX3060-12GB"),
        ("NVIDIA GeForce RTX 3090", "RTX3090-24GB"), ("l40s", "L40S-48GB"), ("b200", "B200-192GB"),
        ("Tesla V100", "V100-32GB"),
    ],
)
def test_get_gpu_aliases(alias, name):
    assert get_gpu(alias) is CATALOGUE[name]


def test_get_gpu_passes_a_gpu_through():
    assert get_gpu(CATALOGUE["H200-141GB"]) is CATALOGUE["H200-141GB"]


def test_ambiguous_family_lists_candidates():
    with pytest.raises(ValueError, match=r"'a100' is ambiguous: it matches A100-40GB, A100-80GB"):
        get_gpu("a100")


@pytest.mark.parametrize("bad", ["h800", "4080", "", None, 80])
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
        ("NVIDIA H100 PCIe", 79 * GiB, None),
        ("NVIDIA H200 NVL", 140 * GiB, None),
        ("NVIDIA GH200 480GB", 95 * GiB, None),
        ("NVIDIA RTX A6000", 47 * GiB, None),
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
