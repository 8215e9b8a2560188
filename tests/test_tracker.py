"""memprof.track on the CPU: exact bytes from shapes, hooks gone afterwards."""

import gc
import weakref

import pytest
import torch
from torch import nn

import memprof
from models import MiB, TiedLM, mlp, train

A = "activations"


def tracked(steps, model=None, x=None, **kw):
    model = model or mlp()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 512) if x is None else x
    with memprof.track(model, **kw) as prof:
        train(model, opt, x, steps)
    return prof.report()


def rows(report, phase):
    tl = report.timeline
    return tl[tl["phase"] == phase]


def test_adamw_state_and_parameters_exact():
    r = tracked(3)
    # Two 512x512 fp32 weights: 1 MiB each; AdamW keeps m and v of the same
    # shape, and a 4-byte fp32 `step` counter per parameter (a CPU tensor here).
    assert r.optimizer_state == {"exp_avg": 2 * MiB, "exp_avg_sq": 2 * MiB, "step": 8}
    m = r.modules
    assert m.loc["Sequential.0", ["parameters", "gradients", "optimizer_state"]].tolist() == [MiB, MiB, 2 * MiB + 4]
    assert m.loc["Sequential.2", ["parameters", "gradients", "optimizer_state"]].tolist() == [MiB, MiB, 2 * MiB + 4]
    assert m.loc["Sequential.1", "parameters"] == 0
    assert r.peak.bytes["parameters"] == 2 * MiB
    assert r.peak.bytes["optimizer_state"] == 4 * MiB + 8
    assert r.peak.bytes["buffers"] == 0


def test_end_of_forward_breakdown_exact():
    r = tracked(3)
    # Last forward sample of the steady step: the root's forward has just ended.
    end = rows(r, "forward:Sequential")[lambda d: d["step"] == 2].iloc[-1]
    assert end["parameters"] == 2 * MiB
    assert end["inputs"] == MiB  # x: 512x512 fp32
    assert end[A] == MiB  # ReLU's output, saved by ReLU and by the second Linear
    assert end["gradients"] == 0  # zero_grad() sets them to None
    assert end["optimizer_state"] == 4 * MiB + 8
    assert end["activation_gradients"] == 0


def test_gradients_exact_when_optimizer_starts():
    r = tracked(2)
    opt_rows = rows(r, "optimizer")
    assert (opt_rows["gradients"] == 2 * MiB).all()
    assert r.modules["gradients"].sum() == 2 * MiB


def test_linear_saves_its_input():
    r = tracked(2)
    # Each Linear's own ops save its input (x, then ReLU's output): 1 MiB each.
    assert r.modules.loc["Sequential.0", A] == MiB
    assert r.modules.loc["Sequential.2", A] == MiB
    assert r.modules.loc["Sequential.1", A] == MiB  # ReLU saves its output


def test_views_share_one_storage():
    base = torch.randn(512, 1024)
    x = base[:, :512]  # a view: its storage is base's 2 MiB
    r = tracked(2, x=x)
    end = rows(r, "forward:Sequential")[lambda d: d["step"] == 1].iloc[-1]
    assert end["inputs"] == 2 * MiB  # the whole storage, counted once


