"""memprof.track on the CPU: exact bytes from shapes, hooks gone afterwards."""

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memprof
from models import FF, MiB, TiedLM, adam_linear, mlp, train

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
    # At the peak (the ReLU's backward) only the second Linear has its gradient.
    assert m.loc["Sequential.0", ["parameters", "gradients", "optimizer_state"]].tolist() == [MiB, 0, 2 * MiB + 4]
    assert m.loc["Sequential.2", ["parameters", "gradients", "optimizer_state"]].tolist() == [MiB, MiB, 2 * MiB + 4]
    assert m.loc["Sequential", ["parameters", "gradients", "optimizer_state"]].tolist() == [2 * MiB, MiB, 4 * MiB + 8]
    assert m.loc["Sequential.1", "parameters"] == 0
    assert r.peak.bytes["parameters"] == 2 * MiB
    assert r.peak.bytes["optimizer_state"] == 4 * MiB + 8
    assert r.peak.bytes["buffers"] == 0


def test_end_of_forward_breakdown_exact():
    r = tracked(3)
    # Last forward sample of the steady step: the root's forward has just ended.
    end = rows(r, "forward Sequential")[lambda d: d["step"] == 2].iloc[-1]
    assert end["parameters"] == 2 * MiB
    assert end["inputs"] == MiB  # x: 512x512 fp32
    assert end[A] == MiB  # ReLU's output, saved by ReLU and by the second Linear
    assert end["gradients"] == 0  # zero_grad() sets them to None
    assert end["optimizer_state"] == 4 * MiB + 8
    assert end["activation_gradients"] == 0


def test_gradients_exact_when_optimizer_starts():
    r = tracked(2)
    opt_rows = rows(r, "optimizer step")
    assert len(opt_rows) == 2 and (opt_rows["gradients"] == 2 * MiB).all()


def test_linear_saves_its_input():
    r = tracked(2)
    over = r.modules["activations_saved_over_step"]
    # Over the step, each Linear's own ops save its input (x, then ReLU's
    # output): 1 MiB each; the ReLU saves its output. The root counts each
    # storage once: x and the ReLU's output, and its own output, which the
    # loss after it saves (square saves its input).
    assert over.to_dict() == {"Sequential": 3 * MiB, "Sequential.0": MiB, "Sequential.1": MiB, "Sequential.2": MiB}
    # Live at the peak, the ReLU's output belongs to the ReLU, which saved it
    # first; x is an input (the root's).
    at_peak = r.modules[[A, "inputs"]]
    assert at_peak.loc["Sequential"].tolist() == [MiB, MiB]
    assert at_peak.loc["Sequential.0"].tolist() == [0, 0]
    assert at_peak.loc["Sequential.1"].tolist() == [MiB, 0]
    assert at_peak.loc["Sequential.2"].tolist() == [0, 0]


def test_views_share_one_storage():
    base = torch.randn(512, 1024)
    x = base[:, :512]  # a view: its storage is base's 2 MiB
    r = tracked(2, x=x)
    end = rows(r, "forward Sequential")[lambda d: d["step"] == 1].iloc[-1]
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
    assert r.modules.loc["TiedLM", "parameters"] == 5 * MiB
    assert r.modules.loc["TiedLM.embed", "parameters"] == MiB
    assert r.modules.loc["TiedLM.head", "parameters"] == 0
    assert r.modules.loc["TiedLM.proj", "parameters"] == 4 * MiB
    assert (rows(r, "optimizer step")["gradients"] == 5 * MiB).all()  # the tied weight's gradient once


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


def test_paused_between_steps_lets_another_tracker_run():
    model, other = mlp(), mlp()
    opt, other_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(other.parameters())
    x = torch.randn(512, 512)
    with memprof.track(model, warmup=4, every=1) as prof:
        train(model, opt, x, 2)
        with prof.paused():  # the next step is profiled: its module hooks come off for the pause
            with memprof.track(other, warmup=1) as inner:
                train(other, other_opt, x, 3)
        train(model, opt, x, 1)
    r = prof.report()
    assert len(inner.report().steps) == 3
    # the other model's steps are not this tracker's: three steps, the third as the first two
    assert r.steps["step"].tolist() == [0, 1, 2] and r.steps["profiled"].all()
    assert r.steps["peak_allocated"].iloc[2] == r.steps["peak_allocated"].iloc[1]
    assert r.peak.bytes["parameters"] == 2 * MiB and r.optimizer_state["exp_avg"] == 2 * MiB
    refused = []

    def pause_mid_forward(*args):
        with pytest.raises(RuntimeError, match="between steps only") as e:
            prof.paused().__enter__()
        refused.append(e.value)

    with memprof.track(model) as prof:
        handle = model[0].register_forward_hook(pause_mid_forward)
        model(x)
        handle.remove()
    assert len(refused) == 1
    with pytest.raises(RuntimeError, match="between steps only"):
        prof.paused().__enter__()  # after the block


def test_inputs_passed_by_keyword():
    """Hugging Face calls model(**batch): keyword tensors are inputs as positional ones are."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(512, 512, bias=False)

        def forward(self, x, mask=None):
            return self.lin(x) * mask

    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, mask = torch.randn(512, 512), torch.ones(512, 512)
    with memprof.track(model, warmup=2) as prof:
        for _ in range(2):
            model(x=x, mask=mask).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    assert r.peak.bytes["inputs"] == 2 * MiB  # x and mask, 1 MiB each
    assert r.modules.loc["Masked", "inputs"] == 2 * MiB



def test_batches_of_several_shapes_are_said():
    """Dynamic padding: each batch as long as its longest sequence, so each step peaks by its batch.
    The report lists the shapes the model's inputs took, in the order first seen, and the peak step's;
    `memprof track`'s text and HTML say it. Steps on one shape say nothing."""
    from memprof.html import report_html
    from memprof.render import report_text

    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(lengths):
        with memprof.track(model, warmup=len(lengths)) as prof:
            for n in lengths:
                ids = torch.randint(0, 1000, (8, n))
                F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
                opt.step()
                opt.zero_grad()
        return prof.report()

    r = run([64, 128, 32, 64])
    assert r.meta["batch_shapes"] == [[[8, 64]], [[8, 128]], [[8, 32]]]
    assert r.meta["batch_shapes_seen"] == 3
    assert r.peak.step == 1 and r.meta["peak_batch_shape"] == [[8, 128]]  # the longest batch peaks highest
    assert ("The model's inputs changed shape between steps (3 shapes: (8, 64); (8, 128); (8, 32)), and each "
            "step's peak follows its batch. The peak is that of a step on (8, 128).") in " ".join(
                report_text(r).split())
    assert "The model&#x27;s inputs changed shape between steps (3 shapes" in report_html(r)
    steady = run([64, 64, 64])
    assert "batch_shapes" not in steady.meta and "changed shape" not in report_text(steady)


def test_inputs_in_lists_and_dicts():
    """DINO calls model(crops), a list of views; DETR passes one target dict per image. Every
    tensor in them is an input (they were temporaries)."""

    class MultiCrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(512, 512, bias=False)

        def forward(self, crops, targets=()):
            return sum(self.lin(c).sum() for c in crops) + sum(t["boxes"].sum() for t in targets)

    model = MultiCrop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crops = [torch.randn(512, 512), torch.randn(256, 512)]  # 1 MiB and 0.5 MiB
    targets = [{"boxes": torch.ones(128, 512)}] * 2  # one 0.25 MiB tensor, given twice
    with memprof.track(model, warmup=2) as prof:
        for _ in range(2):
            model(crops, targets=targets).backward()
            opt.step()
            opt.zero_grad()
    assert prof.report().peak.bytes["inputs"] == MiB + MiB // 2 + MiB // 4


def test_other_optimizer_is_ignored():
    model, other = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters())
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)  # 2 MiB of momentum, not ours
    x = torch.randn(512, 512)
    with memprof.track(model, warmup=3) as prof:
        for _ in range(3):
            other(x).sum().backward()
            other_opt.step()
            train(model, opt, x, 1)
    r = prof.report()
    assert len(r.steps) == 3
    assert r.peak.bytes["parameters"] == 2 * MiB
    assert r.peak.bytes["optimizer_state"] == 4 * MiB + 8  # AdamW's m, v and step counters only


