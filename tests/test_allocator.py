"""cuBLAS's workspaces, found among the caching allocator's blocks (no GPU
needed: the allocator's snapshot and PyTorch's settings are stood in for)."""

import pytest
import torch

from memprof import allocator

MiB = 1 << 20


@pytest.fixture
def rules(monkeypatch):
    """A PyTorch without the workspace-size getter: the size comes from its rule."""
    monkeypatch.delattr(torch._C, "_cuda_getCublasWorkspaceSize", raising=False)
    return monkeypatch


def test_workspace_sizes_follow_pytorchs_settings(rules):
    rules.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert allocator.cublas_workspace_size(0) == 4096 * 1024 * 2 + 16 * 1024 * 8
    rules.delenv("CUBLAS_WORKSPACE_CONFIG")
    rules.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert allocator.cublas_workspace_size(0) == 32 * MiB  # Hopper's default
    rules.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert allocator.cublas_workspace_size(0) == 8 * MiB + 128 * 1024
    rules.setenv("CUBLAS_WORKSPACE_CONFIG", "4096:8")  # no :SIZE:COUNT pair: PyTorch warns and takes its default
    assert allocator.cublas_workspace_size(0) == 8 * MiB + 128 * 1024
    rules.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # no workspace: nothing to look for
    assert allocator.cublas_workspace_size(0) == 0
    assert allocator.DeviceCounters(torch.device("cuda", 0)).workspaces(lambda: set()) == 0
    rules.setattr(torch._C, "_cuda_getCublasWorkspaceSize", lambda: 16 * MiB, raising=False)  # a build that says
    assert allocator.cublas_workspace_size(0) == 16 * MiB


def test_workspaces_are_live_blocks_of_their_size_no_known_storage_holds(rules):
    rules.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def block(address, size, state="active_allocated", requested=None):
        return {"address": address, "size": size, "requested_size": size if requested is None else requested, "state": state}

    segments = [
        {"device": 0, "blocks": [
            block(0, 32 * MiB),                      # the training thread's workspace
            block(32 * MiB, 32 * MiB),               # a 32 MiB weight memprof knows
            block(64 * MiB, 32 * MiB, "inactive"),   # a freed block, cached
            block(96 * MiB, 32 * MiB, requested=32 * MiB - 512),  # a tensor rounded up to 32 MiB
        ]},
        {"device": 0, "blocks": [block(128 * MiB, MiB), block(129 * MiB, 32 * MiB)]},  # a 1 MiB tensor; backward's
        {"device": 1, "blocks": [block(0, 32 * MiB)]},  # another GPU's
    ]
    rules.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    counters = allocator.DeviceCounters(torch.device("cuda", 0))
    assert counters.workspaces(lambda: {32 * MiB}) == 2 * 32 * MiB
    assert allocator.DeviceCounters(torch.device("cpu")).workspaces(lambda: set()) == 0


def test_one_device_counters_per_cuda_device():
    """The peaks kept for the script (what ``torch.cuda.max_memory_allocated`` would read without
    memprof) belong to the device, not to a tracker: the runner's early tracker and a tracker
    dropped on a restart reset the raw peaks, and a fresh ``KeptPeaks`` per tracker lost them
    (a script printed a 0.07 GiB peak under ``memprof track`` where it had reached 8.85 GiB)."""
    a = allocator.counters_for(torch.device("cuda", 1))
    assert allocator.counters_for(torch.device("cuda:1")) is a
    assert allocator.counters_for(torch.device("cuda", 0)) is not a
    a.kept.fold({"allocated_bytes": {"all": {"peak": 5 * MiB}}})
    stats = {"allocated_bytes": {"all": {"peak": MiB}}}
    assert allocator.counters_for(torch.device("cuda", 1)).kept.apply(stats)["allocated_bytes"]["all"]["peak"] == 5 * MiB
    a.kept.clear()
