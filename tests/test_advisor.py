"""The advisor on the CPU: budgets, plans, ranking on the simulated GPU, max batch size."""

import logging
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from memprof.advisor import Advice, advise, default_plans, max_batch_size, parse_budget, simulate_plan, verify
from memprof.devices import CATALOGUE, get_gpu
from memprof.simulate import NON_PYTORCH_BYTES
from memprof.strategies import Accumulation, Autocast, Checkpointing, ZeRO
from memprof.units import fmt_bytes
from memprof.workload import Workload
from conftest import cuda
from models import FF, MiB, mlp

H100 = get_gpu("h100")


def ff_workload(batch: int = 4096):
    torch.manual_seed(0)
    model = nn.Sequential(*[FF() for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, 256, device="cuda")
    return Workload(model, opt, x, lambda m, x: m(x).square().mean())


# -- parse_budget -------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * 2**30),
        ("24 gib", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("512MiB", 512 * 2**20),
        ("25769803776", 25769803776),
        (25769803776, 25769803776),
    ],
)
def test_parse_budget_sizes(text, expected):
    assert parse_budget(text) == (expected, None)


def test_parse_budget_gpu_name():
    nbytes, gpu = parse_budget("rtx4090")
    assert gpu is CATALOGUE["RTX4090-24GB"]
    # 24 GiB of memory less what CUDA's context and libraries keep outside PyTorch.
    assert nbytes == 24 * 2**30 - NON_PYTORCH_BYTES == 24 * 2**30 - 1_450_000_000
    assert parse_budget(H100) == (80 * 2**30 - NON_PYTORCH_BYTES, H100)