@pytest.mark.parametrize("tracked", ["compiled", "module"])
def test_a_compiled_model_is_tracked_as_the_model_it_compiles(tracked):
    """torch.compile(model): Dynamo inlines module hooks into its graph, and memprof's
    read the tracker's own state there (Dynamo stopped with "already tracked for
    mutation" on track(compiled)). Inside the compiled region they do nothing; the
    region is attributed as a whole, named as the model, whether the wrapper or the
    model is tracked (the wrapper, first met at its call, then stands for the model).
    aot_eager: AOTAutograd's forward and backward graphs, run eagerly."""
    torch._dynamo.reset()
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(compiled if tracked == "compiled" else model, warmup=3) as prof:
        for _ in range(3):
            compiled(torch.randn(4096, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    assert len(r.steps) == 3
    # The forward's peak: the 8 MiB input, the ReLU's 8 MiB output saved for backward,
    # the 2 MiB of weights, AdamW's m and v (4 MiB) and two 4-byte step counters.
    assert r.peak.phase == "forward Sequential"
    assert {k: v for k, v in r.peak.bytes.items() if v} == {
        "parameters": 2 * MiB, "optimizer_state": 4 * MiB + 8, "activations": 8 * MiB, "inputs": 8 * MiB}
    assert list(r.modules.index) == ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2"]
    assert r.modules.loc["Sequential", "activations"] == 8 * MiB


def test_a_compiled_optimizer_step_still_ends_every_step():
    """The optimizer's step under torch.compile: Dynamo traced memprof's optimizer hooks
    once and left them out of the compiled step (1 step seen of 5); they run as Python."""
    torch._dynamo.reset()
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    step = torch.compile(opt.step, backend="eager")
    with memprof.track(model, warmup=2, every=1) as prof:
        for _ in range(5):
            model(torch.randn(512, 512)).sum().backward()
            step()
            opt.zero_grad()
    r = prof.report()
    assert len(r.steps) == 5
    assert r.peak.bytes["optimizer_state"] == 4 * MiB + 8


def test_copies_of_the_tracked_model_work_and_stay_untracked():
    """copy.deepcopy(model) inside track (an EMA, a teacher, the best weights) copied the
    model's hooks and with them the tracker ("cannot pickle 'generator' object"); torch.save
    of the whole model pickled them. A copy shares the hooks, which ignore it: the report is
    the one of the same steps without the copy, but for the copy's parameters, another model's."""
    import copy
    import io

    def run(with_copies: bool):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with memprof.track(model, warmup=3) as prof:
            for _ in range(3):
                x = torch.randn(512, 512)
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                if with_copies:
                    ema = copy.deepcopy(model)
                    ema(x).sum().backward()  # the copy's forward and gradients are not the model's
                    torch.save(model, io.BytesIO())
        return prof.report()

    plain, copied = run(False), run(True)
    assert len(copied.steps) == 3 and copied.peak.bytes == {**plain.peak.bytes, "other_models": 2 * MiB}
    # The copy's weights, and after its backward their gradients (its own, as another model's)
    assert copied.peak.bytes["parameters"] == 2 * MiB and copied.other_models == {"ema": 4 * MiB}
    loaded = torch.load(io.BytesIO(_saved_while_tracked()), weights_only=False)
    assert loaded(torch.randn(2, 512)).shape == (2, 512)  # its hooks do nothing, as the tracker is gone


def test_other_models_the_script_keeps_are_named_by_its_variables():
    """A frozen teacher called in the loop, an EMA the loop updates but never calls, and a
    frozen encoder reached through a dict, an EMA kept as a list of tensors (diffusers'
    EMAModel) and the best weights so far as a state_dict's copy: their weights are the
    script's, not temporaries of the step. Each is named by the variable holding it; the
    encoder, held by no variable, by its class. None of them enters the module table."""
    from torch.optim.swa_utils import AveragedModel

    class ShadowEMA:
        def __init__(self, parameters):
            self.shadow_params = [p.detach().clone() for p in parameters]

        def step(self, parameters):
            for shadow, p in zip(self.shadow_params, parameters):
                shadow.lerp_(p.detach(), 0.01)

    model = mlp()
    teacher = nn.Linear(512, 512, bias=False).requires_grad_(False)  # 1 MiB
    ema = AveragedModel(model)  # a copy of the model (2 MiB) and n_averaged, one int64
    shadow = ShadowEMA(model.parameters())  # 2 MiB
    frozen = {"encoder": nn.Linear(512, 256, bias=False).requires_grad_(False)}  # 0.5 MiB
    best = {k: v.clone() for k, v in model.state_dict().items()}  # 2 MiB, kept to restore later
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(model) as prof:
        for _ in range(3):
            x = frozen["encoder"](torch.randn(512, 512)).repeat(1, 2)
            loss = (model(x) - teacher(x)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            shadow.step(model.parameters())
    r = prof.report()
    assert r.other_models == {"teacher": MiB, "ema": 2 * MiB + 8, "Linear": MiB // 2,
                              "shadow.shadow_params": 2 * MiB, "best": 2 * MiB}
    assert r.peak.bytes["other_models"] == MiB + 2 * MiB + 8 + MiB // 2 + 2 * MiB + 2 * MiB
    assert best and list(frozen) == ["encoder"]
    assert r.peak.bytes["parameters"] == 2 * MiB and r.optimizer_state["exp_avg"] == 2 * MiB
    assert list(r.modules.index) == ["Sequential", "Sequential.0", "Sequential.1", "Sequential.2"]
    assert "other_models" not in r.modules.columns
    assert_adds_up(r)


def test_another_models_gradients_are_its_own():
    """An actor trained through the tracked critic (SAC's policy loss; a GAN's generator through its
    discriminator): backward binds the actor's gradients at the critic's nodes, and they stayed
    activation gradients of the critic from there through its optimizer step. They are the actor's,
    as its weights are."""
    critic, actor = mlp(), nn.Linear(512, 512, bias=False)  # 2 MiB, and 1 MiB of another model
    critic_opt, actor_opt = torch.optim.SGD(critic.parameters(), lr=0.1), torch.optim.SGD(actor.parameters(), lr=0.1)
    x = torch.randn(512, 512)
    with memprof.track(critic, critic_opt, every=1, warmup=1) as prof:
        for _ in range(4):
            actor_opt.zero_grad()
            critic(actor(x)).mean().backward()  # the actor's loss, through the critic
            actor_opt.step()
            critic_opt.zero_grad()
            critic(x).square().mean().backward()
            critic_opt.step()
    r = prof.report()
    assert r.other_models == {"actor": 2 * MiB}  # its weight and its gradient
    stepping = r.timeline[r.timeline["phase"] == "optimizer step"]
    assert len(stepping) >= 2 and (stepping["activation_gradients"] == 0).all()
    assert (stepping["other_models"] == 2 * MiB).all() and (stepping["gradients"] == 2 * MiB).all()
    assert_adds_up(r)


def test_a_proxy_of_a_module_in_the_loop():
    """Lightning holds weakref.proxy objects of its trainer: they pass isinstance checks for
    what they stand for but cannot be weakly referenced ("cannot create weak reference to
    'weakref.CallableProxyType' object" stopped tracking). They are passed over."""
    model, frozen = mlp(), nn.Linear(512, 512, bias=False)
    proxies = (weakref.proxy(model), weakref.proxy(frozen))  # noqa: F841 (held by the frame)
    alias = proxies[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model) as prof:
        train(model, opt, torch.randn(512, 512), 2)
    assert isinstance(alias, nn.Module) and prof.report().other_models == {"frozen": MiB}


def test_reading_the_scripts_frames_keeps_nothing_alive():
    """Before Python 3.13 a function's frame keeps the snapshot its f_locals made: a tensor
    the script deleted after memprof looked for its modules stayed alive (a step's logits,
    a model deleted to free the device). A locals() the script holds is left as it is."""
    import sys

    from memprof.frames import script_modules

    x, layer = torch.randn(256, 256), nn.Linear(2, 2)
    gone = weakref.ref(x)
    assert ("layer", layer) in script_modules(sys._getframe())
    del x
    gc.collect()
    assert gone() is None
    y = torch.randn(2)
    held = locals()
    script_modules(sys._getframe())
    assert held["y"] is y


def _saved_while_tracked() -> bytes:
    import io

    model = mlp()
    with memprof.track(model, every=1):
        model(torch.randn(4, 512)).sum().backward()
        buf = io.BytesIO()
        torch.save(model, buf)
    return buf.getvalue()


def test_a_sparse_gradient_counts_its_values():
    """nn.Embedding(sparse=True) under SparseAdam: its gradient has no storage of its own
    (memprof stopped: "Cannot access storage of SparseTensorImpl"); its values count."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(1000, 64, sparse=True), nn.Linear(64, 1)
    model = nn.Sequential(emb, head)
    sparse, dense = torch.optim.SparseAdam(list(emb.parameters())), torch.optim.Adam(head.parameters())
    with memprof.track(model, [sparse, dense], warmup=3) as prof:
        for _ in range(3):
            model(torch.randint(0, 1000, (32,))).sum().backward()
            sparse.step(), dense.step(), sparse.zero_grad(), dense.zero_grad()
    r = prof.report()
    after = r.timeline[(r.timeline.step == 2) & (r.timeline.phase == "after backward")]
    assert after.gradients.max() == 32 * 64 * 4 + (64 + 1) * 4  # 32 rows of the embedding's, the head's


def test_per_sample_gradients_with_torch_func():
    """DP-SGD by hand: vmap(grad(...)) over functional_call of the tracked model. Its module
    hooks run on torch.func's wrapped tensors, which have no storage (memprof stopped:
    "Cannot access storage of TensorWrapper"); they stand aside inside the transform, and the
    gradients the script assigns count."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    with memprof.track(model, opt) as prof:
        for _ in range(3):
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, torch.randn(32, 64),
                                                                   torch.randint(0, 10, (32,)))
            for k, p in model.named_parameters():
                p.grad = per_sample[k].mean(0)
            opt.step()
            opt.zero_grad()
    r = prof.report()
    size = (64 * 128 + 128 + 128 * 10 + 10) * 4
    assert r.optimizer_state == {"momentum_buffer": size}
    # No forward outside the transform: the step's peak is its gradients' arrival before the update.
    assert r.peak.bytes == {**dict.fromkeys(r.peak.bytes, 0), "parameters": size, "gradients": size,
                            "optimizer_state": size}


def test_explicit_optimizer():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.track(model, opt) as prof:
        train(model, opt, torch.randn(512, 512), 2)
    assert prof.report().optimizer_state == {"momentum_buffer": 2 * MiB}


def _gan(steps: int, given: bool):
    """A GAN's loop, the discriminator's step then the generator's, tracked as one ModuleDict
    (no forward of its own: G and D are called) with both optimizers given or found."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512))
    D = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))
    opt_d, opt_g = torch.optim.Adam(D.parameters()), torch.optim.Adam(G.parameters())
    both = nn.ModuleDict({"G": G, "D": D})
    with memprof.track(both, [opt_d, opt_g] if given else None, warmup=steps) as prof:
        for _ in range(steps):
            D.zero_grad()
            fake = G(torch.randn(32, 64))
            (D(fake.detach()).mean() - D(torch.randn(32, 512)).mean()).backward()
            opt_d.step()
            G.zero_grad()
            (-D(fake).mean()).backward()
            opt_g.step()
    return prof.report(), both, opt_d


def test_two_models_with_an_optimizer_each_are_tracked_as_one():
    """Given both optimizers, a step ends where the last of them steps, and both
    models' parameters and Adam state are named, none a temporary."""
    r, both, opt_d = _gan(3, given=True)
    assert len(r.steps) == 3
    g, d = (64 * 256 + 256 + 256 * 512 + 512) * 4, (512 * 256 + 256 + 256 + 1) * 4
    assert r.peak.bytes["parameters"] == g + d
    assert r.peak.bytes["optimizer_state"] == 2 * (g + d) + 8 * 4  # m and v, and a 4-byte step per tensor
    assert r.peak.bytes["temporaries"] == 0
    assert r.modules.loc["ModuleDict.G", "parameters"] == g and r.modules.loc["ModuleDict.D", "parameters"] == d
    phases = r.timeline[r.timeline.step == 2].phase.tolist()
    # The step runs from the generator's zero_grad to its optimizer step, with the discriminator's between.
    assert phases[-1] == "optimizer step" and phases.index("optimizer step") < phases.index("backward ModuleDict.G.0")
    with pytest.raises(TypeError, match=r"a list of them .* got str"):
        memprof.track(both, [opt_d, "opt_g"])
    with pytest.raises(TypeError, match="got an empty list"):
        memprof.track(both, [])


def test_several_optimizers_found_automatically_end_a_step_at_the_last():
    """Left out, the optimizers are found at their first steps; once the first
    steps again, the one before it (the last of an iteration) ends a step: a
    GAN's discriminator and generator, and one model with Muon's split (SGD
    for the matrices beside AdamW for the biases)."""
    r, _, _ = _gan(4, given=False)
    # Step 0 ends at the discriminator's first step (the cycle is not known yet), step 1 at the
    # generator's second; then each step is an iteration: the generator's backward, its step last.
    assert len(r.steps) == 4
    for step in (2, 3):
        phases = r.timeline[r.timeline.step == step].phase.tolist()
        assert phases[-1] == "optimizer step" and phases.index("optimizer step") < phases.index("backward ModuleDict.G.0")
        assert phases.index("forward ModuleDict.G") < phases.index("forward ModuleDict.D")

    model = mlp(bias=True)
    matrices, biases = [p for p in model.parameters() if p.ndim == 2], [p for p in model.parameters() if p.ndim == 1]
    sgd, adamw = torch.optim.SGD(matrices, lr=0.1, momentum=0.9), torch.optim.AdamW(biases)
    with memprof.track(model, warmup=4) as prof:
        for _ in range(4):
            model(torch.randn(512, 512)).sum().backward()
            sgd.step()
            adamw.step()
            model.zero_grad()
    r = prof.report()
    assert len(r.steps) == 4
    # After the cycle was learnt a step is one iteration: one forward, its backward, both optimizers.
    phases = r.timeline[r.timeline.step == 3].phase.tolist()
    assert phases[-1] == "optimizer step" and phases.count("forward Sequential.0") == 1
    assert phases.index("after backward") < phases.index("optimizer step")
    biases_bytes = sum(p.numel() for p in biases) * 4
    assert r.peak.bytes["optimizer_state"] == 2 * MiB + 2 * biases_bytes + 4 * len(biases)


def test_chains_to_user_saved_tensor_hooks():
    """A user's own saved-tensors hooks keep working under track, and what they
    keep off the device is not counted as activations."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def pack(t):
        calls.append(t.shape)
        return ("kept elsewhere", t.to("meta"))

    def unpack(p):
        return torch.zeros(p[1].shape, dtype=p[1].dtype)

    with memprof.track(model) as prof:
        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = model(torch.randn(512, 512)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert len(calls) >= 6
    assert prof.report().modules[A].sum() == 0


def _int8(t):
    """A compressing pack hook (ActNN's habit): int8 values and their scale, parameters as they are."""
    if isinstance(t, nn.Parameter):
        return t
    scale = t.abs().amax() / 127
    return (t / scale).round().to(torch.int8), scale, t.dtype


def _from_int8(p):
    return p if isinstance(p, torch.Tensor) else p[0].to(p[2]) * p[1]


def test_what_a_compressing_hook_keeps_is_the_activation():
    """A script's own hooks that compress what autograd saves (ActNN's habit: int8 values and
    a scale, in a tuple) keep those on the device: they are the activations. Here each 512 x 512
    fp32 tensor saved is kept as 256 KiB of int8 and a 4-byte scale: the first layer's input,
    the ReLU's output, and the second layer's input (the same tensor, packed again) and its
    weight's transpose (a view, not the Parameter, which the hook keeps as it is)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 512)
    with memprof.track(model) as prof:
        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(_int8, _from_int8):
                loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    saved = prof.report().modules["activations_saved_over_step"]
    int8 = 256 * KiB + 4
    assert saved[["Sequential.0", "Sequential.1", "Sequential.2"]].tolist() == [int8, int8, 2 * int8]


@pytest.mark.parametrize("hooks", [None, "int8"])
def test_checkpointed_inputs_under_the_scripts_hooks(hooks):
    """A non-reentrant checkpoint saves its block's input; under the script's own
    saved-tensors hooks that input is saved through them, and what they keep is counted: at
    the forward's end, 256 x 512 fp32 (512 KiB) for each block after the first, or 128 KiB of
    int8 and a scale for each of the three."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 512)
    around = torch.autograd.graph.saved_tensors_hooks(_int8, _from_int8) if hooks else contextlib.nullcontext()
    with memprof.track(model) as prof:
        for _ in range(2):
            with around:
                loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    timeline = prof.report().timeline
    forward_end = timeline[(timeline["step"] == 1) & (timeline["phase"] == "forward Net")].iloc[-1]
    # Without hooks the first block's input is the batch itself (inputs, not activations).
    assert forward_end["activations"] == (3 * (128 * KiB + 4) if hooks else 2 * 512 * KiB)


@pytest.mark.parametrize("outside", [False, True])
def test_a_forward_inside_torch_func_transforms_is_one_phase_with_its_graph_saved(outside):
    """The model called only inside vmap (functorch's MAML, per-sample losses): no module hook
    or saved-tensors hook sees into the transform, so the forward is one phase of the root, and
    what its graph saved for the backward is the root's activations, claimed from the graph's
    nodes where backward starts: the 8 x 25 x 64 fp32 batch (51200 bytes), the ReLU's 8 x 25 x 256
    output (204800) and the second layer's 8 x 25 x 5 output, which square saves (4000).
    ``outside``, a PINN's habit: the model also runs outside the transform (a boundary loss),
    whose ReLU output (4 x 256 fp32, 4096) and output that square saves (80) are activations too."""
    from torch.func import functional_call, vmap

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 5))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def task_loss(x):
        return functional_call(net, dict(net.named_parameters()), (x,)).square().sum()

    with memprof.track(net) as prof:
        for _ in range(2):
            loss = vmap(task_loss)(torch.randn(8, 25, 64)).sum()
            if outside:
                loss = loss + net(torch.randn(4, 64)).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
    timeline = prof.report().timeline
    step = timeline[timeline["step"] == 1]
    if outside:
        assert step["activations"].max() == 51200 + 204800 + 4000 + 4096 + 80
        assert step["temporaries"].max() == 0
        return
    forward = step[step["phase"] == "forward Sequential"]
    assert forward["activations"].tolist() == [51200 + 204800 + 4000]
    assert "backward" in step["phase"].tolist()


