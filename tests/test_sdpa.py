"""memprof.sdpa against PyTorch's own attention-kernel choice.

On the CPU: the answers PyTorch 2.11 gave on an H200 for 1000 input
combinations (benchmarks/results/sdpa-choice-nvidia-h200.json, written by
benchmarks/sdpa_choice.py). On a GPU: PyTorch's own ``can_use_*`` functions,
asked live over 600 combinations.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import cuda
from memprof.sdpa import Environment, select_backend, usable_backends

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from sdpa_cases import Case, cases, make  # noqa: E402

RECORDED = ROOT / "benchmarks" / "results" / "sdpa-choice-nvidia-h200.json"


def answers(case, env, device="meta"):
    q, k, v, mask = make(case, device)
    out = usable_backends(q, k, v, mask, case.dropout, case.causal, case.gqa, env)
    out["choice"] = select_backend(q, k, v, mask, case.dropout, case.causal, case.gqa, env)
    return out


def test_agrees_with_pytorch_2_11_on_an_h200():
    recorded = json.loads(RECORDED.read_text())
    facts = recorded["facts"]
    major, minor = (int(x) for x in facts["torch"].split("+")[0].split(".")[:2])
    cuda_version = tuple(int(x) for x in facts["cuda"].split(".")[:2])
    env = Environment(tuple(facts["capability"]), cudnn=facts["cudnn"], cuda=cuda_version, torch_version=(major, minor))
    rows = recorded["cases"]
    assert len(rows) == 1000
    wrong = [(r["case"], r["torch"], mine) for r in rows if (mine := answers(Case(**r["case"]), env)) != r["torch"]]
    assert wrong == []
    # the grid covers every kernel
    assert {r["torch"]["choice"] for r in rows} == {"math", "flash", "efficient", "cudnn"}


def test_rules_follow_the_target_and_the_switches():
    q = torch.empty(2, 8, 128, 64, dtype=torch.bfloat16, device="meta")
    hopper = Environment((9, 0), cudnn=91900, cuda=(13, 0), torch_version=(2, 11))
    older_cudnn = Environment((9, 0), cudnn=91000, cuda=(13, 0), torch_version=(2, 11))
    assert select_backend(q, q, q, None, 0.0, True, False, hopper) == "cudnn"
    assert select_backend(q, q, q, None, 0.0, True, False, older_cudnn) == "flash"  # cuDNN first only after 9.15
    try:
        torch.backends.cuda.enable_cudnn_sdp(False)
        assert select_backend(q, q, q, None, 0.0, True, False, hopper) == "flash"
        torch.backends.cuda.enable_flash_sdp(False)
        assert select_backend(q, q, q, None, 0.0, True, False, hopper) == "efficient"
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        assert select_backend(q, q, q, None, 0.0, True, False, hopper) == "math"
        torch.backends.cuda.enable_math_sdp(False)
        with pytest.raises(RuntimeError, match="no attention kernel is enabled"):
            select_backend(q, q, q, None, 0.0, True, False, hopper)
    finally:
        for enable in ("enable_cudnn_sdp", "enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp"):
            getattr(torch.backends.cuda, enable)(True)


@cuda
@pytest.mark.cuda
def test_agrees_with_pytorch_on_this_gpu():
    """PyTorch's own can_use_* and _fused_sdp_choice, asked on this GPU, over 600 combinations."""
    props = torch.cuda.get_device_properties(0)
    env = Environment((props.major, props.minor))
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
    wrong = []
    grid = cases(600, seed=1)
    for case in grid:
        q, k, v, mask = make(case, "cuda")
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, case.dropout, case.causal, case.gqa)
        theirs = {
            "flash": torch.backends.cuda.can_use_flash_attention(params),
            "efficient": torch.backends.cuda.can_use_efficient_attention(params),
            "cudnn": torch.backends.cuda.can_use_cudnn_attention(params),
            "choice": names[int(torch._fused_sdp_choice(q, k, v, mask, case.dropout, case.causal, enable_gqa=case.gqa))],
        }
        mine = answers(case, env)
        if mine != theirs:
            wrong.append((case, theirs, mine))
    assert len(grid) >= 300 and wrong == []


def _kernel(ops):
    names = " ".join(op for op, _ in ops)
    for kernel in ("cudnn", "efficient", "flash"):
        if f"_scaled_dot_product_{kernel}_attention" in names:
            return kernel
    return "math"


