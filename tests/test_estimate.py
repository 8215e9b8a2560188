"""Model-state estimates against the worked examples in the team notes (seeds/) and ZeRO."""

import pytest

from memprof.devices import get_gpu
from memprof.estimate import ModelStates, estimate_model_states, transformer_layer_params

GB = 10**9  # decimal gigabyte
GiB = 2**30
MiB = 2**20
SEVEN_B = 7_000_000_000


def test_seed000_7b_fp16_mixed_adam_is_126_gb():
    # seeds/000 s.8.1: FP16 param 2 + FP32 master 4 + FP32 grad 4 + Adam m 4 + v 4 = 18 B;
    # "7 x 10^9 x 18 = 126 GB" -- decimal GB (10^9 B), i.e. 117.3 GiB.
    s = estimate_model_states(SEVEN_B, precision="mixed_fp16", optimizer="adam")
    assert s == ModelStates(
        parameters=14 * GB,
        gradients=28 * GB,
        master_weights=28 * GB,
        optimizer_state=56 * GB,
        total=126 * GB,
        host_total=0,
        bytes_per_param=18.0,
    )
    assert estimate_model_states(SEVEN_B, "mixed_bf16").total == 126 * GB


def test_seed001_7b_bf16_adam_is_84_gb():
    # seeds/001 "内存容量与模型规模": N x (2 + 2 + 8) = 7 x 10^9 x 12 = 84 GB, decimal GB.
    s = estimate_model_states(SEVEN_B, precision="bf16", optimizer="adamw")
    assert (s.parameters, s.gradients, s.master_weights, s.optimizer_state) == (
        14 * GB, 14 * GB, 0, 56 * GB)
    assert s.total == 84 * GB and s.bytes_per_param == 12.0
    # The seed says 84 GB "already exceeds a single H100's 80 GB", but that compares
    # decimal GB with the card's binary 80 GiB: 84e9 B is 78.2 GiB. It is below the
    # nominal capacity (and leaves ~1 GiB of usable memory, so it still won't train).
    assert s.total < get_gpu("H100").memory_bytes
    # ...and 7B BF16 inference weights are the "14 GB" (decimal) the seed quotes.
    assert s.parameters == 14 * GB


def test_seed001_layer_stack_12_gib_weights_72_gib_training():
    # seeds/001 "测量模型组件的内存占用": d_model 4096, d_ff 16384, 32 layers, BF16.
    # The seed's code divides by 1024**2 and prints "MB", so its MB/GB are MiB/GiB.
    d, ff = 4096, 16384
    assert 2 * transformer_layer_params(d, ff, 1) == 384 * MiB  # "每层合计: 384.0 MB"
    assert 2 * 4 * d * d == 128 * MiB and 2 * 2 * d * ff == 256 * MiB  # attention, FFN
    n = transformer_layer_params(d, ff, 32)
    assert n == 6_442_450_944
    s = estimate_model_states(n, precision="bf16", optimizer="adamw")
    assert s.parameters == 12 * GiB  # "BF16 权重: 12.0 GB"
    assert s.gradients == 12 * GiB  # "BF16 梯度: 12.0 GB"
    assert s.optimizer_state == 48 * GiB  # "Adam 一阶矩 24.0 GB" + "二阶矩 24.0 GB"
    assert s.total == 72 * GiB == 77_309_411_328  # "合计（无激活）: 72.0 GB"


def test_transformer_layer_params_gated_and_validation():
    assert transformer_layer_params(8, 16, 2, gated=True) == 2 * (4 * 64 + 3 * 128)
    with pytest.raises(ValueError, match=r"d_model must be an integer >= 1, got -1"):
        transformer_layer_params(-1, 16, 2)


@pytest.mark.parametrize(
    "precision, optimizer, per_param",
    [
        ("fp32", "adamw", 16),
        ("fp32", "sgd", 8),
        ("fp32", "sgd_momentum", 12),
        ("mixed_bf16", "sgd", 10),
        ("bf16", "sgd_momentum", 8),
    ],
)
def test_bytes_per_param_table(precision, optimizer, per_param):
    s = estimate_model_states(1000, precision, optimizer)
    assert s.total == 1000 * per_param and s.bytes_per_param == per_param


