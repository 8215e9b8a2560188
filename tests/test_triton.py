"""A script's own Triton kernels on the simulated GPU (memprof.triton_kernels): launched, not run.

Runs where Triton is installed (a CUDA build of torch brings it), GPU or not."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from memprof.devices import get_gpu  # noqa: E402
from memprof.simulate import SimulatedAllocator  # noqa: E402
from memprof.virtual_cuda import VirtualCUDA  # noqa: E402


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 256}), triton.Config({"BLOCK": 1024})], key=["n"])
@triton.jit
def _tuned_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


class _Add(torch.autograd.Function):
    """The Triton tutorials' habit: forward and backward kernels in an autograd.Function."""

    @staticmethod
    def forward(ctx, x, y):
        out = torch.empty_like(x)
        n = x.numel()
        _add[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def test_a_kernel_is_charged_not_run():
    """512 x 512 fp32: the output the script allocates (1 MiB) is counted, the kernel's
    launch is one kernel that moves its three tensors once (3 MiB), and the values
    the kernel may have written are no longer known."""
    gpu = get_gpu("h200")
    allocator = SimulatedAllocator(gpu)
    with VirtualCUDA(gpu, allocator=allocator) as device:
        x = torch.ones(512, 512, device="cuda", requires_grad=True)
        y = torch.zeros(512, 512, device="cuda")
        before = allocator.model.allocated, allocator.kernels, allocator.bytes_moved
        out = _Add.apply(x, y)
        assert allocator.model.allocated - before[0] == 512 * 512 * 4
        assert allocator.kernels - before[1] == 1  # empty_like launches nothing
        assert allocator.bytes_moved - before[2] == 3 * 512 * 512 * 4
        assert device.values.shadow(out) is None
        out.sum().backward()
        assert x.grad.shape == (512, 512)
        assert "Triton kernels" in device.notes


def test_autotuning_takes_the_first_configuration_and_the_driver_answers_for_the_target():
    gpu = get_gpu("h200")
    allocator = SimulatedAllocator(gpu)
    with VirtualCUDA(gpu, allocator=allocator):
        active = triton.runtime.driver.active
        assert active.get_active_torch_device() == torch.device("cuda", 0)
        assert active.utils.get_device_properties(0)["multiprocessor_count"] == gpu.multiprocessors == 132
        assert active.get_current_target().arch == 90
        x = torch.randn(4096, device="cuda")
        out = torch.empty_like(x)
        kernels = allocator.kernels
        _tuned_add[lambda meta: (triton.cdiv(4096, meta["BLOCK"]),)](x, x, out, 4096)
        assert allocator.kernels - kernels == 1  # nothing benchmarked: one launch
        assert _tuned_add.best_config.kwargs == {"BLOCK": 256}
        # The fused-softmax tutorial sizes its grid from a warmed-up kernel, then launches it.
        compiled = _add.warmup(x, x, out, 4096, BLOCK=1024, grid=(1,))
        compiled._init_handles()
        assert compiled.n_regs > 0 and compiled.metadata.shared > 0
        compiled[(4,)](x, x, out, 4096)
        assert allocator.kernels - kernels == 2
    assert triton.runtime.driver._active is not active
