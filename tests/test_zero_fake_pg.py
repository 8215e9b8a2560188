"""ZeRO-3 with PyTorch's own FSDP2 over a fake process group of 8 ranks, on the CPU:
memprof attributes one rank's shards, and the shards are what ZeRO's arithmetic says."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memprof
from models import MiB

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")


@pytest.fixture
def eight_ranks():
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=8)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (8,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_are_attributed_per_rank(eight_ranks):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 4 blocks of two 512x1024 fp32 weights: 4 x 2 x 2 MiB = 16 MiB unsharded.
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(512, 1024, bias=False), nn.GELU(), nn.Linear(1024, 512, bias=False)) for _ in range(4)]
    )
    for block in model:
        fully_shard(block, mesh=eight_ranks)
    fully_shard(model, mesh=eight_ranks)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 512)
    with memprof.track(model, opt) as prof:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    # ZeRO-3 over 8 ranks: each rank keeps 1/8 of parameters, gradients and Adam's m and v.
    assert r.modules["parameters"].sum() == 16 * MiB // 8
    assert r.optimizer_state["exp_avg"] == r.optimizer_state["exp_avg_sq"] == 16 * MiB // 8
    assert r.modules["gradients"].sum() == 16 * MiB // 8
    # FSDP frees each block's gathered weights after its forward (resize in place):
    # the 16 MiB of unsharded weights never count as activations.
    assert r.peak.bytes["activations"] < 4 * MiB
    assert r.peak.bytes["parameters"] < 16 * MiB