@pytest.mark.parametrize("bad", ["lots", "24 parsecs", "rtx9090", "GiB"])
def test_parse_budget_bad_string_lists_gpus(bad):
    with pytest.raises(ValueError) as err:
        parse_budget(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "neither a size (e.g. 24GiB, 80GB) nor a GPU" in msg
    assert all(name in msg for name in CATALOGUE)  # every valid GPU name is offered


@pytest.mark.parametrize("bad", [0, -5, "0GB", "0"])
def test_parse_budget_not_positive(bad):
    with pytest.raises(ValueError, match="budget must be positive"):
        parse_budget(bad)


# -- default_plans --------------------------------------------------------------------
def test_default_plans_single_gpu():
    plans = default_plans()
    assert list(plans)[0] == "baseline" and plans["baseline"]() == []
    assert not any("pure_bf16" in name or "zero" in name for name in plans)
    # 2 precisions x (ckpt or not) x 4 accumulations, less the empty plan,
    # 2 precisions x 2 offloads, and the baseline.
    assert len(plans) == 2 * 2 * 4 - 1 + 2 * 2 + 1 == 20
    for name in ("bf16", "ckpt", "accum8", "bf16+ckpt+accum4", "offload_act", "bf16+offload_states"):
        assert name in plans
    # Each name is what its strategies are called, and each call makes fresh ones.
    for name, factory in plans.items():
        first, second = factory(), factory()
        assert "+".join(s.name for s in first) == name or (name == "baseline" and first == [])
        assert all(a is not b for a, b in zip(first, second))


def test_default_plans_pure_bf16_when_asked():
    plans = default_plans(pure_bf16=True)
    assert {"pure_bf16", "pure_bf16+ckpt", "pure_bf16+ckpt+accum8"} <= set(plans)
    assert len(plans) == 20 + 8  # 2 x 4 pure bf16 plans more


def test_default_plans_world_size_adds_zero():
    plans = default_plans(world_size=4)
    zero = [n for n in plans if "zero" in n]
    assert {"zero1x4", "zero2x4", "zero3x4"} <= set(zero)
    # Each stage, and stage 3 with CPU offload, alone, with bf16, and with bf16 and checkpointing.
    assert len(zero) == 12 and {"bf16+ckpt+zero3x4", "zero3x4_offload", "bf16+ckpt+zero3x4_offload"} <= set(zero)
    assert plans["bf16+zero3x4_offload"]()[-1].offload
    s = plans["zero2x4"]()
    assert len(s) == 1 and isinstance(s[0], ZeRO) and (s[0].stage, s[0].world_size) == (2, 4)
    assert [type(x) for x in plans["bf16+ckpt+zero1x4"]()] == [Autocast, Checkpointing, ZeRO]


# -- advise -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def predictions():
    base = simulate_plan(ff_workload, list, H100)
    bf16_ckpt = simulate_plan(ff_workload, lambda: [Autocast("bf16"), Checkpointing()], H100, baseline=base.report)
    return base, bf16_ckpt


@pytest.fixture(scope="module")
def advice(predictions):
    base, bf16_ckpt = predictions
    # The budget is bf16+ckpt's predicted peak reserved, exactly: with no
    # margin it fits (the bound is inclusive), and the baseline does not.
    assert bf16_ckpt.peak_reserved < base.peak_reserved
    return advise(ff_workload, bf16_ckpt.peak_reserved, target="h100", margin=0.0, progress=False)


def test_advise_ranks_fastest_fitting_first(advice, predictions):
    base, bf16_ckpt = predictions
    t = advice.table
    assert list(t.columns) == ["peak_allocated", "peak_reserved", "fits", "seconds", "slowdown", "device_share", "why",
                               "changes"]
    assert (t["changes"] == "").all()
    assert ((t["device_share"] > 0) & (t["device_share"] <= 1)).all()
    plain = t[["expandable" not in n.split("+") for n in t.index]]
    assert t.index.name == "plan" and set(plain.index) == set(default_plans())
    # Plans faster than every plan that fits, which fit by their allocated memory but not by their
    # reserved memory, are simulated again with expandable segments (the test below).
    fastest = plain[plain["fits"]]["seconds"].min()
    again = {f"{n}+expandable" for n, r in plain.iterrows()
             if r["peak_allocated"] <= advice.budget < r["peak_reserved"] and r["seconds"] < fastest}
    assert set(t.index) - set(plain.index) == again
    assert advice.budget == bf16_ckpt.peak_reserved and advice.gpu is H100 and advice.world_size == 1
    # A plan fits when its predicted peak reserved is within the budget (margin 0).
    assert (t["fits"] == (t["peak_reserved"] <= advice.budget)).all()
    assert t.loc["bf16+ckpt", "fits"] and not t.loc["baseline", "fits"]
    # Fitting plans first, fastest first; then those that do not fit, smallest first.
    fitting = t[t["fits"]]
    assert t["fits"].tolist() == sorted(t["fits"].tolist(), reverse=True)
    assert fitting["seconds"].is_monotonic_increasing
    assert t[~t["fits"]]["peak_reserved"].is_monotonic_increasing
    assert t.index[0] == fitting["seconds"].idxmin() == advice.best
    # The rows are the plans' predictions, the baseline's among them.
    assert t.loc["baseline", "peak_reserved"] == base.peak_reserved
    assert t.loc["baseline", "peak_allocated"] == base.peak_allocated
    assert t.loc["baseline", "slowdown"] == 1.0
    assert t.loc["bf16+ckpt", "peak_reserved"] == bf16_ckpt.peak_reserved
    assert t.loc["bf16+ckpt", "seconds"] == pytest.approx(bf16_ckpt.seconds, rel=0.02)  # see the test below
    assert t.loc["bf16+ckpt", "slowdown"] == pytest.approx(t.loc["bf16+ckpt", "seconds"] / base.seconds, rel=1e-12)
    assert advice.baseline.meta["plan"] == "baseline"


def test_advise_best_prediction_reproduces(advice):
    best = advice.best
    pred = simulate_plan(ff_workload, advice.plans[best], H100, baseline=advice.baseline)
    assert pred.peak_reserved == advice.table.loc[best, "peak_reserved"] <= advice.budget
    assert pred.peak_allocated == advice.table.loc[best, "peak_allocated"]


def test_advise_margin_is_applied(predictions):
    base, bf16_ckpt = predictions
    plans = {n: f for n, f in default_plans().items() if n in ("baseline", "bf16+ckpt")}
    # With 5 % margin the same budget no longer holds bf16+ckpt: nothing fits.
    a = advise(ff_workload, bf16_ckpt.peak_reserved, target="h100", margin=0.05, plans=plans, progress=False)
    assert not a.table["fits"].any() and a.best is None
    # 5 % above its peak reserved it fits again.
    b = advise(ff_workload, int(bf16_ckpt.peak_reserved * 1.05) + 1, target="h100", plans=plans, progress=False)
    assert b.best == "bf16+ckpt" and b.table.index.tolist() == ["bf16+ckpt", "baseline"]


def test_a_plan_as_fast_as_the_step_as_it_is_ranks_after_it():
    """A plan that changes nothing the step runs (bf16 autocast on a model that computes in
    bf16 already) predicts the baseline's time: the baseline is recommended, and ties
    keep their order."""
    import pandas as pd

    from memprof.advisor import best_of, rerank

    table = pd.DataFrame({"peak_allocated": [4, 3, 3, 2], "peak_reserved": [8 * MiB, 6 * MiB, 6 * MiB, 4 * MiB],
                          "seconds": [0.05 + 1e-12, 0.05, 0.05, 0.09]},
                         index=pd.Index(["bf16", "baseline", "ckpt", "accum2"], name="plan"))
    ranked = rerank(table, budget=10 * MiB)
    assert list(ranked.index) == ["baseline", "bf16", "ckpt", "accum2"] and best_of(ranked) == "baseline"
    assert list(rerank(table, budget=7 * MiB).index) == ["baseline", "ckpt", "accum2", "bf16"]
    # less than 2 % faster is no reason to change the script (a TorchScript LSTM's bf16: -0.5 %); 2 % is
    table.loc["bf16", "seconds"] = 0.05 * 0.985
    assert best_of(rerank(table, budget=10 * MiB)) == "baseline"
    table.loc["bf16", "seconds"] = 0.05 * 0.979
    assert list(rerank(table, budget=10 * MiB).index) == ["bf16", "baseline", "ckpt", "accum2"]


def test_advise_renders_with_rich(advice):
    console = Console(record=True, width=80)
    console.print(advice)
    text = console.export_text()
    assert "fastest that fits first" in text and "H100-80GB" in text
    for col in ("plan", "reserved", "saves", "vs now", "fits", "step", "time"):
        assert col in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in advice.table.index}
    assert set(lines) == set(advice.table.index)  # every plan name whole in 80 columns
    assert all(len(line) <= 80 for line in text.splitlines())
    assert " yes " in lines[advice.best] and " no " in lines["baseline"] and lines["baseline"].rstrip().endswith("+0%")
    base = advice.table.loc["baseline", "peak_reserved"]
    best = advice.table.loc[advice.best, "peak_reserved"]
    assert f"{fmt_bytes(base - best)} {100 * (1 - best / base):.0f}%" in lines[advice.best]  # the saving vs now