def test_simulated_attention_forward_matches_the_gpu():
    """What one attention forward allocates and keeps, against the H200's own counters (same shapes)."""
    import torch.nn.functional as F

    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator
    from memprof.virtual_cuda import VirtualCUDA

    dtypes = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}
    traces = json.loads(RECORDED.read_text())["traces"]
    checked = 0
    for trace in traces:
        s = trace["shape"]
        if _kernel(trace["ops"]) == "math":
            continue  # its _safe_softmax works in pieces on the GPU: a transient the simulation leaves out
        gpu = get_gpu("h200")
        with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
            dtype = dtypes[s["dtype"]]
            q = torch.randn(s["batch"], s["heads_q"], s["length"], s["dim"], dtype=dtype, device="cuda", requires_grad=True)
            k, v = (torch.randn(s["batch"], s["heads_kv"], s["length"], s["dim"], dtype=dtype, device="cuda",
                                requires_grad=True) for _ in range(2))
            mask = torch.ones(s["batch"], 1, s["length"], s["length"], dtype=torch.bool, device="cuda") if s["mask"] else None
            torch.zeros(1, 1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # cuBLAS's workspace, there before
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=s["causal"], enable_gqa=s["gqa"])
            # within four 512-byte blocks: scalars (the kernels' RNG seed and offset, a mask's fill values)
            assert abs(torch.cuda.max_memory_allocated() - base - trace["forward_peak"]) <= 2048, s
            assert abs(torch.cuda.memory_allocated() - base - trace["after_forward"]) <= 2048, s
            del out
        checked += 1
    assert checked == 18


def test_the_math_fallbacks_dropout_keeps_what_cudas_fused_dropout_keeps():
    """On CUDA the math fallback's dropout is the fused kernel: a one-byte mask and the
    dropped scores stay for backward. On meta tensors PyTorch's composite kept a mask in
    the scores' dtype (fp32 after the half inputs' upcast): 4 bytes an element, not 1."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator
    from memprof.virtual_cuda import VirtualCUDA

    gpu = get_gpu("h200")
    kept = {}
    for p in (0.0, 0.1):
        with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
            q, k, v = (torch.randn(2, 4, 256, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
            base = torch.cuda.memory_allocated()
            with sdpa_kernel(SDPBackend.MATH):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
            kept[p] = torch.cuda.memory_allocated() - base
            out.sum().backward()
    scores = 2 * 4 * 256 * 256
    assert kept[0.1] - kept[0.0] == scores * 1 + scores * 4  # the bool mask, the fp32 dropped scores


@pytest.mark.parametrize("context", ["checkpointed", "no_grad"])
def test_kernel_probe_stays_out_of_the_callers_context(monkeypatch, context):
    """The simulation asks once whether this torch's meta kernels run cuDNN
    attention with grouped heads. Asked first inside a checkpointed block, the
    probe's saved tensors joined the block's (the recomputation then saved
    fewer, and backward raised CheckpointError); asked under no_grad its own
    backward failed. Either way the answer must be the one asked alone."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    import memprof.sdpa as sdpa
    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator
    from memprof.virtual_cuda import VirtualCUDA

    gpu = get_gpu("h200")

    def block(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
        monkeypatch.setattr(sdpa, "_cudnn_gqa", [])
        alone = sdpa._cudnn_gqa_on_meta()  # asked first outside any autograd context
        monkeypatch.setattr(sdpa, "_cudnn_gqa", [])
        q = torch.randn(2, 8, 128, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        kv = torch.randn(2, 2, 128, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        if context == "no_grad":
            with torch.no_grad():
                block(q, kv, kv)
        else:
            checkpoint(block, q, kv, kv, use_reentrant=False).sum().backward()
            assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    assert sdpa._cudnn_gqa == [alone]


def test_the_memory_efficient_kernels_mask_is_one_copy_for_all_heads():
    """attention.cpp's preprocess_mask pads a mask whose strides are not multiples of 8 elements in
    its last dimension, then expands it over the heads as a view: a (8, 1, 109, 109) bf16 padding mask
    saved for backward is one (8, 1, 109, 112) copy, 195,328 bytes, not one per head (it was padded
    after the expansion: 4x that at 4 heads, 1.7 GB in all for BERT-base at 447 tokens). An aligned
    (8, 1, 112, 112) mask is saved as it is."""
    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator
    from memprof.virtual_cuda import VirtualCUDA

    gpu = get_gpu("A100-80GB")  # memory-efficient attention: no cuDNN attention before Hopper
    for length, saved in ((109, 8 * 109 * 112 * 2), (112, 8 * 112 * 112 * 2)):
        storages = []

        def pack(t):
            if t.dim() == 4 and t.shape[-1] == length and t.stride(1) == 0:  # the mask, broadcast over the heads
                storages.append(t.untyped_storage().nbytes())
            return t

        with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
            q, k, v = (torch.randn(8, 4, length, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                       for _ in range(3))
            mask = torch.zeros(8, 1, length, length, dtype=torch.bfloat16, device="cuda")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert storages == [saved], (length, storages)
