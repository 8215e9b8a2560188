"""Which trainings gradient accumulation changes: samples that meet in the autograd graph."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import memprof
from memprof.advisor import Advice, plan_changes, plan_table, recommendation_notes, rerank
from memprof.coupling import sample_coupling, what_changes
from memprof.devices import get_gpu
from memprof.strategies import Accumulation, Autocast, Checkpointing
from models import MiB

N = 8  # samples


def _features(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two towers' normalized features of N samples (activations, not parameters)."""
    torch.manual_seed(seed)
    x = torch.randn(N, 16)
    return F.normalize(nn.Linear(16, 32)(x), dim=-1), F.normalize(nn.Linear(16, 32)(x), dim=-1)


def test_in_batch_pairs_are_found_however_the_similarities_are_made():
    a, b = _features()
    labels = torch.arange(N)
    z = torch.cat([a, b])  # SimCLR: the two views joined, 2N rows
    made = {
        "clip, a @ b.T": F.cross_entropy(a @ b.t(), labels),
        "simclr, z @ z.T": (z @ z.t()).logsumexp(-1).mean(),
        "einsum": torch.einsum("id,jd->ij", a, b).logsumexp(-1).mean(),
        "cdist": torch.cdist(a, b).min(-1).values.mean(),
        "cosine_similarity broadcast": nn.CosineSimilarity(dim=2)(z.unsqueeze(1), z.unsqueeze(0)).logsumexp(-1).mean(),
        "difference broadcast": (a.unsqueeze(1) - b.unsqueeze(0)).square().sum(-1).min(-1).values.mean(),
    }
    for how, loss in made.items():
        assert sample_coupling(loss, {N}) == {"pairs": 1}, how
    assert sample_coupling([made["clip, a @ b.T"], made["cdist"]], {N}) == {"pairs": 2}  # both roots walked


def test_per_sample_losses_and_parameters_couple_nothing():
    torch.manual_seed(0)
    x = torch.randn(N, 16)
    square = nn.Linear(16, N)  # as many outputs as the batch has rows: (N, N), a parameter's product
    assert sample_coupling(F.cross_entropy(square(x), torch.arange(N)), {N}) == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # its weight cast first, transposed: still the parameter
        assert sample_coupling(square(x).float().sum(), {N}) == {}
    a, b = _features()
    assert sample_coupling((a @ nn.Linear(N, 32).weight).sum(), {N}) == {}  # (N, 32) @ (32, N): a weight
    # Glow's 1x1 convolution: its weight the product of its LU factors, made of parameters and constant masks,
    # with as many channels as the batch has samples: matrices, not samples
    lower, upper = nn.Parameter(torch.randn(N, N)), nn.Parameter(torch.randn(N, N))
    mask = torch.ones(N, N).tril(-1)
    weight = (lower * mask + torch.eye(N)) @ (upper * mask.T + torch.diag(torch.ones(N)))
    assert sample_coupling(F.conv2d(torch.randn(2, N, 4, 4), weight[:, :, None, None]).sum(), {N}) == {}
    # Attention's scores per head, (batch, heads, T, T) with T = N: a batch of matrices, pairs of tokens
    q = torch.randn(2, 4, N, 16, requires_grad=True) * 1
    assert sample_coupling((q @ q.transpose(-1, -2)).softmax(-1).sum(), {2}) == {}
    assert sample_coupling((q @ q.transpose(-1, -2)).softmax(-1).sum(), {N}) == {}
    # An additive attention's queries against its keys, (2, N, 1, D) + (1... per sample: tokens, not samples
    h = torch.randn(2, N, 16, requires_grad=True) * 1
    assert sample_coupling((h.unsqueeze(2) + h.unsqueeze(1)).tanh().sum(), {2, N}) == {}
    # A product of two activations of another size than the batch's, and one whose operand carries no gradient
    assert sample_coupling((a @ b.t()).sum(), {N + 1}) == {}
    assert sample_coupling((a @ b.detach().t()).sum(), {N}) == {}
    assert sample_coupling((a @ b.t()).sum(), set()) == {}


def test_batch_norm_in_training_mode_is_found_in_each_layer():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                        nn.Flatten(), nn.Linear(8 * 4 * 4, 10), nn.BatchNorm1d(10))
    x = torch.randn(N, 3, 8, 8)
    assert sample_coupling(net(x).sum(), {N}) == {"batch_norm": 3}
    assert sample_coupling(net(x).sum(), set()) == {"batch_norm": 3}  # whatever the batch's size
    f = F.batch_norm(nn.Conv2d(3, 3, 1)(x), None, None, training=True)  # the functional form, no module
    assert sample_coupling(f.sum(), {N}) == {"batch_norm": 1}
    net.eval()  # the running statistics: each sample alone
    assert sample_coupling(net(x).sum(), {N}) == {}