def test_advise_skips_plans_that_cannot_run(caplog):
    def make():
        model = mlp().cuda()  # Linear, ReLU, Linear: no repeated blocks to checkpoint
        return Workload(model, torch.optim.AdamW(model.parameters()), torch.randn(64, 512, device="cuda"), lambda m, x: m(x).sum())

    plans = {"baseline": list, "ckpt": lambda: [Checkpointing()], "bf16": lambda: [Autocast("bf16")]}
    with caplog.at_level(logging.WARNING, logger="memprof.advisor"):
        a = advise(make, "1GiB", plans=plans, progress=False)
    assert set(a.table.index) == {"baseline", "bf16"}
    assert a.gpu.name == "H100-80GB"  # no GPU named: an H100
    assert any("plan ckpt could not be simulated" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kw, match", [({"world_size": 0}, "world size"), ({"margin": 1.0}, "margin"), ({"margin": -0.1}, "margin")])
def test_advise_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        advise(ff_workload, "1GiB", progress=False, **kw)


# -- max_batch_size ----------------------------------------------------------------------
def _optimizer_replays(monkeypatch) -> list:
    """The events of every optimizer step replayed from now on (``SimulatedAllocator.replay``
    called by ``_OptimizerSteps``' step, not by ``_Repeats`` for micro-batches)."""
    from memprof.simulate import SimulatedAllocator

    replays, replay = [], SimulatedAllocator.replay

    def spy(self, events):
        if sys._getframe(1).f_code.co_name == "step":
            replays.append(events)
        return replay(self, events)

    monkeypatch.setattr(SimulatedAllocator, "replay", spy)
    return replays

def _fits(b: int, budget: int, margin: float = 0.05) -> bool:
    p = simulate_plan(lambda: ff_workload(b), list, H100)
    return p.peak_reserved * (1 + margin) <= budget


def test_max_batch_size_is_the_largest_that_fits():
    budget = 160 * MiB
    b = max_batch_size(ff_workload, budget, target="h100")
    # The batch-4096 baseline reserves 206 MiB and a batch of 1 about 50 MiB
    # (weights, AdamW state and the 32 MiB cuBLAS workspace).
    assert 1 < b < 4096
    assert _fits(b, budget) and not _fits(b + 1, budget)


def test_max_batch_size_replays_the_optimizer_step_across_batch_sizes(monkeypatch):
    """Every batch size has the same parameters and gradients: the optimizer's
    step runs at the first size tried and is replayed at the others, with the
    answer of running it at each."""
    from memprof.advisor import _OptimizerSteps

    replays, calls = _optimizer_replays(monkeypatch), []
    sizes = lambda n: calls.append(n) or ff_workload(n)  # noqa: E731
    b = max_batch_size(sizes, 160 * MiB, target="h100")
    # Every size but the first and the answer's full simulation (tracked) is replayed.
    assert len(calls) > 10 and len(replays) == len(calls) - 2
    monkeypatch.setattr(_OptimizerSteps, "key", staticmethod(lambda optimizer: None))
    assert max_batch_size(ff_workload, 160 * MiB, target="h100") == b


def test_max_batch_size_too_small_and_limit():
    # 8 MiB of weights and 16 MiB of AdamW state alone take more than 20 MiB.
    assert max_batch_size(ff_workload, 20 * MiB, target="h100") == 0
    # A budget every batch up to the limit fits: the limit.
    assert max_batch_size(ff_workload, "1GiB", target="h100", limit=100) == 100
    assert max_batch_size(ff_workload, "1GiB", target="h100", limit=64) == 64


# -- verify ------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_verify_without_cuda_raises(advice):
    with pytest.raises(RuntimeError, match=r"verify\(\) measures on a CUDA GPU and none is available"):
        verify(ff_workload, advice)


def test_a_measured_steps_spread_is_slowest_less_fastest_over_the_median():
    from memprof.advisor import _spread

    assert _spread([0.10, 0.13, 0.11]) == pytest.approx(0.03 / 0.11)
    assert _spread([0.2]) == 0.0


def test_advice_is_an_advice(advice):
    assert isinstance(advice, Advice) and advice.plans.keys() == set(default_plans()) | set(advice.table.index)


def test_max_batch_size_with_micro_batches_tries_multiples():
    from memprof.strategies import Accumulation

    budget = 160 * MiB
    b = max_batch_size(ff_workload, budget, lambda: [Accumulation(4)], target="h100")
    assert b > 0 and b % 4 == 0

    def fits(n):
        p = simulate_plan(lambda: ff_workload(n), lambda: [Accumulation(4)], H100)
        return p.peak_reserved * 1.05 <= budget

    assert fits(b) and not fits(b + 4)


def test_parse_budget_any_case_and_baseline_added():
    assert parse_budget("24GIB")[0] == 24 * 2**30
    a = advise(ff_workload, "1GiB", plans={"bf16": lambda: [Autocast("bf16")]}, target="h100", progress=False)
    assert set(a.table.index) == {"baseline", "bf16"}


# -- many plans on one build ----------------------------------------------------------
class Block(nn.Module):
    """A pre-norm transformer-style block: repeated, so checkpointing finds it."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 256, n: int = 4) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(32, d), nn.Linear(d, 8)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def block_workload(batch: int = 64):
    torch.manual_seed(0)
    model = Stack().cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, 128, 32, device="cuda")
    return Workload(model, opt, x, lambda m, x: m(x).float().square().mean())


def test_plans_that_checkpoint_other_blocks_are_simulated_apart():
    """Two checkpointing plans named alike ("ckpt") but over other blocks shared one simulated step."""
    from memprof.advisor import simulate_plans
    from memprof.strategies import Checkpointing

    gpu = get_gpu("h200")
    plans = {"all": [Checkpointing()], "first": [Checkpointing(blocks=["blocks.0"])]}
    _, preds = simulate_plans(block_workload, plans, gpu, jobs=1)
    assert preds["first"].peak_allocated > preds["all"].peak_allocated
    assert Checkpointing(blocks=["blocks.0"]).key == "ckpt(blocks.0)" and Checkpointing().key == "ckpt"


def test_plans_on_one_build_equal_their_own_simulations():
    """Every plan simulated on one build (strategies undone between plans, the
    allocator rewound, the second step replayed from the first's events and
    repeated micro-batches skipped) gives the bytes and time of its own fresh
    simulation, exactly."""
    from memprof.advisor import simulate_plans

    gpu = get_gpu("h200")
    plans = {name: factory() for name, factory in default_plans(2, gpu=gpu).items()}
    assert len(plans) > 30
    base, derived = simulate_plans(block_workload, plans, gpu)
    for name, factory in default_plans(2, gpu=gpu).items():
        full = simulate_plan(block_workload, factory, gpu)
        got = derived[name]
        assert (got.peak_allocated, got.peak_reserved) == (full.peak_allocated, full.peak_reserved), name
        # A tracked step is timed between optimizer steps, a derived one over Workload.step: the host's
        # few operators after the optimizer step fall on either side of the synchronisation.
        assert got.seconds == pytest.approx(full.seconds, rel=0.02), name
        assert got.device_seconds == pytest.approx(full.device_seconds, rel=0.02), name
        assert 0 < got.device_seconds <= got.seconds, name
    assert base.meta["plan"] == "baseline" and base.steps["step"].tolist() == [0, 1]


def _needs_fork() -> None:
    from memprof.parallel import can_fork

    if not can_fork():
        pytest.skip("this process cannot fork simulations (CUDA is initialised here, or not on Linux)")


@cuda
def test_a_simulation_leaves_cuda_uninitialised():
    """On a machine with a GPU, simulating touches no real device, so the plans can still fork."""
    import subprocess

    code = ("import torch; from test_advisor import block_workload; from memprof.advisor import simulate_plan;"
            "from memprof.devices import get_gpu; simulate_plan(block_workload, list, get_gpu('h200'));"
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"


class _Progress:
    """What the advisor's progress bar is told: plans started and done, in order."""

    def __init__(self) -> None:
        self.started, self.done = [], []

    def now(self, name: str) -> None:
        self.started.append(name)

    def __call__(self, name: str) -> None:
        self.done.append(name)


def test_plans_in_forked_processes_equal_plans_in_this_one():
    """Two forked copies of the build run the plans, handed out one at a time:
    every plan's bytes and seconds are those of running them all in this
    process, to the bit (each starts from the build's state and clock)."""
    from memprof.advisor import simulate_plans

    _needs_fork()
    gpu = get_gpu("h200")
    plans = lambda: {name: factory() for name, factory in default_plans(2, gpu=gpu).items()}  # noqa: E731
    runs = {}
    for jobs in (2, 1):  # forked first: where a GPU is visible, a backward here would keep later plans here
        progress = _Progress()
        base, preds = simulate_plans(block_workload, plans(), gpu, jobs=jobs, advance=progress)
        runs[jobs] = {name: (p.peak_allocated, p.peak_reserved, p.seconds, p.device_seconds) for name, p in preds.items()}
        assert sorted(progress.done) == sorted(plans())  # every plan once
        # One plan per distinct one-rank step starts, the baseline's first (ZeRO's and state
        # offload's plans share theirs).
        assert len(progress.started) == len(set(progress.started)) == 18 and progress.started[0] == "baseline"
        assert base.steps["step"].tolist() == [0, 1]
    assert runs[1] == runs[2] and len(runs[2]) == len(plans()) > 30


class _Fails(Checkpointing):
    """Checkpointing whose blocks fail in their forward, as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.name = how, f"fails-{how}"

    def apply_simulated(self, workload: Workload) -> None:
        super().apply_simulated(workload)
        how = self.how

        def forward(*args, **kwargs):
            if how == "exit":  # the process ends, as the kernel's out-of-memory killer would end it
                import os

                os._exit(3)
            raise _TwoArgumentError("midway", "through a step") if how == "unpicklable" else RuntimeError("boom")

        for block in workload.model.blocks:
            block.forward = forward


class _TwoArgumentError(Exception):
    def __init__(self, where: str, what: str) -> None:  # pickle calls cls(message): it cannot be rebuilt
        super().__init__(f"{where} {what}")


def test_plans_that_fail_in_a_forked_process():
    """A plan whose step raises midway leaves its process's build unusable: that
    process stops, the others take the plans left, and the plans no process
    took get a new build. A process that dies is reported under its plan; an
    exception that cannot be pickled comes back as a RuntimeError with its message."""
    from memprof.advisor import simulate_plans

    _needs_fork()  # in this process, the plan that ends its process would end the tests
    gpu = get_gpu("h200")
    plans = {"baseline": [], "broken": [_Fails("raise")], "unpicklable": [_Fails("unpicklable")],
             "exit": [_Fails("exit")], "accum2": [Accumulation(2)], "ckpt": [Checkpointing()], "bf16": [Autocast("bf16")]}
    _, preds = simulate_plans(block_workload, plans, gpu, jobs=2)
    good = {name: plans[name] for name in ("baseline", "accum2", "ckpt", "bf16")}
    _, alone = simulate_plans(block_workload, good, gpu, jobs=1)
    for name, pred in alone.items():
        assert (preds[name].peak_reserved, preds[name].seconds) == (pred.peak_reserved, pred.seconds), name
    assert isinstance(preds["broken"], RuntimeError) and str(preds["broken"]) == "boom"
    assert type(preds["unpicklable"]) is RuntimeError and str(preds["unpicklable"]) == "_TwoArgumentError: midway through a step"
    assert isinstance(preds["exit"], RuntimeError) and str(preds["exit"]).startswith(
        "its process ended without an answer (exit code 3")


@pytest.mark.parametrize("cpu_max, expected", [("max 100000\n", 2), ("150000 100000\n", 2), ("100000 100000", 1),
                                               ("50000 100000", 1), (None, 2)])
def test_default_jobs_follow_the_containers_cpu_quota(monkeypatch, tmp_path, cpu_max, expected):
    import os

    from memprof import parallel

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two CPUs to run on
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(parallel, "CPU_MAX", str(path))
    assert parallel.default_jobs() == expected


def test_jobs_must_be_a_positive_integer():
    from memprof.advisor import simulate_plans

    with pytest.raises(ValueError, match=r"jobs must be an integer >= 1 \(1: every plan in this process\), got 0"):
        simulate_plans(block_workload, {"baseline": []}, get_gpu("h200"), jobs=0)


def test_a_replayed_optimizer_step_changes_nothing(monkeypatch):
    """The optimizer's first step, run for the first untracked plan and replayed
    from its allocation events for the others, gives every plan the bytes and
    seconds running it gives."""
    from memprof.advisor import _OptimizerSteps, simulate_plans

    gpu = get_gpu("h200")
    replays = _optimizer_replays(monkeypatch)
    plans = lambda: {name: factory() for name, factory in default_plans(1, gpu=gpu).items()}  # noqa: E731
    _, replayed = simulate_plans(block_workload, plans(), gpu, jobs=1)  # the replays counted here
    # 20 plans: the baseline and bf16 steps are tracked (state offload's adjustment reads their
    # samples), 16 more run untracked; the first of them records the optimizer step.
    assert len(plans()) == 20 and len(replays) == 15
    # AdamW's state: exp_avg and exp_avg_sq of every parameter, made by the step and kept.
    params = sum(p.numel() * 4 for p in Stack().parameters())  # fp32
    made = [e[2] for e in replays[0] if e[0] == "m"]
    freed = {e[1] for e in replays[0] if e[0] == "f"}
    kept = sum(e[2] for e in replays[0] if e[0] == "m" and e[1] not in freed)
    assert kept == 2 * params and len(made) > len(freed)

    monkeypatch.setattr(_OptimizerSteps, "key", staticmethod(lambda optimizer: None))  # run every step
    replays.clear()
    _, run = simulate_plans(block_workload, plans(), gpu, jobs=1)
    assert replays == []
    for name, pred in run.items():
        got = replayed[name]
        assert (got.peak_allocated, got.peak_reserved, got.seconds, got.device_seconds) == (
            pred.peak_allocated, pred.peak_reserved, pred.seconds, pred.device_seconds), name


@pytest.mark.parametrize("make_optimizer", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, fused=True),
    lambda ps: torch.optim.Adam(ps, foreach=False),
    lambda ps: torch.optim.Adafactor(ps),
    lambda ps: torch.optim.RMSprop(ps),
    lambda ps: torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(ps), 1).optimizer,  # its step wrapped by the scheduler
], ids=["sgd-momentum", "adamw-fused", "adam-for-loop", "adafactor", "rmsprop", "adamw-steplr"])
def test_other_optimizers_replay_as_they_run(monkeypatch, make_optimizer):
    from memprof.advisor import _OptimizerSteps, simulate_plans

    replays = _optimizer_replays(monkeypatch)

    optimizers = []

    def make():
        w = block_workload()
        w.optimizer = make_optimizer(list(w.model.parameters()))
        optimizers.append((w.optimizer, w.optimizer.__dict__.get("step")))
        return w

    plans = lambda: {"baseline": [], "accum2": [Accumulation(2)], "ckpt": [Checkpointing()],  # noqa: E731
                     "bf16+accum2": [Autocast("bf16"), Accumulation(2)]}
    _, replayed = simulate_plans(make, plans(), get_gpu("h200"), jobs=1)
    assert len(replays) == 2  # accum2 runs the step (the baseline's is tracked); ckpt and bf16+accum2 replay it
    assert all(o.__dict__.get("step") is own for o, own in optimizers)  # the optimizer's own step is back
    monkeypatch.setattr(_OptimizerSteps, "key", staticmethod(lambda optimizer: None))
    _, run = simulate_plans(make, plans(), get_gpu("h200"), jobs=1)
    for name, pred in run.items():
        got = replayed[name]
        assert (got.peak_allocated, got.peak_reserved, got.seconds) == (
            pred.peak_allocated, pred.peak_reserved, pred.seconds), name


@pytest.mark.parametrize("keeps", [False, True], ids=["replayed", "periods"])
def test_repeated_micro_batches_run_once_and_change_nothing(keeps):
    """With 8 micro-batches, the simulation runs the first and replays the
    events a later one has (derived from the first's) for the other seven,
    with the bytes, seconds and busy seconds of running all 8, to the bit.
    Where each micro-batch frees a block of the one before (a loss function
    that holds on to the last micro-batch's output), neither the first's nor
    the second's events are a later one's: it runs them until the
    allocator's layout repeats and skips whole periods."""
    from memprof.advisor import _Repeats
    from memprof.simulate import SimulatedAllocator, _state_tensors
    from memprof.strategies import Accumulation
    from memprof.virtual_cuda import VirtualCUDA

    gpu = get_gpu("h200")
    results = []
    for skip in (False, True):
        calls, held = [], {}
        allocator = SimulatedAllocator(gpu)
        with VirtualCUDA(gpu, allocator=allocator):
            with torch.device("meta"):
                w = block_workload()
            allocator.adopt(_state_tensors(w.model, w.optimizer))
            loss_fn = w.loss_fn

            def counted(m, x):
                calls.append(1)
                if keeps:
                    held["last"] = m(x).detach()  # frees the one before: a block from an earlier micro-batch
                return loss_fn(m, x)

            w.loss_fn = counted
            Accumulation(8).apply(w)
            w.repeats = _Repeats(allocator, w.model) if skip else (lambda i, n: 0)  # a simulation that runs every one
            for _ in range(2):
                allocator.reset_peak()
                start = allocator.mark()
                w.step()
            c = allocator.since(start)
            results.append((c.peak_allocated, c.peak_reserved, c.seconds, c.busy, len(calls)))
    (full_a, full_r, full_s, full_b, full_n), (a, r, s, b, n) = results
    assert (a, r) == (full_a, full_r) and full_n == 16  # two steps of 8 micro-batches
    assert 0 < b < s
    if not keeps:
        assert (s, b) == (full_s, full_b) and n == 2
    else:  # skipped periods are charged as whole periods of both clocks
        assert s == pytest.approx(full_s, rel=0.01) and b == pytest.approx(full_b, rel=0.01) and 2 < n < 12


def test_small_steps_are_host_bound_and_large_ones_device_bound():
    """The device's busy share of a step: a handful of tiny kernels leave it idle while
    the host issues them; large matrix products keep it busy the whole step. The
    table says which, and the rendered table marks host-bound steps."""
    def make(batch: int, width: int):
        def workload():
            model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).cuda()
            return Workload(model, torch.optim.SGD(model.parameters()), torch.randn(batch, width, device="cuda"),
                            lambda m, x: m(x).square().mean())
        return workload

    tiny = simulate_plan(make(8, 64), list, H100)
    large = simulate_plan(make(16384, 8192), list, H100)
    assert tiny.device_seconds / tiny.seconds < 0.5  # each kernel its fixed gap (TimeModel.per_kernel), no more
    assert large.device_seconds / large.seconds > 0.99
    a = advise(make(8, 64), "1GiB", target="h100", plans={"baseline": list}, progress=False)
    assert a.table.loc["baseline", "device_share"] == pytest.approx(tiny.device_seconds / tiny.seconds, rel=0.02)
    console = Console(record=True, width=80)
    console.print(a)
    text = console.export_text()
    assert f"{1e3 * a.table.loc['baseline', 'seconds']:.1f} ms*" in text and "* host-bound" in text


def test_plans_close_behind_a_host_bound_recommendation_are_named():
    """Where the host bounds a step, plans that fit within CLOSE_CALL of the recommended one's
    time are named with it: the prediction cannot order them. Device-bound pairs, slower
    plans, plans that do not fit and plans that change the training are not."""
    import pandas as pd

    from memprof.advisor import CLOSE_CALL, recommendation_notes, rerank

    names = ["baseline", "bf16+ckpt", "bf16+accum2", "bf16+accum4", "bf16", "accum2"]
    table = pd.DataFrame({
        "peak_allocated": [9, 4, 5, 3, 8, 5], "peak_reserved": [10 * MiB, 5 * MiB, 6 * MiB, 4 * MiB, 9 * MiB, 6 * MiB],
        "seconds": [0.400, 0.1677, 0.1771, 0.2000, 0.1170, 0.1900],
        "slowdown": 1.0, "device_share": [1.0, 0.82, 0.83, 0.62, 1.0, 0.95], "changes": "",
    }, index=pd.Index(names, name="plan"))
    note = ("bf16+ckpt and bf16+accum2 (6 % slower) are close, and the host bounds a step among them (*): which is "
            "faster follows the host's speed on the day; measure them on the GPU (memprof advise --verify, memprof.verify)")
    # bf16 does not fit; bf16+accum4 is 19 % slower, past CLOSE_CALL; accum2 (13 % slower) is named
    # only because the recommendation is host-bound.
    ranked = rerank(table, 8 * MiB)
    assert CLOSE_CALL == 0.15 and list(ranked.index[ranked["fits"]])[:2] == ["bf16+ckpt", "bf16+accum2"]
    assert recommendation_notes(ranked) == [note.replace("(6 % slower)", "(6 % slower), accum2 (13 % slower)")]
    # Both device-bound: the prediction orders them; nothing to say.
    device = table.assign(device_share=[1.0, 0.95, 0.96, 0.62, 1.0, 0.95])
    assert recommendation_notes(rerank(device, 8 * MiB)) == []
    # A device-bound recommendation with a host-bound plan close behind: named.
    mixed = table.assign(device_share=[1.0, 0.95, 0.83, 0.62, 1.0, 0.95])
    assert recommendation_notes(rerank(mixed, 8 * MiB)) == [note]
    # A plan that changes what training computes is no alternative, close or not.
    changing = table.assign(changes=["", "", "", "", "", "normalizes each micro-batch with its own statistics"])
    assert recommendation_notes(rerank(changing, 8 * MiB)) == [note]
    # Nothing fits: nothing to say.
    assert recommendation_notes(rerank(table, MiB)) == []


def test_micro_batches_derived_from_the_first_equal_running_them(monkeypatch):
    """Every default plan (and the step as it is, tracked), with its later
    micro-batches replayed from the first's events as a later one's, gives
    the bytes, seconds and busy seconds of running every micro-batch, to the
    bit; and runs one micro-batch where accumulation has more."""
    from memprof.advisor import _Repeats, simulate_plans

    gpu = get_gpu("h200")
    plans = lambda: {name: factory() for name, factory in default_plans(2, gpu=gpu).items()}  # noqa: E731
    counted = {}

    def workload():
        w = block_workload()
        loss_fn = w.loss_fn
        w.loss_fn = lambda m, x: counted.__setitem__("calls", counted.get("calls", 0) + 1) or loss_fn(m, x)
        return w

    base, derived = simulate_plans(workload, {"accum8": plans()["accum8"]}, gpu, jobs=1)
    # The step as it is: 3 steps of one micro-batch; accum8: one of its first step's 8, its second step replayed.
    assert counted["calls"] == 3 + 1
    base, derived = simulate_plans(block_workload, plans(), gpu, jobs=1)
    monkeypatch.setattr(_Repeats, "__call__", lambda self, i, n: 0)  # every micro-batch runs
    full_base, full = simulate_plans(block_workload, plans(), gpu, jobs=1)
    for name, p in full.items():
        got = derived[name]
        assert (got.peak_allocated, got.peak_reserved, got.seconds, got.device_seconds) == (
            p.peak_allocated, p.peak_reserved, p.seconds, p.device_seconds), name
    columns = ["peak_allocated", "peak_reserved", "seconds"]
    assert base.steps[columns].equals(full_base.steps[columns])


def test_a_plan_is_undone_after_its_step():
    model = Stack(8, 2)
    w = Workload(model, torch.optim.SGD(model.parameters()), torch.randn(4, 32), lambda m, x: m(x).sum())
    blocks = list(model.blocks)
    with w.plan([Autocast("fp16"), Checkpointing()]):
        assert w.autocast_dtype is torch.float16 and w.scaler is not None and w.applied == ["fp16", "ckpt"]
        assert all("forward" in vars(b) for b in blocks)
    assert w.autocast_dtype is None and w.scaler is None and w.applied == []
    assert all("forward" not in vars(b) for b in blocks)  # the class's forward again


def test_fp16_plans_on_gpus_without_bf16():
    for gpu, half in ((get_gpu("t4"), "fp16"), (get_gpu("v100-16gb"), "fp16"), (H100, "bf16")):
        names = set(default_plans(gpu=gpu))
        assert f"{half}+ckpt+accum4" in names and not any(n.startswith("fp16" if half == "bf16" else "bf16") for n in names)
        plan = default_plans(gpu=gpu)[f"{half}+ckpt"]()
        assert plan[0].dtype == half


def test_a_batch_the_micro_batches_do_not_divide_fails_that_plan_alone(caplog):
    """Accumulation over more micro-batches than the batch holds is left out with the reason,
    without building the workload again for the plans after it."""
    from memprof.strategies import Accumulation

    builds = []

    def make():
        builds.append(1)
        return block_workload(batch=2)

    plans = {"baseline": list, "accum4": lambda: [Accumulation(4)], "accum2": lambda: [Accumulation(2)]}
    with caplog.at_level(logging.WARNING, logger="memprof.advisor"):
        a = advise(make, "24GiB", target="h200", plans=plans, progress=False)
    assert set(a.table.index) == {"baseline", "accum2"} and len(builds) == 1
    assert any("accum4" in r.getMessage() and "cannot be split into 4" in r.getMessage() for r in caplog.records)


def test_why_names_the_largest_category_at_the_peak():
    """A 32768-way cross-entropy outside the model peaks in its backward: the log-probabilities it saves
    (activations), their gradient and the logits' (activation gradients, its nodes hooked: they were
    temporaries) are most of the peak. The reason names that category (it named the optimizer's state)."""
    from memprof.workload import Workload

    def make():
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 32768)).cuda()
        x, y = torch.randn(2048, 256, device="cuda"), torch.randint(0, 32768, (2048,), device="cuda")
        return Workload(model, torch.optim.AdamW(model.parameters()), (x, y),
                        lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))

    advice = advise(make, "24GiB", target="h100", progress=False, plans={"bf16": lambda: [Autocast("bf16")]})
    peak = advice.baseline.peak
    logits = 2048 * 32768 * 4
    assert peak.phase == "loss" and peak.bytes["activation_gradients"] == 2 * logits
    assert logits <= peak.bytes["activations"] < logits + 16 * MiB and peak.bytes["temporaries"] == 1024
    share = 100 * peak.bytes["activation_gradients"] / peak.allocated
    assert advice.table.loc["bf16", "why"].startswith(f"activation_gradients are {share:.0f} % of the baseline peak")


