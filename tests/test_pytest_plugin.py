"""The pytest plugin, run by pytest's own pytester: budgets that hold, and ones that do not.

In subprocesses: a simulation imports parts of torch that register operator
libraries once per process, which an in-process run would unload and load again.
"""

pytest_plugins = ["pytester"]

SETUP = """
import pytest
import torch
from torch import nn


def setup(layers=4):
    def build():
        # Linear(8192, 8192) layers of 256 MiB fp32 each with AdamW, and a 64-row batch
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(layers)]).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 8192, device="cuda")

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        return model, opt, step
    return build
"""


def test_a_budget_that_holds_and_one_that_does_not(pytester):
    pytester.makepyfile(SETUP + """

@pytest.mark.memprof(budget="24GiB", target="a100-40gb")
def test_fits(memprof_budget):
    report = memprof_budget(setup())
    assert report.source == "simulate" and report.meta["target"] == "A100-40GB"


@pytest.mark.memprof(budget="3GiB", target="a100-40gb")
def test_too_big(memprof_budget):
    memprof_budget(setup())


def test_budget_given_to_the_fixture(memprof_budget):
    memprof_budget(setup(), budget="3GiB", target="h100")
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "Traceback" not in out
    # the failure says how much the step needs and shows the breakdown by category
    # 1 GiB of weights, 1 of gradients, 2 of AdamW's state, 1 of its foreach step's temporaries
    result.stdout.fnmatch_lines([
        "the training step needs 5.04 GiB reserved + 5% margin on the simulated A100-40GB (5.02 GiB allocated), "
        "more than the budget of 3.00 GiB (3GiB).",
        "*parameters*1.00 GiB*",
        "*optimizer_state*2.00 GiB*",
    ])
    # the fixture's own budget and target are used (the summary line may repeat the message, so match the body)
    result.stdout.fnmatch_lines([
        "the training step needs * GiB reserved + 5% margin on the simulated H100-80GB (* GiB allocated), "
        "more than the budget of 3.00 GiB (3GiB).",
    ])


def test_a_step_that_does_not_fit_the_target_shows_what_was_live(pytester):
    pytester.makepyfile(SETUP + """

@pytest.mark.memprof(budget="rtx3060")
def test_out_of_memory(memprof_budget):
    memprof_budget(setup(layers=12))
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*the training step runs out of memory on the simulated RTX3060-12GB.",
        "*out of memory on the RTX3060-12GB (simulated) while allocating 256.00 MiB, in step 0 (optimizer step)*",
    ])
    assert not list(pytester.path.glob("memprof-oom-*"))  # written to a temporary folder, not the test's


def test_misuse_is_a_usage_error(pytester):
    pytester.makepyfile(SETUP + """

def test_no_budget(memprof_budget):
    memprof_budget(setup())


@pytest.mark.memprof(budget="24GiB", tagret="h100")
def test_typo(memprof_budget):
    memprof_budget(setup())
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    out = result.stdout.str()
    assert "memprof_budget needs a budget: mark the test with @pytest.mark.memprof(budget='24GiB')" in out
    assert "@pytest.mark.memprof takes budget" in out and "tagret" in out