def test_tied_weights_counted_once():
    model = TiedLM(vocab=256, dim=1024)
    ids = torch.randint(0, 256, (4, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model) as prof:
        train(model, opt, ids, 2)
    r = prof.report()
    # embed/head weight 256x1024 fp32 = 1 MiB (once), proj 1024x1024 = 4 MiB.
    assert r.peak.bytes["parameters"] == 5 * MiB
    assert r.modules["parameters"].sum() == 5 * MiB
    assert r.modules.loc["TiedLM.embed", "parameters"] == MiB
    assert r.modules.loc["TiedLM.head", "parameters"] == 0
    assert r.modules["gradients"].sum() == 5 * MiB


@pytest.mark.parametrize("steps", [2, 3, 10])
def test_steady_state_is_identical(steps):
    ref = tracked(3)
    r = tracked(steps)
    assert r.peak.bytes == ref.peak.bytes
    assert r.peak.phase == ref.peak.phase
    assert r.optimizer_state == ref.optimizer_state
    assert r.modules.equals(ref.modules)
    assert len(r.steps) == steps


def test_profile_schedule():
    r = tracked(7, warmup=2, every=3)
    assert r.steps["profiled"].tolist() == [True, True, False, True, False, False, True]
    assert r.meta["profiled_steps"] == [0, 1, 3, 6]
    # The timeline keeps the samples of the last `timeline_steps` profiled steps only.
    assert sorted(set(r.timeline["step"])) == [1, 3, 6]


def test_samples_add_up():
    r = tracked(3)
    cats = [c.value for c in memprof.categories.ALLOCATED]
    assert (r.timeline[cats].sum(axis=1) == r.timeline["allocated"]).all()
    assert (r.timeline["temporaries"] >= 0).all()
    assert r.peak.allocated == r.steps["peak_allocated"].iloc[-1]


def _global_hooks():
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (
        len(module._global_forward_pre_hooks),
        len(module._global_forward_hooks),
        len(optimizer._global_optimizer_pre_hooks),
        len(optimizer._global_optimizer_post_hooks),
        torch._C._autograd._top_saved_tensors_default_hooks(False),
    )


def _model_hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + sum(
        len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()
    )


def test_no_hook_remains():
    before = _global_hooks()
    model = mlp()
    tracked(2, model=model)
    assert _global_hooks() == before == (0, 0, 0, 0, None)
    assert _model_hooks(model) == 0


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_no_hook_remains_when_the_block_raises(where):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    handle = None
    if where == "forward":
        handle = model[2].register_forward_hook(lambda *a: (_ for _ in ()).throw(Boom()))
    elif where == "optimizer":
        opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(Boom()))
    x = torch.randn(512, 512)
    with pytest.raises(Boom):
        with memprof.track(model):
            loss = model(x).sum()
            if where == "backward":
                raise Boom()
            loss.backward()
            opt.step()
    assert _global_hooks() == (0, 0, 0, 0, None)
    if handle is not None:
        handle.remove()
    assert _model_hooks(model) == 0


def test_model_and_optimizer_collectable_after_exit():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(model) as prof:
        train(model, opt, torch.randn(512, 512), 2)
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model[0].weight)]
    del model, opt
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert prof.report().peak is not None  # the report outlives the model


def test_nested_track_raises():
    model = mlp()
    with memprof.track(model):
        with pytest.raises(RuntimeError, match="already active"):
            with memprof.track(model):
                pass
    with memprof.track(model):  # usable again afterwards
        pass


def test_other_optimizer_is_ignored():
    model, other = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters())
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(512, 512)
    with memprof.track(model) as prof:
        for _ in range(2):
            other(x).sum().backward()
            other_opt.step()
            train(model, opt, x, 1)
    r = prof.report()
    assert len(r.steps) == 2
    assert r.peak.bytes["parameters"] == 2 * MiB


def test_explicit_optimizer():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.track(model, opt) as prof:
        train(model, opt, torch.randn(512, 512), 2)
    assert prof.report().optimizer_state == {"momentum_buffer": 2 * MiB}


def test_chains_to_user_saved_tensor_hooks():
    """A user's own saved-tensors hooks keep working under track, and what they
    keep off the device is not counted as activations."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def pack(t):
        calls.append(t.shape)
        return ("kept elsewhere", t.clone())

    def unpack(p):
        return p[1]

    with memprof.track(model) as prof:
        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = model(torch.randn(512, 512)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert len(calls) >= 6
    assert prof.report().modules[A].sum() == 0


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        memprof.track("model")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        memprof.track(mlp(), optimizer=object())
    with pytest.raises(ValueError, match="every must be an integer >= 0, got -1"):
        memprof.track(mlp(), every=-1)
    with pytest.raises(ValueError, match="not a torch device"):
        memprof.track(mlp(), device="gpu0")


def test_gradient_accumulation_steps_end_at_optimizer():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(model) as prof:
        for _ in range(3):
            for _ in range(4):
                model(torch.randn(128, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    assert len(r.steps) == 3
    assert r.modules.loc["Sequential.0", "gradients"] == MiB


def test_closure_optimizer_phase_after_backward():
    """Forward and backward inside optimizer.step(closure) (Lightning, LBFGS):
    the optimizer phase starts when the closure returns, after backward."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 512)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with memprof.track(model) as prof:
        for _ in range(3):
            loss = opt.step(closure)
            opt.step(closure=closure)
    r = prof.report()
    assert len(r.steps) == 6
    assert isinstance(loss, torch.Tensor)
    for _, s in r.timeline.groupby("step"):
        phases = s["phase"].tolist()
        # 'optimizer' is the interval closed by the 'end' sample, after every forward/backward phase
        assert phases.index("optimizer") == len(phases) - 1
        assert s["gradients"].iloc[-1] == 2 * MiB


def test_last_peak_and_collected_model():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(model) as prof:
        assert prof.last_peak is None
        train(model, opt, torch.randn(512, 512), 1)
        assert prof.last_peak.step == 0
    with pytest.raises(RuntimeError, match="garbage-collected"):
        with memprof.track(nn.Linear(2, 2)):
            pass
