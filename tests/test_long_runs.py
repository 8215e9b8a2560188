"""Long runs: every step profiled, host memory and the report stay bounded,
and nothing of memprof's stays behind on the model or its inputs."""

import gc
import os
import weakref

import pytest
import torch
from torch import nn

import memprof
from test_tracker import _global_hooks, _model_hooks

MiB = 1 << 20
STEPS = 10_000
HISTORY = 1_000
TIMELINE_STEPS = 3


def _rss() -> int:
    """Resident set size of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    return model, torch.optim.AdamW(model.parameters()), torch.randn(8, 64)


def _step(model, opt, x) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def one_thread():
    """The steps are tiny: a second intra-op thread only waits for the first,
    and where other processes share the cores its spinning makes a step,
    tracked or not, about ten times slower (10,000 steps: 12 s or a minute)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _samples_per_step(report) -> list[int]:
    return report.timeline.groupby("step").size().tolist()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set size from /proc")
def test_ten_thousand_profiled_steps(tmp_path, one_thread):
    model, opt, x = _tiny()
    seen = {}  # steps done -> (saved report's bytes, the report)
    with memprof.track(model, opt, warmup=0, every=1, history=HISTORY, timeline_steps=TIMELINE_STEPS) as prof:
        for n in range(1, STEPS + 1):
            _step(model, opt, x)
            if n in (500, 1_000, STEPS):
                report = prof.report()
                seen[n] = (report.save(tmp_path / f"{n}.json").stat().st_size, report)
                gc.collect()
                if n == 500:  # warmed up: allocator caches, pandas' and json's first calls
                    rss_before = _rss()
        grown = _rss() - rss_before
    assert grown < 50 * MiB

    for n, (_, r) in seen.items():
        rows = min(n, HISTORY)
        assert r.steps["step"].tolist() == list(range(n - rows, n))
        assert r.steps["profiled"].all()
        assert r.meta["steps_total"] == n
        assert r.meta["profiled_steps"] == r.meta["full_profiles"] == list(range(n - rows, n))  # all full on the CPU
        assert sorted(set(r.timeline["step"])) == list(range(n - TIMELINE_STEPS, n))
    # The steady step is sampled alike however long the run has been.
    assert _samples_per_step(seen[STEPS][1]) == _samples_per_step(seen[1_000][1])
    assert seen[STEPS][1].modules.equals(seen[1_000][1].modules)

    # Both reports hold HISTORY step rows, TIMELINE_STEPS steps of samples and
    # the same module table, so only their numbers' widths differ: a row's
    # step number (in the table, profiled_steps and full_profiles) by at most
    # 3 digits ("0" -> "9999") and its `seconds` (a float's repr: 3 to 24
    # characters) by at most 21; a sample's step number and the peak's by 3;
    # steps_total by 1.
    size_1k, size_10k = seen[1_000][0], seen[STEPS][0]
    samples = len(seen[STEPS][1].timeline)
    assert size_10k <= size_1k + HISTORY * (3 * 3 + 21) + (samples + 1) * 3 + 1


class _WithLeaves(nn.Module):
    """A parameter passed to a submodule as it is, and a batch that needs grad: leaves that outlive every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.pass_through = nn.Linear(64, 64), nn.Linear(64, 64), nn.Identity()
        self.pos = nn.Parameter(torch.zeros(8, 64))

    def forward(self, x):
        return self.b(self.a(x) + self.pass_through(self.pos))


def test_no_hooks_pile_up_on_leaves():
    """Hooks on tensors that outlive a step's graph (a leaf input, a
    parameter passed to a module) are removed at the step's end: none piles
    up, no sample repeats, and none outlives the block."""
    torch.manual_seed(0)
    model = _WithLeaves()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 64, requires_grad=True)
    leaves = (x, model.pos)
    with memprof.track(model, opt, warmup=0, every=1) as prof:
        for _ in range(20):
            _step(model, opt, x)
            x.grad = None
            assert [len(t._backward_hooks or {}) for t in leaves] == [0, 0]
    r = prof.report()
    counts = _samples_per_step(r)
    assert len(counts) == 3 and len(set(counts)) == 1
    assert _global_hooks() == (0, 0, 0, 0, None)
    assert _model_hooks(model) == 0
    assert [len(t._backward_hooks or {}) for t in leaves] == [0, 0]
    # Nothing of the block's keeps the tracker alive.
    ref = weakref.ref(prof)
    del prof
    gc.collect()
    assert ref() is None
