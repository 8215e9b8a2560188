"""Profiled steps: cheap ones after a full one, the script's own peak
readings left alone, and bounded memory over long runs.

Cheap steps need the allocator's peak counters, so they are tested on a
simulated GPU (meta tensors, memprof's caching-allocator model), where the
counters are exact and deterministic.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memprof
from memprof import allocator
from memprof.devices import get_gpu
from memprof.simulate import SimulatedAllocator
from memprof.virtual_cuda import VirtualCUDA
from models import adam_linear

MiB = 1 << 20


class Block(nn.Module):
    def __init__(self, d: int = 256, h: int = 1024, ckpt: bool = False) -> None:
        super().__init__()
        self.up, self.act, self.down, self.norm = nn.Linear(d, h), nn.GELU(), nn.Linear(h, d), nn.LayerNorm(d)
        self.ckpt = ckpt
        self.spike = 0  # bytes of a temporary to make in forward: a step that changes

    def _body(self, x):
        if self.spike:
            torch.empty(self.spike, dtype=torch.uint8, device=x.device)
        return self.norm(x + self.down(self.act(self.up(x))))

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False) if self.ckpt else self._body(x)


def mlp_ce(opt_cls=torch.optim.SGD, ckpt=False):
    """Three residual blocks and a 4096-way head, the loss outside the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), *[Block(ckpt=ckpt) for _ in range(3)], nn.Linear(256, 4096)).cuda()
    opt = opt_cls(model.parameters(), lr=0.1)
    x = torch.randn(512, 128, device="cuda")
    y = torch.randint(0, 4096, (512,), device="cuda")

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def run(build, steps=5, full=False, before_step=None):
    """``steps`` steps all profiled on a simulated H100: the report, each
    step's peak, and the counter reads each step took."""
    gpu = get_gpu("h100")
    sim = SimulatedAllocator(gpu)
    reads = [0]
    read_and_reset = sim.read_and_reset

    def counted():
        reads[0] += 1
        return read_and_reset()

    sim.read_and_reset = counted
    with VirtualCUDA(gpu, allocator=sim):
        model, opt, step = build()
        peaks, per_step = [], []
        with memprof.track(model, warmup=steps, every=1, full=full) as prof:
            for i in range(steps):
                if before_step is not None:
                    before_step(model, i)
                start = reads[0]
                step()
                per_step.append(reads[0] - start)
                peaks.append(prof.last_peak)
        return prof.report(), peaks, per_step


@pytest.mark.parametrize(
    "build",
    [mlp_ce, lambda: mlp_ce(torch.optim.AdamW, ckpt=True), adam_linear],
    ids=["peak-in-loss", "checkpointed-adamw", "peak-in-optimizer"],
)
def test_cheap_steps_report_what_full_ones_do(build):
    ref, ref_peaks, ref_reads = run(build, full=True)
    r, peaks, reads = run(build)
    assert [(p.step, p.phase, p.bytes) for p in peaks] == [(p.step, p.phase, p.bytes) for p in ref_peaks]
    assert r.peak == ref.peak
    assert r.modules.equals(ref.modules)
    assert r.optimizer_state == ref.optimizer_state
    assert r.steps.equals(ref.steps.assign(seconds=r.steps["seconds"]))
    assert ref.meta["full_profiles"] == [0, 1, 2, 3, 4]
    # Two full steps that peak at the same moment, then cheap ones: step 0
    # creates the optimizer's state and cuBLAS's workspace, so the steady
    # step may peak elsewhere, and only steps 1 and 2 agree.
    full = r.meta["full_profiles"]
    assert full in ([0, 1], [0, 1, 2])
    cheap = [n for i, n in enumerate(reads) if i not in full]
    assert cheap and max(cheap) <= min(ref_reads)
    if len(r.modules) > 1:  # a lone module has no boundaries to skip
        assert max(cheap) * 3 < min(ref_reads)