def test_statistics_over_the_batch_are_found_where_they_are_no_sum_of_the_samples():
    a, b = _features()
    standardized = (a - a.mean(0)) / a.std(0)  # Barlow Twins: a mean fed back to each sample, and a deviation
    assert sample_coupling(standardized.square().sum(), {N}) == {"batch_statistics": 2}
    assert sample_coupling((a - a.mean(0, keepdim=True)).square().sum(), {N}) == {"batch_statistics": 1}
    assert sample_coupling(F.relu(1 - (b.var(dim=0) + 1e-4).sqrt()).mean(), {N}) == {"batch_statistics": 1}  # VICReg
    # A loss's mean over the samples is the micro-batches' sum; a norm or mean over each sample's features,
    # a weight's norm over its rows (weight normalization, as many outputs as samples) are no statistic of the batch
    assert sample_coupling(F.mse_loss(a, b), {N}) == {}
    assert sample_coupling((a - a.mean(-1, keepdim=True)).square().mean(), {N}) == {}
    assert sample_coupling((a * (a.square().mean(-1, keepdim=True) + 1e-6).rsqrt()).sum(), {N}) == {}
    torch.manual_seed(0)
    normed = nn.utils.parametrizations.weight_norm(nn.Linear(16, N))
    assert sample_coupling(normed(torch.randn(N, 16)).sum(), {N}) == {}
    caps = torch.randn(N, 10, 16, requires_grad=True) * 1  # each capsule's length (dim=-1, saved as 2**64 - 1)
    assert sample_coupling(caps.norm(dim=-1).sum(), {N, 10, 16}) == {}
    x = torch.randn(N, 16, requires_grad=True)  # WGAN-GP: each sample's gradient norm
    penalty = torch.autograd.grad(normed(x).sum(), x, create_graph=True)[0].norm(2, dim=1)
    assert sample_coupling((penalty - 1).square().mean(), {N}) == {}


def test_what_changes_says_it_for_k_micro_batches():
    assert what_changes({}, 4) == ""
    assert what_changes({"batch_norm": 3}, 4) == (
        "batch norm (3 in training mode) normalizes each micro-batch with its own statistics, of 1/4 of the samples")
    assert what_changes({"batch_norm": 3, "pairs": 1}, 2) == (
        "batch norm (3 in training mode) normalizes each micro-batch with its own statistics, of 1/2 of the "
        "samples; in-batch pairs (1 product over the batch's samples: a contrastive loss's similarities, "
        "pairwise distances) meet 1/2 of the other samples")
    assert what_changes({"batch_statistics": 1}, 8) == (
        "statistics of the batch (1 over its samples: a mean fed back to each, a variance, a norm) are taken over 1/8 "
        "of the samples")
    assert Accumulation(8).changes({"pairs": 2}) == what_changes({"pairs": 2}, 8)
    assert Autocast("bf16").changes({"pairs": 2}) == Checkpointing().changes({"batch_norm": 1}) == ""


def test_the_tracker_reads_the_couplings_of_a_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.BatchNorm1d(32))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with memprof.track(net, opt) as prof:
        for _ in range(3):
            z = F.normalize(net(torch.randn(N, 16)), dim=-1)
            F.cross_entropy(z @ z.t(), torch.arange(N)).backward()  # pairs over the model's own output
            opt.step()
            opt.zero_grad()
    assert prof.report().meta["sample_coupling"] == {"batch_norm": 2, "pairs": 1}
    plain = nn.Sequential(nn.Linear(16, N), nn.ReLU(), nn.Linear(N, N))  # (N, N) outputs, per sample
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with memprof.track(plain, opt) as prof:
        for _ in range(2):
            F.cross_entropy(plain(torch.randn(N, 16)), torch.arange(N)).backward()
            opt.step()
            opt.zero_grad()
    assert "sample_coupling" not in prof.report().meta


def _table(changes: dict[str, str]) -> pd.DataFrame:
    seconds = [0.100, 0.104, 0.130, 0.110]
    return pd.DataFrame({"peak_allocated": [9, 5, 4, 3], "peak_reserved": [10 * MiB, 6 * MiB, 5 * MiB, 4 * MiB],
                         "seconds": seconds, "slowdown": [t / seconds[0] for t in seconds],
                         "changes": [changes.get(n, "") for n in ("baseline", "accum2", "ckpt", "accum4")]},
                        index=pd.Index(["baseline", "accum2", "ckpt", "accum4"], name="plan"))


def test_plans_that_change_the_training_rank_after_those_that_fit_and_do_not():
    bn = what_changes({"batch_norm": 2}, 2)
    table = _table({"accum2": bn, "accum4": what_changes({"batch_norm": 2}, 4)})
    ranked = rerank(table, budget=int(6.5 * MiB))
    assert list(ranked.index) == ["ckpt", "accum2", "accum4", "baseline"]
    assert recommendation_notes(ranked) == [
        f"accum2 is 20 % faster than ckpt and fits, but changes what training computes: {bn}"]
    # Only a plan that changes the training fits: it is the advice, said as such
    ranked = rerank(table, budget=int(4.5 * MiB))
    assert list(ranked.index) == ["accum4", "ckpt", "accum2", "baseline"]
    assert recommendation_notes(ranked) == [
        f"accum4 changes what training computes, and no plan that fits trains the same model: "
        f"{what_changes({'batch_norm': 2}, 4)}"]
    # Nothing changed: ranked by time alone, nothing to say
    ranked = rerank(_table({}), budget=int(6.5 * MiB))
    assert list(ranked.index) == ["accum2", "accum4", "ckpt", "baseline"] and recommendation_notes(ranked) == []