def test_a_plan_that_fits_only_by_its_allocated_memory_is_simulated_again_with_expandable_segments(monkeypatch):
    """The step as it is allocates less than the budget but reserves more (cached blocks no request
    fits): it is simulated again with expandable segments from its build on, as a plan of its own,
    equal to a simulation of that plan by itself. A slower plan is not: it could not change the advice."""
    from memprof.strategies import ExpandableSegments

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    base = simulate_plan(ff_workload, list, H100)
    assert base.peak_allocated < base.peak_reserved
    plans = {n: f for n, f in default_plans().items() if n in ("baseline", "ckpt")}
    a = advise(ff_workload, base.peak_allocated, target="h100", margin=0.0, plans=plans, progress=False)
    alone = simulate_plan(ff_workload, lambda: [ExpandableSegments()], H100)
    t = a.table
    assert set(t.index) == {"baseline", "ckpt", "expandable"}  # not ckpt+expandable: slower than baseline
    assert (t.loc["expandable", "peak_reserved"], t.loc["expandable", "peak_allocated"]) == (
        alone.peak_reserved, alone.peak_allocated)
    assert t.loc["expandable", "peak_reserved"] != base.peak_reserved
    assert t.loc["expandable", "seconds"] == t.loc["baseline", "seconds"]  # no operator changes
    assert [type(s) for s in a.plans["expandable"]()] == [ExpandableSegments]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in __import__("os").environ  # put back after the build
    # Where the user runs with expandable segments already, every plan is simulated with them.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    b = advise(ff_workload, base.peak_allocated, target="h100", margin=0.0, plans=plans, progress=False)
    assert set(b.table.index) == {"baseline", "ckpt"}
    assert b.table.loc["baseline", "peak_reserved"] == alone.peak_reserved