def test_a_step_that_changes_is_profiled_in_full_again():
    """Step 3 makes a 64 MiB temporary inside a block's forward: its peak lies
    between samples a cheap step skips, so steps 4 and 5 are profiled in full. The
    peak's bytes are exact either way (the allocator's counters)."""

    def spike(model, i):
        model[2].spike = 64 * MiB if i == 3 else 0

    ref, ref_peaks, _ = run(mlp_ce, steps=6, full=True, before_step=spike)
    r, peaks, _ = run(mlp_ce, steps=6, before_step=spike)
    assert ref_peaks[3].allocated > ref_peaks[2].allocated
    assert [p.allocated for p in peaks] == [p.allocated for p in ref_peaks]
    # Step 0 peaks in backward, where autograd's thread takes its cuBLAS workspace;
    # steps 1 and 2 agree, so step 3 is cheap.
    assert r.meta["full_profiles"] == [0, 1, 2, 4, 5]
    assert ref_peaks[3].phase == "forward Sequential.2"  # where the full step saw it
    assert peaks[3].phase != ref_peaks[3].phase  # a cheap step's coarse interval
    assert peaks[4] == ref_peaks[4] and peaks[5] == ref_peaks[5]


def _readings():
    return (
        torch.cuda.max_memory_allocated(),
        torch.cuda.max_memory_reserved(),
        torch.cuda.memory_stats()["allocated_bytes.all.peak"],
    )


@pytest.mark.parametrize("full", [False, True])
def test_scripts_peak_readings_are_left_alone_simulated(full):
    """A script that logs torch.cuda's peaks reads the same with and without
    memprof, also after resetting them itself."""

    def readings(tracked: bool) -> list:
        gpu = get_gpu("h100")
        out: list = []
        with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
            model, opt, step = mlp_ce(torch.optim.AdamW)
            with memprof.track(model, warmup=4, every=1, full=full) if tracked else contextlib.nullcontext():
                for i in range(4):
                    step()
                    out.append(_readings())
                    if i == 1:
                        torch.cuda.reset_peak_memory_stats()
        return out

    untracked = readings(False)
    assert readings(True) == untracked
    assert untracked[0][0] > untracked[0][2] - 1  # sanity: the readings are the allocator's


def test_kept_peaks_fold_apply_clear():
    def stats(alloc_peak, reserved_peak, oversize_peak):
        return {
            "allocated_bytes": {"all": {"current": 10, "peak": alloc_peak}, "large_pool": {"current": 8, "peak": alloc_peak}},
            "reserved_bytes": {"all": {"current": 20, "peak": reserved_peak}},
            "oversize_allocations": {"current": 0, "peak": oversize_peak},
            "num_ooms": 0,
        }

    kept = allocator.KeptPeaks()
    kept.fold(stats(100, 200, 3))
    kept.fold(stats(50, 300, 1))  # peaks since the previous reset
    s = kept.apply(stats(10, 20, 0))
    assert s["allocated_bytes"]["all"]["peak"] == 100 and s["allocated_bytes"]["large_pool"]["peak"] == 100
    assert s["reserved_bytes"]["all"]["peak"] == 300
    assert s["oversize_allocations"]["peak"] == 3
    assert s["allocated_bytes"]["all"]["current"] == 10 and s["num_ooms"] == 0
    kept.clear()
    assert kept.apply(stats(10, 20, 0)) == stats(10, 20, 0)