def test_zero_stages_over_8_ranks_divide_exactly():
    # ZeRO paper s.5: stage 1 shards optimizer state (incl. FP32 master weights),
    # stage 2 also gradients, stage 3 also parameters. 7e9 / 8 = 875e6 exactly.
    by_stage = {
        z: estimate_model_states(SEVEN_B, "mixed_bf16", "adamw", zero_stage=z, world_size=8)
        for z in range(4)
    }
    shard = 875_000_000
    assert by_stage[0].total == 126 * GB  # no sharding: every rank holds everything
    assert by_stage[1].total == 14 * GB + 28 * GB + 4 * shard + 8 * shard == 52_500_000_000
    assert by_stage[2].total == 14 * GB + 16 * shard == 28 * GB
    s3 = by_stage[3]
    assert (s3.parameters, s3.gradients, s3.master_weights, s3.optimizer_state) == (
        2 * shard, 4 * shard, 4 * shard, 8 * shard)
    assert s3.total * 8 == 126 * GB and s3.bytes_per_param == 2.25


def test_zero_shard_is_ceil_divided():
    # 10 params over 3 ranks: each rank holds a padded partition of ceil(10/3) = 4.
    s = estimate_model_states(10, "bf16", "adamw", zero_stage=3, world_size=3)
    assert (s.parameters, s.gradients, s.optimizer_state, s.total) == (8, 8, 32, 48)


def test_zero_stage_with_one_rank_shards_nothing():
    one = estimate_model_states(SEVEN_B, "mixed_fp16", zero_stage=3, world_size=1)
    assert one == estimate_model_states(SEVEN_B, "mixed_fp16")


def test_offload_moves_parts_to_host():
    opt = estimate_model_states(SEVEN_B, "mixed_bf16", zero_stage=2, world_size=8, offload="optimizer")
    assert opt.host_total == 3_500_000_000 + 7_000_000_000  # master + Adam shards
    assert opt.total == 14 * GB + 3_500_000_000  # BF16 params + grad shard stay
    full = estimate_model_states(
        SEVEN_B, "mixed_bf16", zero_stage=3, world_size=8, offload="optimizer+parameters")
    assert full.total == full.gradients == 3_500_000_000
    assert full.host_total == 1_750_000_000 + 3_500_000_000 + 7_000_000_000
    # Offload moves bytes, it does not remove them.
    parts = (full.parameters, full.gradients, full.master_weights, full.optimizer_state)
    assert sum(parts) == full.total + full.host_total == 126 * GB // 8


def test_to_dict_has_integer_bytes():
    d = estimate_model_states(SEVEN_B, "bf16").to_dict()
    assert d["total"] == 84 * GB and d["host_total"] == 0 and d["bytes_per_param"] == 12.0
    assert all(isinstance(d[k], int) for k in d if k != "bytes_per_param")


def test_lenient_inputs():
    assert estimate_model_states(7e9, "BF16", "AdamW").total == 84 * GB  # float count, torch names


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(precision="fp8"), r"precision='fp8' is not supported; pass one of 'fp32', 'mixed_fp16'"),
        (dict(optimizer="lion"), r"optimizer='lion' is not supported; pass one of 'adamw', 'adam'"),
        (dict(offload="nvme"), r"offload='nvme' is not supported; pass one of None, 'optimizer'"),
        (dict(zero_stage=4), r"zero_stage must be 0, 1, 2 or 3, got 4"),
        (dict(zero_stage=True), r"zero_stage must be 0, 1, 2 or 3, got True"),
        (dict(world_size=0), r"world_size must be an integer >= 1, got 0; e.g. world_size=8"),
        (dict(n_params=0), r"n_params must be an integer >= 1, got 0; e.g. n_params=7_000_000_000"),
        (dict(n_params=1.5), r"n_params must be an integer >= 1, got 1.5"),
        (dict(n_params="7B"), r"n_params must be an integer >= 1, got '7B'"),
        (dict(offload="optimizer"), r"offload='optimizer' needs zero_stage >= 1 .*set zero_stage=1"),
        (dict(offload="optimizer+parameters", zero_stage=2),
         r"needs zero_stage=3 \(got zero_stage=2\); set zero_stage=3"),
    ],
)
def test_bad_arguments_raise_with_the_fix(kwargs, message):
    args = dict(n_params=SEVEN_B) | kwargs
    with pytest.raises(ValueError, match=message):
        estimate_model_states(**args)