def test_a_sparse_input_counts_its_indices_too():
    """pygcn's habit: the graph's adjacency is a sparse COO tensor passed to the model. Its
    indices (2 x 5000 int64, 80000 bytes) are four fifths of it, beside its 5000 fp32 values:
    both are inputs, with the 1000 x 64 fp32 node features (256000 bytes)."""

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(64, 16, bias=False)

        def forward(self, x, adj):
            return torch.spmm(adj, self.w(x))

    torch.manual_seed(0)
    adj = torch.sparse_coo_tensor(torch.randint(0, 1000, (2, 5000)), torch.rand(5000), (1000, 1000),
                                  check_invariants=False)
    x = torch.randn(1000, 64)
    model = GCN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model) as prof:
        for _ in range(2):
            model(x, adj).sum().backward()
            opt.step()
            opt.zero_grad()
    assert prof.report().modules.loc["GCN", "inputs"] == 256000 + 80000 + 20000


def test_chains_hooks_the_model_pushes_inside_its_forward():
    """Saved-tensors hooks pushed inside the forward (torchtune's NoOpManager, save_on_cpu around
    some layers) replace the tracker's while they are on: what they keep on the device (here the
    second layer's 512 x 512 fp32 input, 1 MiB) is still that layer's activation, and the push
    function is the script's own again once the forward is done."""
    from torch.autograd.graph import saved_tensors_hooks

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)

        def forward(self, x):
            x = self.a(x)
            with saved_tensors_hooks(lambda t: t, lambda t: t):
                return self.b(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    push = torch._C._autograd._push_saved_tensors_default_hooks
    with memprof.track(model) as prof:
        for _ in range(3):
            model(torch.randn(512, 512)).sum().backward()
            assert torch._C._autograd._push_saved_tensors_default_hooks is push
            opt.step()
            opt.zero_grad()
    saved = prof.report().modules["activations_saved_over_step"]
    assert saved["Net.a"] == saved["Net.b"] == MiB


def test_a_module_given_a_detached_input_ends_its_backward_where_another_begins():
    """RAFT's update block takes ``coords1.detach()``: no gradient reaches its inputs, so the hook
    where its backward ends never fires, and every later sample (the encoder's backward) was named
    after the block. Its backward ends where a module outside it begins one."""

    class Refine(nn.Module):
        def __init__(self):
            super().__init__()
            self.update = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))

        def forward(self, x):
            return self.update(x.detach())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.refine, self.head = nn.Linear(256, 256), Refine(), nn.Linear(256, 256)

        def forward(self, x):
            h = self.encoder(x)
            return self.head(h + self.refine(h))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model) as prof:
        for _ in range(3):
            model(torch.randn(256, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
    timeline = prof.report().timeline
    phases = [p for p in timeline[timeline.step == timeline.step.max()].phase if p.startswith("backward")]
    assert list(dict.fromkeys(phases))[-1] == "backward Net.encoder"
    assert "backward Net.refine.update.2" in phases


def test_backward_of_modules_called_by_keyword_ends():
    """Hugging Face's layers call ``self_attn(hidden_states=...)``: the process-wide pre-hook is
    given no arguments, so backward's reaching those inputs was not hooked and the attention's
    backward never ended: every later sample (layer 0, the embedding) was named after the last
    layer's attention."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 100, (2, 16))
    with memprof.track(model) as prof:
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    timeline = prof.report().timeline
    phases = list(timeline[timeline.step == timeline.step.max()].phase)
    backward = [p for p in phases if p.startswith("backward")]
    assert backward[-1] == "backward LlamaForCausalLM.model.embed_tokens"
    assert "backward LlamaForCausalLM.model.layers.0.input_layernorm" in backward
    assert not any("layers.2" in p for p in backward[backward.index("backward LlamaForCausalLM.model.layers.1.mlp"):])


def test_gradients_of_parameters_frozen_when_the_step_began():
    """Lightning's toggle_optimizer freezes the generator during the discriminator's step, where
    a profiled step begins: its parameters were not hooked, and its gradients (512 x 512 fp32 and
    512, 1,050,624 bytes) were counted as activation gradients once its own step ran backward."""
    g, d = nn.Linear(512, 512), nn.Linear(512, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    model = nn.ModuleDict({"g": g, "d": d})  # held: memprof holds the model weakly
    with memprof.track(model, [opt_g, opt_d]) as prof:
        for _ in range(4):
            g.requires_grad_(False)
            opt_d.zero_grad()
            d(g(torch.randn(512, 512))).mean().backward()
            opt_d.step()
            g.requires_grad_(True)
            d.requires_grad_(False)
            opt_g.zero_grad()
            (-d(g(torch.randn(512, 512))).mean()).backward()
            opt_g.step()
            d.requires_grad_(True)
    timeline = prof.report().timeline
    done = timeline[(timeline.step == timeline.step.max()) & (timeline.phase == "after backward")]
    assert list(done.gradients) == [1_050_624 + 2_052] * 2 and list(done.activation_gradients) == [0, 0]


class CrossAttention(nn.Module):
    """An encoder's output attended to as key and value, the same tensor twice (as
    nn.TransformerDecoderLayer calls its cross-attention), the attention checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(64, 64)
        self.attn = nn.MultiheadAttention(64, 4)

    def forward(self, x, memory):
        m = self.enc(memory)
        return checkpoint(self.attn, x, m, m, need_weights=False, use_reentrant=False)[0]


def test_checkpoint_inputs_passed_twice_stay_one_tensor():
    """Under any saved-tensors hooks, checkpoint recomputed with each input a new tensor
    object: MultiheadAttention's `key is value` path changed between forward and
    recomputation ("Recomputed values ... have different metadata"), so training that runs
    without memprof stopped under track. The inputs are still activations: once forward
    is done, the checkpoint's saved input m (8 x 2 x 64 fp32, 4 KiB) is all there is (x and
    memory are the model's inputs)."""
    model = CrossAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, memory = torch.randn(8, 2, 64), torch.randn(8, 2, 64)
    if "save_inputs" not in vars(torch.utils.checkpoint._CheckpointFrame):
        pytest.skip("this torch's checkpoint frame has no save_inputs (torch 2.11): nothing to wrap")
    save_inputs = vars(torch.utils.checkpoint._CheckpointFrame)["save_inputs"]
    with memprof.track(model, every=1) as prof:
        for _ in range(3):
            model(x, memory).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    assert len(r.steps) == 3
    after_forward = r.timeline[(r.timeline["step"] == 2) & (r.timeline["phase"] == "loss")]
    assert after_forward[[A, "inputs"]].values.tolist() == [[8 * 2 * 64 * 4, 2 * 8 * 2 * 64 * 4]]
    assert vars(torch.utils.checkpoint._CheckpointFrame)["save_inputs"] is save_inputs  # unwrapped on exit
    with pytest.raises(Boom), memprof.track(model):
        raise Boom()
    assert vars(torch.utils.checkpoint._CheckpointFrame)["save_inputs"] is save_inputs


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


@pytest.mark.parametrize("reset", ["zero_grad", "zero_grad(set_to_none=False)", "p.grad.zero_()"])
def test_steps_without_an_optimizer(reset):
    """A loop that updates the parameters itself (pytorch/examples' word language model): a
    step ends where the model's next forward begins, after backward reached its parameters and
    their gradients were reset; two micro-batches accumulated before an update are one step."""
    model = mlp()
    x = torch.randn(512, 512)
    with memprof.track(model) as prof:
        for _ in range(3):
            if reset == "zero_grad":
                model.zero_grad()
            elif reset == "zero_grad(set_to_none=False)":
                model.zero_grad(set_to_none=False)
            else:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
            for _ in range(2):
                model(x).square().mean().backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
    r = prof.report()
    assert r.steps["step"].tolist() == [0, 1, 2]
    assert r.peak.bytes["parameters"] == 2 * MiB
    assert r.optimizer_state == {} and r.peak.bytes["optimizer_state"] == 0
    kept = 0 if reset == "zero_grad" else 2 * MiB  # gradients set to None, or zeroed and kept
    for step, s in r.timeline.groupby("step"):
        # both micro-batches in the step, which starts with the gradients reset at the end of the
        # one before (the reset comes before the forward the step begins at)
        # (two samples in each one's loss: the model's end, and the loss saving its output, 1 MiB)
        assert (s["phase"] == "loss").sum() == 4
        assert s[s["phase"] == "forward Sequential"]["gradients"].iloc[0] == (0 if step == 0 else kept)
        assert s[s["phase"] == "after backward"]["gradients"].iloc[0] == 2 * MiB
    assert _global_hooks() == (0, 0, 0, 0, None) and _model_hooks(model) == 0


def test_an_optimizer_found_ends_the_steps_without_one():
    """A forward and backward before the first optimizer step, its gradients reset (a check
    that the loss goes down), is a step of its own; the optimizer ends each step from its first."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 512)
    with memprof.track(model, every=1) as prof:
        model(x).sum().backward()
        model.zero_grad()
        train(model, opt, x, 3)
    r = prof.report()
    assert r.steps["step"].tolist() == [0, 1, 2, 3]  # the check, then 3 steps each ended by the optimizer
    optimizer = r.timeline[r.timeline["phase"] == "optimizer step"]
    assert optimizer.groupby("step").size().to_dict() == {1: 1, 2: 1, 3: 1}


def test_a_parameter_no_module_holds_is_the_optimizers_own():
    """A learnable temperature beside the model (CLIP's logit scale kept by the loop), stepped by
    the model's optimizer: a parameter, and its gradient a gradient (they were temporaries)."""
    model = mlp()
    temperature = nn.Parameter(torch.ones(128, 512))  # 256 KiB
    opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    x = torch.randn(512, 512)
    with memprof.track(model, opt) as prof:
        for _ in range(2):
            (model(x) * temperature.mean()).sum().backward()
            opt.step()
    r = prof.report()
    assert r.peak.bytes["parameters"] == 2 * MiB + 256 * 1024
    assert r.timeline.groupby("step")["gradients"].first().tolist() == [0, 2 * MiB + 256 * 1024]


def test_a_module_shared_by_several_parents_is_a_module_at_each_path():
    """YOLOv5's Conv keeps one SiLU as a class attribute, registered in every Conv: each call is
    named by the Conv calling it (all were the first Conv's)."""

    class Conv(nn.Module):
        act = nn.SiLU()

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.act = Conv.act

        def forward(self, x):
            return self.act(self.conv(x))

    model = nn.Sequential(Conv(), Conv(), Conv())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model, opt, warmup=2, every=1) as prof:
        for _ in range(6):
            model(torch.randn(4, 8, 64, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    saved = r.modules["activations_saved_over_step"]
    assert [saved[f"Sequential.{i}.act"] for i in range(3)] == [4 * 8 * 64 * 64 * 4] * 3  # SiLU's input, 512 KiB
    assert r.steps["peak_allocated"].nunique() == 1


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
        # the optimizer step is the interval the step's last sample closes, after every forward/backward phase
        assert phases.index("optimizer step") == len(phases) - 1
        assert phases[-2] == "after backward"
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


# -- the module table at the peak, and the phases ------------------------------
AT_PEAK = [c.value for c in memprof.report.MODULE_CATEGORIES]


def assert_adds_up(r):
    """The root row is the category table at the peak, and no row holds less
    than its children together (a row includes its submodules)."""
    m = r.modules
    root = m.index[0]
    assert m.loc[root, AT_PEAK].tolist() == [r.peak.bytes[c] for c in AT_PEAK]
    for name in m.index:
        children = [n for n in m.index if n.rpartition(".")[0] == name]
        if children:
            assert (m.loc[children, AT_PEAK].sum() <= m.loc[name, AT_PEAK]).all(), name


def test_root_row_is_the_peak_exactly():
    r = tracked(3)
    # The peak: the ReLU's backward has just produced dL/d(first Linear's
    # output) while dL/d(ReLU's output) and the ReLU's saved output are alive,
    # after the second Linear's weight gradient.
    assert r.peak.phase == "backward Sequential.1"
    assert r.peak.bytes == {
        "parameters": 2 * MiB, "buffers": 0, "gradients": MiB, "optimizer_state": 4 * MiB + 8,
        "activations": MiB, "activation_gradients": 2 * MiB, "inputs": MiB, "other_models": 0, "workspaces": 0,
        "temporaries": 0,
    }
    assert_adds_up(r)
    m = r.modules
    assert m.loc["Sequential.1", [A, "activation_gradients"]].tolist() == [MiB, MiB]
    assert m.loc["Sequential.2", ["gradients", "activation_gradients"]].tolist() == [MiB, MiB]
    # What the root's own code holds: the input; the children hold the rest.
    own = m.loc["Sequential", AT_PEAK] - m.loc[["Sequential.0", "Sequential.1", "Sequential.2"], AT_PEAK].sum()
    assert own.to_dict() == {c: MiB if c == "inputs" else 0 for c in AT_PEAK}


class Stack(nn.Module):
    """Three residual FF blocks and a head: a transformer's layout in small."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(FF() for _ in range(3))
        self.head = nn.Linear(256, 64, bias=False)
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def tracked_stack(micro_batches: int, checkpointed: bool = False, steps: int = 3):
    model = Stack(checkpointed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model) as prof:
        for _ in range(steps):
            for _ in range(micro_batches):
                model(torch.randn(256, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return prof.report()


KiB = 1024
BLOCKS = [f"Stack.blocks.{i}" for i in range(3)]


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_module_rows_at_peak_with_accumulation(micro_batches):
    r = tracked_stack(micro_batches)
    assert_adds_up(r)
    m = r.modules
    # A ModuleList runs no code of its own: its row is its blocks' rows.
    assert m.loc[BLOCKS, AT_PEAK].sum().tolist() == m.loc["Stack.blocks", AT_PEAK].tolist()
    for block in BLOCKS:
        parts = [f"{block}.fc1", f"{block}.act", f"{block}.fc2"]
        assert m.loc[parts, AT_PEAK].sum().tolist() == m.loc[block, AT_PEAK].tolist()
    # A micro-batch of 256 rows: a block's hidden ReLU output is 256x1024 fp32
    # = 1 MiB, a block's output 256x256 = 256 KiB. Over the step every
    # micro-batch adds its own: per forward x, three ReLU outputs, the
    # inputs of blocks 1, 2 and the head, and the head's output, 64 KiB,
    # which the loss saves.
    over = m["activations_saved_over_step"]
    assert over["Stack"] == micro_batches * (3 * MiB + 4 * 256 * KiB + 64 * KiB)
    assert over["Stack.blocks.0.act"] == micro_batches * MiB
    assert m.loc["Stack", "inputs"] == 256 * KiB
    if micro_batches == 1:
        return  # the gradients grow through backward: the peak is late in it
    # From the second micro-batch on the gradients are whole from the start,
    # and the peak falls in the last block's backward, where one micro-batch's
    # activations are live: three ReLU outputs and the inputs of blocks 1 and
    # 2 (the last block's output, saved by the head, is freed by then).
    assert r.peak.phase == "backward Stack.blocks.2.fc2"
    assert r.peak.bytes["gradients"] == m.loc["Stack", "parameters"]
    assert r.peak.bytes[A] == 3 * MiB + 2 * 256 * KiB
    assert m.loc["Stack.blocks.1", A] == MiB + 256 * KiB  # its ReLU's output and its input, which its fc1 saved first
    assert m.loc["Stack.blocks.0", A] == MiB  # its input is x, the model's input


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_module_rows_at_peak_with_checkpointing(micro_batches):
    r = tracked_stack(micro_batches, checkpointed=True)
    assert_adds_up(r)
    m = r.modules
    assert m.loc[BLOCKS, AT_PEAK].sum().tolist() == m.loc["Stack.blocks", AT_PEAK].tolist()
    # The recomputed forward is named as such, inside backward.
    phases = set(r.timeline["phase"])
    assert {"recompute Stack.blocks.0.act", "recompute Stack.blocks.2.fc1"} <= phases
    # Recomputation saves again: over the step each block's ReLU output counts once per micro-batch.
    assert m.loc["Stack.blocks.0.act", "activations_saved_over_step"] == micro_batches * MiB
    if micro_batches == 1:
        return
    # At the peak (the last block's backward): the checkpoints' saved inputs of
    # blocks 1 and 2 (256 KiB each, saved while Stack's own forward ran), and
    # the last block's recomputed ReLU output (1 MiB); no other block's.
    assert r.peak.phase == "backward Stack.blocks.2.fc2"
    assert r.peak.bytes[A] == MiB + 2 * 256 * KiB
    assert m.loc["Stack.blocks.2.act", A] == MiB
    assert m.loc["Stack.blocks.0", A] == m.loc["Stack.blocks.1", A] == 0
    assert m.loc["Stack", A] - m.loc["Stack.blocks", A] - m.loc["Stack.head", A] == 2 * 256 * KiB


def test_two_modules_saving_one_storage():
    """A ReLU's output is saved by the ReLU and by the next Linear: live, it is
    the ReLU's (the first to save it); over the step, each module's row counts
    it, and their parent's once."""
    r = tracked(2)
    m = r.modules
    assert m.loc["Sequential.1", A] == MiB and m.loc["Sequential.2", A] == 0
    over = m["activations_saved_over_step"]
    assert over["Sequential.1"] == over["Sequential.2"] == MiB
    assert over["Sequential"] == 3 * MiB  # x, the ReLU's output, and its own output the loss saves


def test_phases_of_a_step():
    r = tracked(3)
    s = r.timeline[r.timeline["step"] == 2]
    kinds = []
    for p in s["phase"]:
        kind = memprof.report.phase_kind(p)
        assert kind is not None, p
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    P = memprof.report.Phase
    # zero_grad() ran after the previous step's optimizer step, so at the start of this one.
    assert kinds == [
        P.BETWEEN_STEPS, P.ZERO_GRAD, P.BETWEEN_STEPS, P.FORWARD, P.LOSS, P.BACKWARD, P.AFTER_BACKWARD, P.OPTIMIZER_STEP
    ]
    modules = {memprof.report.phase_module(p) for p in s["phase"]}
    assert modules == {"", "Sequential", "Sequential.0", "Sequential.1", "Sequential.2"}


def test_peak_in_forward_of_a_module():
    """Without backward (an evaluation pass with autograd on), the saved tensors
    pile up to the end of forward: the peak is the ReLU's save."""
    model = mlp()
    with memprof.track(model) as prof:
        model(torch.randn(512, 512)).sum()
    r = prof.report()
    assert r.peak.phase == "forward Sequential.1"
    assert r.peak.bytes[A] == MiB and r.peak.bytes["inputs"] == MiB


def test_peak_in_optimizer_step():
    """Adam creates its state in its first step: with no activations to speak
    of (one row of input), that step is the peak."""
    model = nn.Linear(512, 512, bias=False)
    opt = torch.optim.Adam(model.parameters())
    with memprof.track(model) as prof:
        model(torch.randn(1, 512)).sum().backward()
        opt.step()
    r = prof.report()
    assert r.peak.phase == "optimizer step"
    assert r.peak.bytes == {
        "parameters": MiB, "buffers": 0, "gradients": MiB, "optimizer_state": 2 * MiB + 4,
        "activations": 0, "activation_gradients": 0, "inputs": 0, "other_models": 0, "workspaces": 0,
        "temporaries": 0,  # the input is gone by then
    }
    assert_adds_up(r)


def _simulated(setup, steps=2):
    return memprof.simulate(setup, target="h100", steps=steps)


def test_peak_in_loss_outside_the_model():
    """A cross-entropy over 32 MiB of logits, computed after the model returns:
    its softmax and the logits' gradient make the peak (a simulated GPU sees
    every allocation, unlike the CPU's ledger)."""

    def setup():
        model = nn.Linear(64, 8192, bias=False).cuda()  # 2 MiB of weight
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(1024, 64, device="cuda")  # 256 KiB
        y = torch.randint(0, 8192, (1024,), device="cuda")

        def step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return model, opt, step

    r = _simulated(setup)
    assert r.peak.phase == "loss"
    assert r.peak.bytes["parameters"] == 2 * MiB and r.peak.bytes["inputs"] == 256 * KiB
    # The log-softmax cross-entropy saves for backward is an activation (of the root), with the 8 KiB of
    # targets NLL saves; its gradient and the logits' are activation gradients (the loss's nodes are
    # hooked: they were temporaries, named at the interval's end). Left as temporaries: the loss and
    # NLL's total weight, a 512-byte block each (the logits died once log-softmax had read them)
    assert r.peak.bytes["activations"] == 32 * MiB + 8 * KiB
    assert r.peak.bytes["activation_gradients"] == 2 * 32 * MiB and r.peak.bytes["temporaries"] == 1024
    assert_adds_up(r)


def test_peak_in_optimizer_step_simulated():
    """Adam's foreach temporaries (CUDA's default) on a 4 MiB weight and a
    one-row batch: the steady step peaks inside optimizer.step()."""
    setup = adam_linear
    r = _simulated(setup, steps=3)
    assert r.peak.phase == "optimizer step" and r.peak.step == 2
    assert [r.peak.bytes[c] for c in ("parameters", "gradients", "optimizer_state")] == [4 * MiB, 4 * MiB, 8 * MiB]
    assert_adds_up(r)


def test_zero_grad_wrapper_is_gone_and_class_wide_only_for_tracked():
    model, other = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters())
    other_opt = torch.optim.AdamW(other.parameters())
    before = (vars(nn.Sequential).get("zero_grad"), vars(torch.optim.AdamW).get("zero_grad"))
    with memprof.track(model, opt) as prof:
        train(model, opt, torch.randn(512, 512), 2)
        other(torch.randn(4, 512)).sum().backward()
        other_opt.zero_grad()  # another instance of the same classes: not a phase
        other.zero_grad()
    assert (vars(nn.Sequential).get("zero_grad"), vars(torch.optim.AdamW).get("zero_grad")) == before
    assert "zero_grad" not in vars(model) and "zero_grad" not in vars(opt)
    # After step 0's optimizer step, so in step 1; the one after step 1's opens
    # a step that no optimizer step ends, whose samples the timeline leaves out.
    # The other instances' calls are not phases.
    r = prof.report()
    assert (r.timeline["phase"] == "zero_grad").sum() == 1
    assert sorted(set(r.timeline["step"])) == [0, 1]


def test_ledger_rebuilds_modules_at_a_mark():
    """The module table at an earlier moment: every change after the mark
    (added, moved to another category, resized, freed) is undone exactly."""
    from memprof.categories import Category as C
    from memprof.ledger import Ledger

    led = Ledger()
    a, b, c = torch.zeros(256), torch.zeros(512), torch.zeros(1024)  # 1, 2 and 4 KiB
    led.add(a.untyped_storage(), C.PARAMETERS, "M.a")
    led.open_journal()
    led.add(b.untyped_storage(), C.ACTIVATIONS, "M.b")
    mark = led.mark()
    before = led.by_module()
    totals = led.snapshot()
    led.add(c.untyped_storage(), C.ACTIVATIONS, "M.c")
    led.add(b.untyped_storage(), C.ACTIVATION_GRADIENTS, "M.c", replace=True)
    c.untyped_storage().resize_(8 * KiB)
    led.resize(c.untyped_storage())
    del b
    gc.collect()
    assert led.by_module() == {("M.a", C.PARAMETERS): KiB, ("M.c", C.ACTIVATIONS): 8 * KiB}
    assert led.by_module(mark) == before == {("M.a", C.PARAMETERS): KiB, ("M.b", C.ACTIVATIONS): 2 * KiB}
    assert {cat: sum(v for (_, k), v in before.items() if k is cat) for cat in totals} == totals
    led.close_journal()
    assert led.mark() == 0



def test_ledger_costs_the_garbage_collector_one_object_a_storage():
    """A profiled step records thousands of storages that live until its end;
    each costs Python's garbage collector only its weak reference (an entry
    and a journal change are objects it does not track), so that a step
    brings the next scan of the whole heap no closer than it must."""
    from memprof.categories import Category as C
    from memprof.ledger import Ledger

    led = Ledger()
    led.open_journal()
    tensors = [torch.zeros(4) for _ in range(1000)]
    storages = [t.untyped_storage() for t in tensors]
    gc.collect()
    before = len(gc.get_objects())
    for s in storages:
        led.add(s, C.ACTIVATIONS, "M.a")
    for s in storages[::2]:
        led.add(s, C.ACTIVATION_GRADIENTS, "M.b", replace=True)
    gc.collect()
    assert len(gc.get_objects()) - before <= len(storages) + 10
    assert led.by_module() == {("M.a", C.ACTIVATIONS): 500 * 16, ("M.b", C.ACTIVATION_GRADIENTS): 500 * 16}

def test_optimizer_state_made_or_replaced_in_a_cheap_step():
    """After the first steps, a profiled step skips the optimizer's state it
    recorded already (the same tensors). State the optimizer makes in a
    later cheap step (a parameter group added) or is given (a loaded state
    dict, new tensors) is recorded all the same: each step peaks at the
    loss, before its optimizer step, holding exactly the state of the step
    before it."""
    from memprof.devices import get_gpu
    from memprof.simulate import SimulatedAllocator
    from memprof.virtual_cuda import VirtualCUDA

    gpu = get_gpu("h100")
    with VirtualCUDA(gpu, allocator=SimulatedAllocator(gpu)):
        model = mlp().cuda()
        opt = torch.optim.AdamW(model[2].parameters())
        x = torch.randn(512, 512, device="cuda")
        peaks = []
        with memprof.track(model, opt, warmup=0, every=1) as prof:
            for i in range(9):
                if i == 3:
                    opt.add_param_group({"params": model[0].parameters()})
                model(x).square().mean().backward()
                if i == 7:
                    state = opt.state_dict()
                    state["state"] = {k: {n: v.clone() for n, v in s.items()} for k, s in state["state"].items()}
                    opt.load_state_dict(state)
                opt.step()
                opt.zero_grad()
                peaks.append(prof.last_peak)
    r = prof.report()
    # Steps 0-2 are full (step 0 peaks elsewhere, steps 1 and 2 agree). Step 3 (cheap)
    # makes the new group's state, and step 4 (cheap) peaks higher with it: steps 5
    # and 6 are full ones again (for the module table), then cheap ones; step 7
    # (cheap) is given new state tensors, which step 8 holds.
    assert r.meta["full_profiles"] == [0, 1, 2, 5, 6]
    # Step 0 peaks in its optimizer step, over its new state and both cuBLAS
    # workspaces (the training thread's and autograd's), the others at the loss.
    assert [p.phase for p in peaks] == ["optimizer step"] + ["loss"] * 8
    # AdamW's m and v, 1 MiB each for each 512x512 weight (`step` stays on the host).
    assert [p.bytes["optimizer_state"] for p in peaks] == [2 * MiB] * 4 + [4 * MiB] * 5
    # The workspaces (32 MiB each on an H100), taken in step 0, are named from
    # the next full step on; nothing of the state is left unnamed.
    assert [p.bytes["workspaces"] for p in peaks] == [0] + [2 * 32 * MiB] * 8
    assert peaks[0].bytes["temporaries"] >= 2 * 32 * MiB
    assert len({p.bytes["temporaries"] for p in peaks[1:]}) == 1
    assert r.optimizer_state == {"exp_avg": 2 * MiB, "exp_avg_sq": 2 * MiB}
    assert r.modules.loc["Sequential.0", "optimizer_state"] == 2 * MiB


def test_workspaces_give_way_to_tensors_found_later():
    """A 32 MiB block named as cuBLAS's workspace that turns out to be Adam's
    state (an optimizer met at its first step) is not counted twice: the
    categories still add up, with no negative temporaries."""
    from memprof.categories import Category as C
    from memprof.tracker import _counts

    totals = {C.PARAMETERS: 32 * MiB, C.OPTIMIZER_STATE: 64 * MiB, C.WORKSPACES: 3 * 32 * MiB}
    counts = _counts(totals, 32 * MiB + 64 * MiB + 32 * MiB, None)
    assert counts["workspaces"] == 32 * MiB and counts["temporaries"] == 0
    counts = _counts(totals, 32 * MiB + 64 * MiB + 5 * 32 * MiB, None)  # more than enough: nothing gives way
    assert counts["workspaces"] == 3 * 32 * MiB and counts["temporaries"] == 2 * 32 * MiB


def test_modules_that_pass_their_input_through_leave_backward_phases_alone():
    """nn.Identity and a dropout that drops nothing return their input tensor itself: the hook
    where their backward ends and the one where it begins sat on one tensor, the end's first, so
    a span opened that nothing closed and the first Linear's backward was named after the
    dropout."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Identity(), nn.Linear(512, 512), nn.Dropout(0.0), nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model) as prof:
        for _ in range(3):
            model(torch.randn(512, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
    timeline = prof.report().timeline
    phases = [p for p in timeline[timeline.step == timeline.step.max()].phase if p.startswith("backward")]
    assert list(dict.fromkeys(phases)) == ["backward Sequential.4", "backward Sequential.2", "backward Sequential.0"]


class SelectiveBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("respect", [None, True])
def test_selective_checkpointing_keeps_its_saved_outputs_as_activations(respect):
    """torchtitan's per-op selective checkpointing: the policy saves matrix products and
    recomputes the rest. Its caching dispatch mode keeps what it saves outside autograd's saved
    tensors, which were counted nowhere. At the loss, each of two blocks keeps its two mm
    outputs (512 x 512 fp32, 1 MiB each): 4 MiB of activations. On torch 2.14, memprof's own
    saved-tensors hooks made the region warn (FutureWarning) and, with
    respect_saved_tensors_hooks=True, fail in backward ("not found in storage")."""
    import functools
    import inspect
    import warnings

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    options = {} if respect is None else {"respect_saved_tensors_hooks": respect}
    if options and "respect_saved_tensors_hooks" not in inspect.signature(checkpoint).parameters:
        pytest.skip("this torch's checkpoint has no respect_saved_tensors_hooks (before 2.14)")
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([SelectiveBlock() for _ in range(2)])

        def forward(self, x):
            context = functools.partial(create_selective_checkpoint_contexts, policy)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False, context_fn=context, **options)
            return x

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(), memprof.track(model) as prof:
        warnings.simplefilter("error", FutureWarning)
        for _ in range(3):
            model(torch.randn(512, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
    timeline = prof.report().timeline
    step = timeline[timeline.step == timeline.step.max()]
    assert list(step[step.phase == "loss"].activations) == [4 * MiB]


def test_parameters_given_new_storage_by_the_script_keep_their_module():
    """SAM's second step puts back the weights it kept (``p.data = old_p``): each parameter
    then lives in another storage, which was recorded as the optimizer's own parameter, owned
    by no module: every module row lost its parameters and gradients from the next step on."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with memprof.track(model, opt, every=1, full=True) as prof:  # every step profiled in full
        for _ in range(4):
            nn.functional.cross_entropy(model(torch.randn(512, 256)), torch.randint(0, 10, (512,))).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.clone()
            opt.step()
            opt.zero_grad()
    report = prof.report()
    first, last = (256 * 1024 + 1024) * 4, (1024 * 10 + 10) * 4
    assert report.modules.loc[["Sequential.0", "Sequential.2"], "parameters"].tolist() == [first, last]
    assert report.peak.bytes["parameters"] == first + last
    # The peak: the ReLU's backward, the last Linear's gradients made, not yet the first's.
    assert report.peak.phase == "backward Sequential.1"
    assert report.modules.loc[["Sequential.0", "Sequential.2"], "gradients"].tolist() == [0, last]


def test_buffers_and_parameters_registered_while_tracked_are_the_modules():
    """The pruning tutorial prunes between steps: prune.l1_unstructured moves each weight to a
    parameter weight_orig and registers a buffer weight_mask (as large). The masks were
    activations (the multiply saves them) and temporaries, the module's buffers empty."""
    import torch.nn.utils.prune as prune

    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model, opt, every=1, full=True) as prof:
        for i in range(4):
            if i == 3:  # in the last step, after it began: its peak is the highest, with the mask
                prune.l1_unstructured(model[0], "weight", amount=0.5)
            model(torch.randn(64, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    report = prof.report()
    assert report.peak.step == 3
    assert report.modules.loc["Sequential.0", "buffers"] == MiB  # weight_mask, 512 x 512 fp32
    assert report.modules.loc["Sequential.0", "parameters"] == MiB + 512 * 4  # weight_orig and the bias


def test_calls_without_gradients_between_steps_are_no_forward_of_the_step():
    """A validation pass, or a flow's sampling through part of the model, under no_grad between
    steps: each call was taken for the step's forward, the phase after it called "loss", its
    arguments counted as the step's inputs. Now the step's phases are its training's: the
    batch of 64 x 512 fp32 (128 KiB) is its only input."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model, opt, every=1, full=True) as prof:
        for _ in range(4):
            with torch.no_grad():
                model(torch.randn(256, 512))  # validation
                model[2](torch.randn(1024, 512))  # a part of it, alone
            model(torch.randn(64, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    report = prof.report()
    timeline = report.timeline
    phases = list(timeline[timeline.step == timeline.step.max()].phase)
    assert phases.count("loss") == 1 and phases.index("loss") > phases.index("forward Sequential.2")
    assert report.peak.bytes["inputs"] == 64 * 512 * 4


def test_forwards_in_eval_mode_with_gradients_are_evaluations_where_no_backward_follows():
    """pytorch-tabnet predicts in eval mode without torch.no_grad(): no backward follows those
    forwards, so the step they fall in has an evaluation. Two forwards in eval mode (dropout off)
    whose losses one backward takes are training."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    evaluated = []
    with memprof.track(model) as prof:
        for step in range(6):
            model.train(step % 2 == 0)  # odd steps in eval mode: both forwards' losses backpropagated
            (model(x).square().mean() + model(x).abs().mean()).backward()
            opt.step()
            opt.zero_grad()
            evaluated.append(prof.evaluated)
            if step == 3:  # a prediction after the step: in the next one, before its forward
                model.eval()
                [model(xb) for xb in x.split(8)]
    assert evaluated == [False, False, False, False, True, False]


def test_a_functional_ensemble_is_tracked_where_its_optimizers_tensors_are():
    """PyTorch's "Model ensembling" tutorial: the members' parameters stacked (stack_module_state),
    a base model moved to 'meta', torch.func.functional_call under vmap. The model given holds no
    memory; the tensors the optimizer steps are its parameters, on the optimizer's device (the
    tracker looked at the base model's and watched 'meta', where nothing is allocated)."""
    from torch.func import functional_call, stack_module_state

    members = [nn.Linear(512, 512) for _ in range(4)]
    params, buffers = stack_module_state(members)  # 4 x (512 x 512 + 512) fp32
    base = nn.Linear(512, 512).to("meta")
    opt = torch.optim.SGD(params.values(), lr=0.1)

    def member(p, b, x):
        return functional_call(base, (p, b), (x,))

    x = torch.randn(8, 512)
    with memprof.track(base, opt) as prof:
        for _ in range(5):
            torch.vmap(member, in_dims=(0, 0, None))(params, buffers, x).sum().backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    assert prof.device == torch.device("cpu")
    assert r.peak.bytes["parameters"] == 4 * MiB + 4 * 512 * 4


def test_a_torch_func_transform_inside_the_forward_runs_under_tracking():
    """A contractive autoencoder's Jacobian penalty: ``vmap(jacrev(encode))`` inside the model's
    forward. torch.func's grad transforms refuse saved-tensors hooks ("don't yet support saved
    tensor hooks"), and the tracker's were on for the forward: the script failed under memprof
    alone. They are set aside while the transform runs; what the penalty keeps for backward
    outside it, the Jacobian (8 x 256 x 512 fp32, 4 MiB), is an activation."""
    from torch.func import functional_call, jacrev, vmap

    class CAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Linear(512, 256), nn.Linear(256, 512)

        def forward(self, x):
            z = torch.sigmoid(self.enc(x))
            encode = lambda p, xi: torch.sigmoid(functional_call(self.enc, p, (xi,)))  # noqa: E731
            jac = vmap(jacrev(encode, argnums=1), in_dims=(None, 0))(dict(self.enc.named_parameters()), x)
            return self.dec(z), jac.square().sum()

    model = CAE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 512)
    with memprof.track(model, opt) as prof:
        for _ in range(5):
            rec, penalty = model(x)
            ((rec - x).square().mean() + 1e-3 * penalty).backward()
            opt.step()
            opt.zero_grad()
    r = prof.report()
    assert r.peak.bytes["parameters"] == (512 * 256 + 256 + 256 * 512 + 512) * 4
    assert 4 * MiB <= r.peak.bytes["activations"] <= 4 * MiB + 64 * 1024  # and the codes' few KiB
    assert torch.autograd.graph.disable_saved_tensors_hooks.__module__ == "torch.autograd.graph"  # put back
