"""advise_step: plans for a live model's step, on a meta copy of it."""

import pytest
import torch
from torch import nn

import memprof
from memprof.trainer_advice import simulated_copy
from models import FF, MiB


def blocks():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Sequential(*[FF() for _ in range(4)]), nn.Linear(256, 10))


def loss_fn(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_the_live_model_and_optimizer_are_left_alone():
    model = blocks()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                             {"params": [*model[1].parameters(), *model[2].parameters()], "weight_decay": 0.0}])
    batch = (torch.randn(512, 256), torch.randint(0, 10, (512,)))
    before = [p.detach().clone() for p in model.parameters()]
    advice = memprof.advise_step(model, opt, batch, loss_fn, "rtx3060", door="lightning")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert all(not p.is_meta for p in model.parameters())
    # The copy's optimizer had the same groups: Adam's m and v per parameter, 2 x 4 bytes a weight.
    params = sum(p.numel() for p in model.parameters()) * 4
    peak = advice.baseline.peak
    assert peak.bytes["parameters"] >= params and advice.gpu.name == "RTX3060-12GB"
    assert advice.baseline.optimizer_state["exp_avg"] == advice.baseline.optimizer_state["exp_avg_sq"] >= params
    assert advice.facts.batch_size == 512 and advice.facts.optimizer == "AdamW"
    assert advice.settings("accum2") == [
        "Trainer(accumulate_grad_batches=2) and DataLoader(batch_size=256): the same 512 samples per optimizer step"]


def test_a_copy_on_meta_shares_what_it_is_told_to():
    model = blocks()
    owner = object()
    model.owner = owner
    copy = simulated_copy(model, shared=[owner])
    assert copy.owner is owner
    assert all(p.is_meta for p in copy.parameters()) and [p.shape for p in copy.parameters()] == [
        p.shape for p in model.parameters()]
    assert sum(p.numel() * 4 for p in model[1].parameters()) == 4 * 2 * MiB  # FF: 2 MiB of weights each


def test_bad_input_is_named():
    model = blocks()
    batch = (torch.randn(8, 256), torch.randint(0, 10, (8,)))
    with pytest.raises(ValueError, match=r"autocast 'bf32' is not one of \[None, 'bf16', 'fp16'\]"):
        memprof.advise_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss_fn, "24GiB", autocast="bf32")
    stray = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"the optimizer holds tensors that are not the model's parameters \(shapes \[\(3,\)\]\)"):
        memprof.advise_step(model, stray, batch, loss_fn, "24GiB")
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1, got 0"):
        memprof.advise_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss_fn, "24GiB", micro_batches=0)


def test_a_plan_that_changes_the_training_says_so():
    """Batch norm in the model: each accumulation plan's settings come with what it changes."""
    from dataclasses import replace

    from rich.console import Console

    from memprof.advisor import rerank
    from memprof.coupling import what_changes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.Sequential(*[FF() for _ in range(4)]),
                          nn.Linear(256, 10))
    batch = (torch.randn(512, 256), torch.randint(0, 10, (512,)))
    advice = memprof.advise_step(model, torch.optim.AdamW(model.parameters()), batch, loss_fn, "rtx3060",
                                 door="lightning")
    assert advice.baseline.meta["sample_coupling"] == {"batch_norm": 1}
    t = advice.table
    assert all(t.at[p, "changes"] == (what_changes({"batch_norm": 1}, int(p.rpartition("accum")[2].split("+")[0]))
                                      if "accum" in p else "") for p in t.index)
    # Where only accumulation plans fit (the others left out of the table), the three shown each say it
    accum = t[t.index.str.contains("accum") | (t.index == "baseline")]
    budget = int(t.at["baseline", "peak_reserved"]) - 1
    small = replace(advice, budget=budget, table=rerank(accum, budget, margin=0.0))
    console = Console(record=True, width=400)
    console.print(small)
    lines = console.export_text().splitlines()
    shown = [p for p in small.table.index[small.table["fits"]]][:3]
    assert len(shown) == 3 and small.best == shown[0]
    for plan in shown:
        at, settings = lines.index(f"{plan}:"), small.settings(plan)
        assert lines[at + 1:at + 1 + len(settings)] == [f"  {s}" for s in settings]
        assert lines[at + 1 + len(settings)] == f"  † changes what training computes: {t.at[plan, 'changes']}"
