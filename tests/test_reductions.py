"""memprof.reductions: a CUDA reduction's staging memory, against the H200's counters.

The bytes below were measured on an H200 (torch 2.11): the peak of one
reduction over what was allocated before it, less its output
(benchmarks/results/scripts-unseen.md), and an allocator snapshot of ViT-B/16's
step (benchmarks/results/README.md, "Attribution against CUDA's counters").
"""

import pytest
import torch
import torch.nn.functional as F

from memprof.devices import get_gpu
from memprof.reductions import staging_bytes
from memprof.simulate import SimulatedAllocator
from memprof.virtual_cuda import VirtualCUDA

ops = torch.ops.aten
H200 = get_gpu("h200")
MiB = 1 << 20


def _over_output(fn, x: torch.Tensor) -> int:
    """The simulated peak while ``fn(x)`` runs, over what was allocated before, less its output."""
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = fn(x)
    return torch.cuda.max_memory_allocated() - before - y.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_channels_last_mean_over_the_image_stages_128_mib(dtype):
    # Measured on the H200 for both dtypes: 134,218,240 B channels-last (a 128 MiB buffer, 16 thread
    # blocks per output of 32 x 4 float accumulators, and 128 four-byte semaphores in a 512-byte
    # block), nothing for the contiguous layout or a sum over the batch.
    with VirtualCUDA(H200, allocator=SimulatedAllocator(H200)):
        x = torch.randn(128, 128, 32, 32, device="cuda", dtype=dtype)
        cl = x.contiguous(memory_format=torch.channels_last)
        assert _over_output(lambda t: F.adaptive_avg_pool2d(t, 1), cl) == 128 * MiB + 512
        assert _over_output(lambda t: t.mean((-1, -2), keepdim=True), cl) == 128 * MiB + 512
        assert _over_output(lambda t: F.adaptive_avg_pool2d(t, 1), x) == 0
        assert _over_output(lambda t: t.sum(0), x) == 0


def test_a_bias_gradient_over_many_rows_stages_what_the_h200_did():
    # ViT-B/16 at batch 128: the last MLP's bias gradient sums 128 x 197 rows of 768 bf16 values;
    # the H200's allocator snapshot held a 138,412,032-byte block across that kernel.
    g = torch.empty(128 * 197, 768, dtype=torch.bfloat16, device="meta")
    assert staging_bytes(ops.sum.dim_IntList, (g, [0], False), ops.sum.dim_IntList(g, [0], False), H200) == (
        0, [(138_412_032, 24)])
    # The same sum on a GPU of fewer multiprocessors splits each output over fewer blocks.
    small = staging_bytes(ops.sum.dim_IntList, (g, [0], False), ops.sum.dim_IntList(g, [0], False), get_gpu("rtx3060"))
    assert 0 < small.pieces[0][0] < 138_412_032
    # amax keeps the input's type: a bf16 accumulator, half the staging (69,206,016 B on the H200).
    x = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    assert staging_bytes(ops.amax.default, (x, [0]), ops.amax.default(x, [0]), H200) == (0, [(69_206_016, 128)])


def test_what_is_not_followed_takes_nothing():
    x = torch.empty(4096, 4096, device="meta")
    assert staging_bytes(ops.sum.dim_IntList, (x, [1]), ops.sum.dim_IntList(x, [1]), H200) == (0, [])  # rows apart
    i = torch.empty(4096, 4096, dtype=torch.int64, device="meta")
    assert staging_bytes(ops.sum.default, (i,), ops.sum.default(i), H200) == (0, [])  # an integer accumulator


def test_a_reduction_past_32_bit_offsets_runs_in_pieces():
    # Measured on the H200: a full fp32 sum of 3 x 2^28 values (3 GiB) in two pieces of 12,288 B of
    # staging each; a bf16 sum over 25216 rows of 50257 (2.4 GiB) adds its pieces into a float
    # accumulator of the 50257 outputs (201,028 B) and stages nothing.
    x = torch.empty(3 * 2**28, device="meta")
    assert staging_bytes(ops.sum.default, (x,), ops.sum.default(x), H200) == (0, [(12_288, 4), (12_288, 4)])
    g = torch.empty(25216, 50257, dtype=torch.bfloat16, device="meta")
    assert staging_bytes(ops.sum.dim_IntList, (g, [0]), ops.sum.dim_IntList(g, [0]), H200) == (201_028, [])
    f = g.float()
    assert staging_bytes(ops.sum.dim_IntList, (f, [0]), ops.sum.dim_IntList(f, [0]), H200) == (0, [])


def test_every_measured_reduction_is_predicted_to_the_byte(tmp_path, capsys):
    """benchmarks/results/reductions-measured.jsonl: 65 reductions on the H200."""
    import shutil
    import sys
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(results))
    from reductions import compare

    shutil.copy(results / "results" / "reductions-measured.jsonl", tmp_path)
    compare(tmp_path)
    assert "65 of 65 predicted to the byte" in capsys.readouterr().out
