"""A pytest plugin: fail a test when a training step needs more GPU memory than a budget.

Installed with memprof (entry point ``pytest11``). In a test::

    @pytest.mark.memprof(budget="24GiB", target="a100-40gb")
    def test_training_fits(memprof_budget):
        memprof_budget(setup)          # setup as for memprof.simulate: builds and returns (model, optimizer, step)

``memprof_budget(setup, step=None, **options)`` simulates ``steps`` training
steps on ``target`` (a catalogue GPU; default the budget's GPU, else an
H100) when a target is named or no GPU is here, and measures them on the
local GPU otherwise. The step fits when its peak reserved memory, plus
``margin`` of it for a simulation's error (0.05 simulated, 0 measured), is
within ``budget`` (``24GiB``, ``80GB``, bytes, or a GPU: its memory less what
CUDA keeps outside PyTorch), the rule ``memprof advise`` uses. Otherwise the
test fails with the breakdown by category; a step that does not fit the
target at all fails with what was live when it ran out. The marker's keyword
arguments are the defaults; the fixture's own override them. It returns the
:class:`memprof.Report`.
"""

from __future__ import annotations

import pytest

__all__ = ["memprof_budget"]

_OPTIONS = ("budget", "target", "steps", "margin")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "memprof(budget, target=None, steps=3, margin=None): the memory budget that the memprof_budget fixture "
        "checks a training step against",
    )


@pytest.fixture
def memprof_budget(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Check a training step against the test's memory budget; see :mod:`memprof.pytest_plugin`."""
    marker = request.node.get_closest_marker("memprof")
    defaults = {}
    if marker is not None:
        unknown = set(marker.kwargs) - set(_OPTIONS)
        if unknown or len(marker.args) > 1:
            raise pytest.UsageError(
                f"@pytest.mark.memprof takes budget (also as its one positional argument) and {_OPTIONS[1:]}, "
                f"got {sorted(unknown) or marker.args}"
            )
        defaults = {**dict(zip(("budget",), marker.args)), **marker.kwargs}

    def check(setup, step=None, **options):
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"memprof_budget takes {_OPTIONS} as keyword arguments, got {sorted(unknown)}")
        return _check(setup, step, {**defaults, **options}, tmp_path_factory.mktemp("memprof-oom"))

    return check


def _check(setup, step, options: dict, oom_dir):
    import torch

    from . import oom
    from .advisor import parse_budget
    from .devices import get_gpu
    from .report import Report
    from .units import fmt_bytes

    if options.get("budget") is None:
        raise pytest.UsageError(
            "memprof_budget needs a budget: mark the test with @pytest.mark.memprof(budget='24GiB') "
            "or call memprof_budget(setup, budget='24GiB')"
        )
    nbytes, named = parse_budget(options["budget"])
    steps = options.get("steps", 3)
    target = options.get("target")
    simulated = target is not None or not torch.cuda.is_available()
    gpu = get_gpu(target) if target is not None else (named or get_gpu("h100")) if simulated else None
    margin = options.get("margin")
    margin = (0.05 if simulated else 0.0) if margin is None else margin
    where = f"the simulated {gpu.name}" if simulated else torch.cuda.get_device_name()
    try:
        report = _simulate(setup, step, gpu, steps, oom_dir) if simulated else _measure(setup, step, steps, oom_dir)
    except torch.OutOfMemoryError:
        found = sorted(oom_dir.glob("memprof-oom-*.json"))
        if not found:
            raise
        at = Report.load(found[-1])
        pytest.fail(f"the training step runs out of memory on {where}.\n{oom.explain(at)}\n\n{at}", pytrace=False)
    peak = int(report.steps["peak_reserved"].max())
    if peak * (1 + margin) > nbytes:
        extra = f" + {margin:.0%} margin" if margin else ""
        pytest.fail(
            f"the training step needs {fmt_bytes(peak)} reserved{extra} on {where} "
            f"({fmt_bytes(report.peak.allocated)} allocated), more than the budget of {fmt_bytes(nbytes)} "
            f"({options['budget']}).\n\n{report}",
            pytrace=False,
        )
    return report


def _simulate(setup, step, gpu, steps: int, oom_dir):
    from .simulate import simulate

    return simulate(setup, step, target=gpu, steps=steps, oom_dir=oom_dir)


def _measure(setup, step, steps: int, oom_dir):
    import torch

    from .simulate import _takes_two, _unpack
    from .tracker import track

    model, optimizer, step = _unpack(setup(), step)
    run = (lambda: step(model, optimizer)) if _takes_two(step) else step
    torch.cuda.synchronize()
    with track(model, optimizer, warmup=steps, every=1, oom_dir=oom_dir) as prof:
        for _ in range(steps):
            run()
    return prof.report()