def test_user_view_wraps_and_restores_torch_bindings(monkeypatch):
    """While the tracker runs, torch's bindings answer the kept peaks for the
    tracked device only, and a reset by the script clears them; afterwards
    the original bindings are back."""
    state = {"peak": 5}

    def fake_stats(device):
        return {"allocated_bytes": {"all": {"current": 1, "peak": state["peak"]}},
                "reserved_bytes": {"all": {"current": 2, "peak": 2}}}

    def fake_reset(device):
        state["peak"] = 1

    monkeypatch.setitem(allocator._STATS, "_cuda_memoryStats", fake_stats)
    monkeypatch.setitem(allocator._RESETS, "_cuda_resetPeakMemoryStats", fake_reset)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", fake_stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", fake_reset, raising=False)
    counters = allocator.DeviceCounters(torch.device("cuda", 0))
    with counters.user_view():
        assert counters.read_and_reset().peak_allocated == 5  # the tracker's reset...
        assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"] == 5  # ...unseen by the script
        assert torch._C._cuda_memoryStats(1)["allocated_bytes"]["all"]["peak"] == 1  # another device: as is
        torch._C._cuda_resetPeakMemoryStats(0)  # the script's own reset
        assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"] == 1
    assert torch._C._cuda_memoryStats is fake_stats and torch._C._cuda_resetPeakMemoryStats is fake_reset


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated-gpu"])
def test_optimizer_found_at_its_step_counts_from_the_steps_start(simulated):
    """track(model) entered mid-training meets the optimizer only at its
    first step(); its state, made earlier, is counted from the step's start
    exactly as when the optimizer is given."""

    def report(given: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
        x = torch.randn(512, 512)
        if simulated:
            model, x = model.cuda(), x.cuda()
        opt = torch.optim.AdamW(model.parameters())

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step()  # the optimizer's state exists before tracking begins
        with memprof.track(model, opt if given else None, warmup=2, every=1) as prof:
            step()
            step()
        return prof.report()

    def run_once(given: bool):
        if not simulated:
            return report(given)
        gpu = get_gpu("h100")
        with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
            return report(given)

    found, given = run_once(False), run_once(True)
    assert found.peak == given.peak and found.modules.equals(given.modules)
    step0 = found.timeline[found.timeline["step"] == 0]
    # Two 1 MiB weights' exp_avg and exp_avg_sq (and, on the CPU, the 4-byte step counters)
    assert (step0["optimizer_state"] == 4 * MiB + (0 if simulated else 8)).all()
    assert found.timeline.equals(given.timeline)


class Fan(nn.Module):
    """Widens to 16x and back: its backward makes two wide gradients while the
    wide activations are still saved, the step's peak, in the middle of backward."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, 16 * d), nn.ReLU(), nn.Linear(16 * d, d)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def deep_peak():
    """The peak in the backward of the second of three blocks of 24 Linears, many nodes after the loss."""
    torch.manual_seed(0)
    layers = [nn.Linear(128, 256)]
    for i in range(3):
        layers += [nn.Linear(256, 256) for _ in range(24)] + ([Fan()] if i == 1 else [])
    model = nn.Sequential(*layers, nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 128, device="cuda")

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def test_a_cheap_step_hooks_only_the_nodes_before_its_peak(monkeypatch):
    """The peak falls in Fan's backward, after the backward of the 25 layers above
    it: a cheap step hooks the autograd nodes backward runs until then (with a
    margin), not the whole graph, and reports what a full step does."""
    calls = []
    on_node_grads = memprof.tracker.Tracker._on_node_grads

    def counted(self, grad_inputs, grad_outputs):
        calls[-1] += 1
        return on_node_grads(self, grad_inputs, grad_outputs)

    monkeypatch.setattr(memprof.tracker.Tracker, "_on_node_grads", counted)

    def count_step(model, i):
        calls.append(0)

    ref, ref_peaks, _ = run(deep_peak, full=True, before_step=count_step)
    full_calls, calls[:] = calls[1:], []
    r, peaks, _ = run(deep_peak, before_step=count_step)
    assert ref_peaks[-1].phase == "backward Sequential.49.act"  # Fan's
    assert [(p.step, p.phase, p.bytes) for p in peaks] == [(p.step, p.phase, p.bytes) for p in ref_peaks]
    assert r.meta["full_profiles"] == [0, 1]
    # A full step's backward runs every node; a cheap one those backward runs
    # before the peak (the head's, the 24 Linears' above Fan, Fan's), and the margin.
    assert calls[:2] == full_calls[:2] and len(set(full_calls)) == 1
    cheap = calls[2:]
    assert len(set(cheap)) == 1 and cheap[0] < full_calls[0] * 3 // 4