def test_the_table_marks_the_plans_that_change_the_training():
    class Baseline:
        meta = {"sample_coupling": {"pairs": 1}}

    pairs = {name: plan_changes([Accumulation(k)], Baseline) for name, k in (("accum2", 2), ("accum4", 4))}
    assert pairs["accum4"] == what_changes({"pairs": 1}, 4)
    advice = Advice(int(6.5 * MiB), get_gpu("h100"), 1, rerank(_table(pairs), int(6.5 * MiB)), Baseline)
    console = Console(record=True, width=80)
    console.print(plan_table(advice))
    text = console.export_text()
    rows = [line.split()[:2] for line in text.splitlines() if line.split() and line.split()[0] in _table({}).index
            and "MiB" in line]
    assert rows == [["ckpt", "5.00"], ["accum2", "†"], ["accum4", "†"], ["baseline", "10.00"]]
    caption = " ".join(text.split())
    assert ("† changes what training computes, so ranked after the plans that fit and do not: in-batch pairs (1 "
            "product over the batch's samples: a contrastive loss's similarities, pairwise distances) meet 1/K of "
            "the other samples (K: its micro-batches)") in caption


def test_expandable_segments_are_tried_for_a_plan_that_trains_the_same_model():
    """ckpt allocates within the budget and reserves past it; accum2 fits but changes the training."""
    from memprof.advisor import fragmented
    from memprof.strategies import Prediction

    preds = {"baseline": Prediction(9 * MiB, 12 * MiB, 0.100), "accum2": Prediction(5 * MiB, 6 * MiB, 0.104),
             "ckpt": Prediction(5 * MiB, 7 * MiB, 0.120), "accum4": Prediction(4 * MiB, 7 * MiB, 0.103)}
    assert fragmented(preds, int(6.5 * MiB), 0.05) == {"accum4+expandable": "accum4"}  # faster than accum2
    # No plan that trains the same model fits: ckpt might with them, and accum4 still might beat accum2
    assert fragmented(preds, int(6.5 * MiB), 0.05, {"accum2", "accum4"}) == {"ckpt+expandable": "ckpt",
                                                                            "accum4+expandable": "accum4"}
    preds["ckpt"] = Prediction(5 * MiB, 6 * MiB, 0.120)  # it fits: accumulation cannot beat it
    assert fragmented(preds, int(6.5 * MiB), 0.05, {"accum2", "accum4"}) == {}
    assert fragmented(preds, int(6.5 * MiB), 0.05) == {"accum4+expandable": "accum4"}


def _stack_advice(coupled: bool) -> Advice:
    """Advice for a stack of blocks with batch norm (or without) for a budget that accumulation
    and checkpointing both meet: accumulation is the faster."""
    from memprof.advisor import advise
    from memprof.workload import Workload

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(512, 512)
            self.norm = nn.BatchNorm1d(512) if coupled else nn.LayerNorm(512)

        def forward(self, x):
            return x + self.norm(self.fc(x)).relu()

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(8)]).cuda()
        return Workload(model, torch.optim.AdamW(model.parameters()), torch.randn(4096, 512, device="cuda"),
                        lambda m, x: m(x).square().mean())

    plans = {"ckpt": lambda: [Checkpointing()], "accum2": lambda: [Accumulation(2)]}
    return advise(make, "300MiB", target="h100", plans=plans, progress=False, jobs=1)


@pytest.mark.parametrize("coupled", [False, True])
def test_the_advisor_prefers_plans_that_train_the_same_model(coupled):
    """Accumulation is the advice only when nothing couples the samples."""
    advice = _stack_advice(coupled)
    t = advice.table
    assert t.loc[["ckpt", "accum2"], "fits"].all() and t.at["accum2", "seconds"] < t.at["ckpt", "seconds"]
    if coupled:
        assert advice.baseline.meta["sample_coupling"] == {"batch_norm": 8}
        assert t.at["accum2", "changes"] == what_changes({"batch_norm": 8}, 2) and t.at["ckpt", "changes"] == ""
        assert advice.best == "ckpt"
    else:
        assert "sample_coupling" not in advice.baseline.meta and not t["changes"].any()
        assert advice.best == "accum2"


def test_the_advice_page_marks_the_plan_that_changes_training():
    pytest.importorskip("plotly", reason="the HTML page needs plotly: pip install 'memprof[html]'")
    from memprof.html import advice_html

    advice = _stack_advice(coupled=True)
    t, page = advice.table, advice_html(advice)
    assert "<td>accum2 †</td>" in page and "<td>ckpt</td>" in page
    assert f"; † changes what training computes: {what_changes({'batch_norm': 8}, 2)}" in page
    faster = f"{100 * (1 - t.at['accum2', 'seconds'] / t.at['ckpt', 'seconds']):.0f} % faster than ckpt"
    assert f"accum2 is {faster} and fits, but changes what training computes" in page
