"""memprof.runner: observing unmodified scripts on the CPU, exact bytes, no hooks left behind."""

import logging
import os
import sys
import textwrap
import uuid
import warnings

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

from memprof.runner import ScriptError, observe_script

MiB = 1 << 20

# Two 512x512 fp32 weights without bias (1 MiB each), AdamW, a loss *module*
# called after the model, argparse, loss.item(), and a try/except Exception
# around each step that must not swallow memprof's stop.
MLP = """
import argparse, json, sys
import torch
from torch import nn
import {sibling}  # next to the script: importable as under `python script.py`

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
p.add_argument("--accum", type=int, default=1)
args = p.parse_args()
print("ARGV " + json.dumps(sys.argv))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
opt = torch.optim.AdamW(model.parameters())
loss_fn = nn.MSELoss()
x, y = torch.randn(64, 512), torch.randn(64, 512)
for step in range(args.steps):
    try:
        for _ in range(args.accum):
            loss = loss_fn(model(x), y) / args.accum
            loss.backward()
        print(f"step {{step}} loss {{loss.item():.4f}}")
        opt.step()
        opt.zero_grad()
    except Exception as exc:
        print("swallowed", type(exc).__name__)
        raise SystemExit(3)
print("done")
"""


def hooks_left():
    """Every process-wide hook that memprof might have registered, and the profile function."""
    return {
        "forward_pre": dict(module_hooks._global_forward_pre_hooks),
        "forward": dict(module_hooks._global_forward_hooks),
        "forward_always": dict(module_hooks._global_forward_hooks_always_called),
        "optimizer_pre": dict(optimizer_hooks._global_optimizer_pre_hooks),
        "optimizer_post": dict(optimizer_hooks._global_optimizer_post_hooks),
        "profile": sys.getprofile(),
        "saved_tensors": torch._C._autograd._top_saved_tensors_default_hooks(False),
    }


NO_HOOKS = {k: {} for k in ("forward_pre", "forward", "forward_always", "optimizer_pre", "optimizer_post")} | {
    "profile": None, "saved_tensors": None
}


@pytest.fixture
def clean():
    """Check that argv, sys.path and the global hooks are as before, whatever the test did."""
    argv, path = list(sys.argv), list(sys.path)
    assert hooks_left() == NO_HOOKS
    yield
    assert sys.argv == argv
    assert sys.path == path
    assert hooks_left() == NO_HOOKS


def write(tmp_path, source, name="train.py"):
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    return script


@pytest.fixture
def mlp_script(tmp_path):
    sibling = f"sibling_{uuid.uuid4().hex}"
    (tmp_path / f"{sibling}.py").write_text("")
    yield write(tmp_path, MLP.format(sibling=sibling))
    sys.modules.pop(sibling, None)


def printed_steps(out):
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")]


def test_observes_exact_bytes_and_stops_after_steps(mlp_script, capsys, clean):
    report = observe_script(mlp_script, ["--steps", "50"], steps=3)
    out = capsys.readouterr().out

    assert f'ARGV ["{mlp_script}", "--steps", "50"]' in out
    # 1 warmup step finds the model, then 3 tracked steps; the script stops in
    # the 4th step's optimizer.step(), which its `except Exception` cannot catch.
    assert printed_steps(out) == [0, 1, 2, 3]
    assert "swallowed" not in out and "done" not in out

    assert len(report.steps) == 3
    assert report.steps["step"].tolist() == [0, 1, 2]
    assert report.steps["profiled"].all()
    peak = report.peak.bytes
    assert peak["parameters"] == 2 * MiB  # two 512x512 fp32 weights
    assert peak["buffers"] == 0
    # AdamW: exp_avg and exp_avg_sq of every weight, and a 4-byte fp32 step per weight.
    assert report.optimizer_state == {"exp_avg": 2 * MiB, "exp_avg_sq": 2 * MiB, "step": 8}
    # The model, not the MSELoss module called after it, is the root.
    assert report.modules.index[0] == "Sequential"
    cols = ["parameters", "optimizer_state"]
    assert report.modules.loc["Sequential.0", cols].tolist() == [MiB, 2 * MiB + 4]
    assert report.modules.loc["Sequential.2", cols].tolist() == [MiB, 2 * MiB + 4]
    assert report.modules.loc["Sequential", "gradients"] == peak["gradients"]  # the root row is the peak's
    # over the step, the first Linear saved its input x
    assert report.modules.loc["Sequential.0", "activations_saved_over_step"] == 64 * 512 * 4
    assert report.meta["observed_steps"] == 3
    assert report.meta["script_args"] == ["--steps", "50"]


def test_gradient_accumulation_and_warmup(mlp_script, capsys, clean):
    report = observe_script(mlp_script, ["--accum", "4"], steps=2, warmup=2)
    assert printed_steps(capsys.readouterr().out) == [0, 1, 2, 3]  # 2 warmup + 2 tracked
    assert len(report.steps) == 2
    assert report.peak.bytes["parameters"] == 2 * MiB


def test_script_ending_early_gives_the_steps_it_made(mlp_script, capsys, caplog, clean):
    with caplog.at_level(logging.WARNING, logger="memprof"):
        report = observe_script(mlp_script, ["--steps", "2"], steps=3)
    assert "done" in capsys.readouterr().out
    assert len(report.steps) == 1  # step 0 found the model, step 1 was tracked
    assert "ended after 1 of 3 tracked steps" in caplog.text


def test_picks_the_model_the_optimizer_trains(tmp_path, clean):
    # A frozen encoder and the model are both outermost modules; only the
    # model's parameters are optimized, and a loss module is called last.
    script = write(tmp_path, """
        import torch
        from torch import nn
        class Student(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(256, 256, bias=False)
            def forward(self, x):
                return self.fc(x)
        encoder = nn.Linear(256, 256)
        student = Student()
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        for _ in range(10):
            with torch.no_grad():
                h = encoder(torch.randn(8, 256))
            nn.MSELoss()(student(h), h).backward()
            opt.step()
            opt.zero_grad()
    """)
    report = observe_script(script, steps=2)
    assert report.modules.index.tolist() == ["Student", "Student.fc"]
    assert report.peak.bytes["parameters"] == 256 * 256 * 4
    assert report.optimizer_state == {}  # plain SGD keeps no state
    assert report.other_models == {"encoder": (256 * 256 + 256) * 4}  # frozen, outside the model


def test_frozen_models_and_an_ema_in_a_function_on_the_simulated_gpu(tmp_path, clean):
    """A diffusion fine-tune's habits, inside main(): a frozen VAE and text encoder on the
    device, the trained network, an EMA of it updated after each step and never called.
    Their weights are other models', named as main() names them, each tensor in its own
    512-byte-rounded block; the trained model's are its parameters."""
    script = write(tmp_path, """
        import torch
        from torch import nn
        from torch.optim.swa_utils import AveragedModel
        def main():
            vae = nn.Conv2d(3, 4, 8, stride=8).cuda().requires_grad_(False)
            text_encoder = nn.Embedding(1000, 64).cuda().requires_grad_(False)
            unet = nn.Sequential(nn.Conv2d(4, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 4, 3, padding=1)).cuda()
            ema = AveragedModel(unet)
            opt = torch.optim.AdamW(unet.parameters())
            for _ in range(10):
                with torch.no_grad():
                    latents = vae(torch.randn(16, 3, 256, 256, device="cuda"))
                    cond = text_encoder(torch.randint(0, 1000, (16,), device="cuda")).mean()
                noise = torch.randn_like(latents)
                loss = nn.functional.mse_loss(unet(latents + noise) + cond, noise)
                loss.backward()
                opt.step()
                opt.zero_grad()
                ema.update_parameters(unet)
        main()
    """)
    report = observe_script(script, steps=2, target="h200")

    def blocks(*numels):
        return sum(-(-4 * n // 512) * 512 for n in numels)

    unet = [4 * 64 * 9, 64, 64 * 4 * 9, 4]
    assert report.peak.bytes["parameters"] == blocks(*unet)
    assert report.other_models == {
        "vae": blocks(3 * 4 * 64, 4), "text_encoder": blocks(1000 * 64), "ema": blocks(*unet),
    }  # AveragedModel's n_averaged is made on its device argument, None here: on the host
    assert report.peak.bytes["other_models"] == sum(report.other_models.values())


def test_a_gan_is_tracked_as_both_models(tmp_path, caplog, clean):
    """Two models with an optimizer each (a GAN: the discriminator steps first):
    once the second optimizer steps, both models are tracked as one and a step
    ends at the generator's step; advice (a plan for one model) keeps the first."""
    script = write(tmp_path, """
        import torch
        from torch import nn
        G = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512))
        D = nn.Sequential(nn.Linear(512, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
        opt_d = torch.optim.Adam(D.parameters(), betas=(0.5, 0.999))
        opt_g = torch.optim.Adam(G.parameters(), betas=(0.5, 0.999))
        bce = nn.BCEWithLogitsLoss()
        for i in range(20):
            real, z = torch.randn(32, 512), torch.randn(32, 64)
            D.zero_grad()
            fake = G(z)
            loss_d = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
            loss_d.backward()
            opt_d.step()
            G.zero_grad()
            bce(D(fake), torch.ones(32, 1)).backward()
            opt_g.step()
    """)
    g, d = (64 * 256 + 256 + 256 * 512 + 512) * 4, (512 * 256 + 256 + 256 + 1) * 4
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(script, steps=2)
    assert "tracking Sequential and Sequential_1 with Adam, Adam from optimizer step 2" in caplog.text
    assert len(report.steps) == 2
    assert report.modules.loc[["ModuleDict.Sequential", "ModuleDict.Sequential_1"], "parameters"].tolist() == [d, g]
    assert report.peak.bytes["optimizer_state"] == 2 * (g + d) + 8 * 4 and report.peak.bytes["temporaries"] == 0
    kept = observe_script(script, steps=2, on_model=lambda model, opt: None)
    assert kept.modules.index[0] == "Sequential" and kept.peak.bytes["parameters"] == d


def test_two_optimizers_over_one_model_are_both_tracked(tmp_path, caplog, clean):
    """Muon's habit: one optimizer for the weight matrices, AdamW for the rest of the
    same model. Both step every iteration; both states are the model's."""
    script = write(tmp_path, """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        opts = [torch.optim.SGD(matrices, lr=0.02, momentum=0.95), torch.optim.AdamW(rest, lr=3e-4)]
        for i in range(20):
            model(torch.randn(64, 512)).square().mean().backward()
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
    """)
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(script, steps=2)
    assert "tracking Sequential with SGD, AdamW from optimizer step 2" in caplog.text
    assert report.modules.index[0] == "Sequential" and len(report.steps) == 2
    # SGD's momentum of the two 512x512 weights; AdamW's m and v of the two biases and a step each.
    assert report.optimizer_state == {"momentum_buffer": 2 * MiB, "exp_avg": 2 * 512 * 4, "exp_avg_sq": 2 * 512 * 4,
                                      "step": 2 * 4}


def test_a_wrapper_optimizer_and_its_base_are_one_step(tmp_path, caplog, clean):
    """timm's (pre-0.9) Lookahead: an Optimizer that wraps Adam without calling Optimizer.__init__,
    shares its param_groups and steps it inside its own step, keeping a slow copy of each
    parameter in its own state. Tracking started with Adam, then started again with both; the
    slow copies were temporaries. Now Adam's step nested in the wrapper's is not another
    optimizer's, and both states are the model's."""
    script = write(tmp_path, """
        from collections import OrderedDict, defaultdict
        import torch
        from torch import nn
        class Lookahead(torch.optim.Optimizer):
            def __init__(self, base_optimizer, alpha=0.5, k=2):
                self.base_optimizer = base_optimizer
                self.param_groups = base_optimizer.param_groups
                self.defaults = base_optimizer.defaults
                self.state = defaultdict(dict)
                self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
                self.alpha, self.k, self.steps = alpha, k, 0
            def step(self, closure=None):
                loss = self.base_optimizer.step(closure)
                self.steps += 1
                for p in (p for g in self.param_groups for p in g["params"]):
                    slow = self.state[p].setdefault("slow_buffer", p.detach().clone())
                    if self.steps % self.k == 0:
                        slow.add_(p.detach() - slow, alpha=self.alpha)
                        p.data.copy_(slow)
                return loss
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
        opt = Lookahead(torch.optim.Adam(model.parameters()))
        for i in range(20):
            model(torch.randn(64, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    """)
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(script, steps=2)
    # Lookahead's step is hooked from its first zero_grad: Adam's first step starts tracking.
    assert caplog.text.count("tracking Sequential") == 1 and "tracking Sequential with Adam from" in caplog.text
    assert len(report.steps) == 2
    # Adam's m and v and Lookahead's slow copy of the two 512x512 fp32 weights; Adam's step counts.
    assert report.optimizer_state == {"exp_avg": 2 * MiB, "exp_avg_sq": 2 * MiB, "slow_buffer": 2 * MiB, "step": 2 * 4}
    assert report.peak.bytes["temporaries"] < MiB


def test_a_wrapper_that_steps_its_base_by_other_methods_keeps_its_state(tmp_path, clean):
    """SAM (davda54/sam): first_step keeps each weight (``state[p]["old_p"]``) and perturbs it,
    second_step puts the weight back (``p.data = old_p``) and steps the base SGD; SAM's own
    step() is never called. The kept weights, alive through the second forward and backward,
    were temporaries, and after ``p.data = old_p`` every module row lost its parameters."""
    script = write(tmp_path, """
        import torch
        from torch import nn
        class SAM(torch.optim.Optimizer):
            def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
                super().__init__(params, dict(rho=rho, **kwargs))
                self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
                self.param_groups = self.base_optimizer.param_groups
            @torch.no_grad()
            def first_step(self, zero_grad=False):
                norm = torch.norm(torch.stack([p.grad.norm(p=2) for g in self.param_groups for p in g["params"]]), p=2)
                for group in self.param_groups:
                    scale = group["rho"] / (norm + 1e-12)
                    for p in group["params"]:
                        self.state[p]["old_p"] = p.data.clone()
                        p.add_(p.grad * scale.to(p))
                if zero_grad:
                    self.zero_grad()
            @torch.no_grad()
            def second_step(self, zero_grad=False):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.data = self.state[p]["old_p"]
                self.base_optimizer.step()
                if zero_grad:
                    self.zero_grad()
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
        optimizer = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        for i in range(20):
            x = torch.randn(64, 512)
            model(x).square().mean().backward()
            optimizer.first_step(zero_grad=True)
            model(x).square().mean().backward()
            optimizer.second_step(zero_grad=True)
    """)
    report = observe_script(script, steps=2)
    assert len(report.steps) == 2
    # SGD's momentum and SAM's kept weights, two 512x512 fp32 weights each; the weights in their modules.
    assert report.optimizer_state == {"momentum_buffer": 2 * MiB, "old_p": 2 * MiB}
    assert report.modules.loc[["Sequential.0", "Sequential.2"], "parameters"].tolist() == [MiB, MiB]


@pytest.mark.parametrize("thread", ["caller", "engine"])
def test_optimizers_stepped_in_backward_are_one_step(tmp_path, caplog, clean, monkeypatch, thread):
    """torchtune's optimizer in backward: an AdamW per parameter, stepped and zeroed by a
    post-accumulate-grad hook registered before memprof's, the loop calling backward() alone.
    Before, memprof's gradient watch failed on the gradient the hook had taken (TypeError), and
    each newly seen optimizer restarted tracking. Now the three are one step, tracked once.
    The hooks run on the thread that called backward (the CPU's, a simulated GPU's: acted on at
    the return of its backward frame) or, on a GPU, on the engine's device thread, whose stack
    has no backward frame (acted on at the end of the engine's graph task: here as if so)."""
    if thread == "engine":
        import memprof.runner

        monkeypatch.setattr(memprof.runner, "_BACKWARD_FILES", set())
    script = write(tmp_path, """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False),
                              nn.ReLU(), nn.Linear(512, 512, bias=False))
        optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}
        def step_in_backward(p):
            optimizers[p].step()
            optimizers[p].zero_grad()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)
        for i in range(20):
            nn.functional.mse_loss(model(torch.randn(64, 512)), torch.randn(64, 512)).backward()
    """)
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(script, steps=3)
    assert caplog.text.count("tracking Sequential") == 1
    assert "tracking Sequential with AdamW, AdamW, AdamW from optimizer step 2" in caplog.text
    assert len(report.steps) == 3
    # Every optimizer's m and v: three 512x512 fp32 weights; and a step count each.
    assert report.optimizer_state == {"exp_avg": 3 * MiB, "exp_avg_sq": 3 * MiB, "step": 3 * 4}


def test_an_lbfgs_closure_is_not_a_loop_without_an_optimizer(tmp_path, caplog, clean):
    """A PINN trained by L-BFGS alone: each step calls the closure (forward, zero_grad, backward)
    up to max_eval times before the step's first post-hook. Those forwards were taken for a loop
    that updates its parameters by hand ("tracking ... without an optimizer"); and L-BFGS's
    curvature history, lists of tensors in its state, was counted as temporaries."""
    script = write(tmp_path, """
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Tanh(), nn.Linear(512, 1, bias=False))
        opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=10)
        x, y = torch.randn(256, 512), torch.randn(256, 1)
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        for step in range(10):
            opt.step(closure)
    """)
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(script, steps=2)
    assert "tracking Sequential with LBFGS from optimizer step 2" in caplog.text
    state = report.optimizer_state
    # the flat gradient and direction (513 x 512 + 512 = 262,656 floats each) and, after 2 + 2 steps
    # of up to 4 iterations each, the curvature pairs kept: each as large again
    flat = (512 * 512 + 512) * 4
    assert state["d"] == flat and state["prev_flat_grad"] == flat
    assert state["old_dirs"] == state["old_stps"] and state["old_dirs"] % flat == 0 and state["old_dirs"] >= 4 * flat


@pytest.mark.parametrize("target", [None, "h200"])
def test_an_ensemble_trained_functionally_is_tracked(tmp_path, target, clean):
    """PyTorch's model-ensembling recipe, trained: stack_module_state's stacked copies stepped by
    Adam, the model run by vmap over functional_call of a meta copy. No module holds what the
    optimizer steps: the copy on 'meta' is tracked with the stacked tensors as its parameters, on
    the host and on the simulated GPU (where .to("meta") of the GPU's copy must free it, and
    vmap's batched tensors be seen through to their storage)."""
    script = write(tmp_path, f"""
        import copy
        import torch
        from torch import nn
        from torch.func import functional_call, stack_module_state, vmap
        device = "{'cuda' if target else 'cpu'}"
        models = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(device) for _ in range(4)]
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        assert not base[0].weight.is_cuda
        opt = torch.optim.Adam(params.values(), lr=1e-3)
        def one(p, b, x):
            return functional_call(base, (p, b), (x,))
        for i in range(5):
            out = vmap(one, in_dims=(0, 0, None))(params, buffers, torch.randn(32, 64, device=device))
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
    """)
    report = observe_script(script, steps=2, target=target)
    numels = [4 * 64 * 64, 4 * 64, 4 * 64 * 8, 4 * 8]
    # On the GPU each tensor in its own 512-byte-rounded block.
    expected = sum(-(-4 * n // 512) * 512 for n in numels) if target else 4 * sum(numels)
    assert report.peak.bytes["parameters"] == expected
    assert report.optimizer_state["exp_avg"] == report.optimizer_state["exp_avg_sq"] == expected


def test_a_compiled_model_and_optimizer_step(tmp_path, caplog, clean):
    """torch.compile on the model and on a function that steps the optimizer: memprof's
    hooks stay out of the compiled code (Dynamo traced them: a crash, or steps unseen),
    and the step hook starts tracking once PyTorch's own step wrapper returns."""
    script = write(tmp_path, """
        import torch
        from torch import nn
        model = torch.compile(nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(),
                                            nn.Linear(512, 512, bias=False)), backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters())

        @torch.compile(backend="aot_eager")
        def opt_step():
            opt.step()

        for i in range(10):
            model(torch.randn(64, 512)).square().mean().backward()
            opt_step()
            opt.zero_grad(set_to_none=True)
    """)
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(script, steps=3)
    assert "tracking Sequential with AdamW" in caplog.text  # the model it compiles, not OptimizedModule
    assert len(report.steps) == 3 and report.modules.index[0] == "Sequential"
    assert report.peak.bytes["parameters"] == 2 * MiB
    assert report.optimizer_state == {"exp_avg": 2 * MiB, "exp_avg_sq": 2 * MiB, "step": 2 * 4}


HABITS = {
    # Megatron's backward step: torch.autograd.backward, not loss.backward(), through reentrant
    # checkpoints whose recomputation makes tensors on torch.cuda.current_device(); and
    # torch.autograd.grad for a gradient penalty.
    "autograd_backward": ("""
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(256, 256)
            def forward(self, x):
                return torch.relu(self.lin(x) + torch.zeros(x.shape, device=torch.cuda.current_device()))
        model = nn.Sequential(*[Block() for _ in range(4)]).cuda()
        opt = torch.optim.Adam(model.parameters())
        for i in range(10):
            x = torch.randn(64, 256, device="cuda", requires_grad=True)
            y = model[0](x)
            penalty, = torch.autograd.grad(y.sum(), x, create_graph=True)
            for block in model[1:]:
                y = checkpoint(block, y, use_reentrant=True)
            torch.autograd.backward([y.mean() + penalty.square().mean()])
            opt.step(); opt.zero_grad()
    """, [256 * 256, 256] * 4),
    # pytorch/examples' ImageNet: torch.multiprocessing.spawn(main_worker, nprocs=ngpus), a DDP rank each:
    # spawned processes start Python afresh, without the simulated GPU ("NCCL not built in").
    "spawn": ("""
        import os
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from torch import nn
        def main_worker(gpu, ngpus):
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("nccl", world_size=ngpus, rank=gpu)
            torch.cuda.set_device(gpu)
            model = nn.parallel.DistributedDataParallel(nn.Linear(64, 32).cuda(gpu), device_ids=[gpu])
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(10):
                model(torch.randn(8, 64).cuda(gpu)).sum().backward()
                opt.step(); opt.zero_grad()
            dist.destroy_process_group()
        if __name__ == "__main__":
            mp.spawn(main_worker, nprocs=torch.cuda.device_count(), args=(torch.cuda.device_count(),))
    """, [64 * 32, 32]),
    # nerf-pytorch: CUDA's default tensor type (deprecated since torch 2.1), torch.Tensor(data) made
    # there, cumprod (whose backward takes max(dim) of values not followed), and one Adam over the
    # coarse and the fine network, called apart: both are the model.
    "default_tensor_type": ("""
        import torch
        from torch import nn
        torch.set_default_tensor_type('torch.cuda.FloatTensor')
        coarse, fine = nn.Linear(64, 4), nn.Linear(64, 4)
        opt = torch.optim.Adam(list(coarse.parameters()) + list(fine.parameters()))
        for i in range(10):
            x = torch.randn(4096, 64)
            far = torch.Tensor([1e10]).expand(4096, 1)
            weights = torch.cat([torch.cumprod(torch.sigmoid(coarse(x)), -1), far], -1)
            loss = weights.mean() + fine(x).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
    """, [64 * 4, 4, 64 * 4, 4]),
    # nn.Embedding(sparse=True) with SparseAdam beside Adam: sparse gradients have no storage of their own.
    "sparse_embedding": ("""
        import torch
        from torch import nn
        emb, head = nn.Embedding(1024, 256, sparse=True).cuda(), nn.Linear(256, 1).cuda()
        sparse, dense = torch.optim.SparseAdam(list(emb.parameters())), torch.optim.Adam(head.parameters())
        for i in range(10):
            head(emb(torch.randint(0, 1024, (64, 8), device="cuda")).mean(1)).square().mean().backward()
            sparse.step(); dense.step(); sparse.zero_grad(); dense.zero_grad()
    """, [1024 * 256, 256, 1]),
    # A VAE: torch.distributions checks its arguments' values; an EMA (AveragedModel) beside it.
    "distributions_and_ema": ("""
        import torch
        from torch import nn
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
        from torch.nn.utils.parametrizations import weight_norm
        class VAE(nn.Module):
            def __init__(s):
                super().__init__(); s.enc = weight_norm(nn.Linear(256, 64)); s.dec = nn.Linear(32, 256)
            def forward(s, x):
                mu, logvar = s.enc(x).chunk(2, -1)
                q = torch.distributions.Normal(mu, torch.exp(0.5 * logvar))
                z = q.rsample()
                kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(torch.zeros_like(z), 1.0))
                return s.dec(z), kl.sum(-1)
        model = VAE().cuda()
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        opt = torch.optim.Adam(model.parameters())
        for i in range(10):
            x = torch.rand(2048, 256, device="cuda")  # 2 MiB: values the simulation does not follow
            recon, kl = model(x)
            ((recon - x).square().sum(-1) + kl).mean().backward()
            opt.step(); opt.zero_grad(); ema.update_parameters(model)
    """, [64, 256 * 64, 64, 32 * 256, 256]),
    # CTC: the target lengths are tensors whose values the simulation does not know.
    "ctc_loss": ("""
        import torch
        from torch import nn
        import torch.nn.functional as F
        model = nn.Linear(80, 32).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for i in range(10):
            lp = model(torch.randn(200, 16, 80, device="cuda")).log_softmax(-1)
            targets = torch.randint(1, 32, (16, 60), device="cuda")
            loss = F.ctc_loss(lp, targets, torch.full((16,), 200, device="cuda"), torch.randint(30, 60, (16,), device="cuda"))
            loss.backward(); opt.step(); opt.zero_grad()
    """, [80 * 32, 32]),
    # A whole training step captured in a CUDA graph and replayed (the PyTorch docs' "whole network
    # capture"): a CPU build has only a dummy torch.cuda.CUDAGraph ("Tried to instantiate dummy
    # base class CUDAGraph"), a CUDA build without a GPU a driver to miss.
    "cuda_graph": ("""
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters(), capturable=True)
        x, y = torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
        def step():
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward(); opt.step()
            return loss
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_loss = step()
        for i in range(10):
            x.copy_(torch.randn(64, 256, device="cuda")); g.replay()
    """, [256 * 512, 512, 512 * 10, 10]),
    # A model trained through a method of its own, never called itself (a recommender's
    # score(u, i), CLIP's encode_image): its MLP was taken for the model, the rest temporaries.
    "trained_through_a_method": ("""
        import torch
        from torch import nn
        class TwoTower(nn.Module):
            def __init__(s):
                super().__init__()
                s.user, s.item = nn.Embedding(1000, 64), nn.Embedding(1000, 64)
                s.mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
            def score(s, u, i):
                return (s.mlp(s.user(u)) * s.item(i)).sum(-1)
        model = TwoTower().cuda()
        opt = torch.optim.Adam(model.parameters())
        for step in range(10):
            u, i = torch.randint(0, 1000, (256,), device="cuda"), torch.randint(0, 1000, (256,), device="cuda")
            loss = nn.functional.softplus(-model.score(u, i)).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    """, [1000 * 64, 1000 * 64, 64 * 64, 64, 64 * 64, 64]),
    # A checkpoint saved and loaded back onto the GPU mid-run (a resume test): torch.save writes
    # nothing, so the load found no file, or an old one it could not map to "cuda".
    "checkpoint_round_trip": ("""
        import torch
        from torch import nn
        model = nn.Linear(512, 512).cuda()
        opt = torch.optim.Adam(model.parameters())
        for step in range(10):
            model(torch.randn(32, 512, device="cuda")).square().mean().backward()
            opt.step(); opt.zero_grad()
            if step == 1:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, "checkpoint.pt")
                state = torch.load("checkpoint.pt", map_location="cuda")
                model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
    """, [512 * 512, 512]),
    # DP-SGD's per-sample gradients: the model runs only inside torch.func's vmap(grad(...)),
    # whose wrapped tensors have no storage ("Cannot access storage of TensorWrapper").
    "per_sample_gradients": ("""
        import torch
        from torch import nn
        from torch.func import functional_call, grad, vmap
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def loss_fn(p, x, y):
            return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])
        for i in range(10):
            x, y = torch.randn(64, 128, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
            g = vmap(grad(loss_fn), in_dims=(None, 0, 0))({k: v.detach() for k, v in model.named_parameters()}, x, y)
            for k, p in model.named_parameters():
                p.grad = g[k].mean(0) + 0.01 * torch.randn_like(p)
            opt.step(); opt.zero_grad()
    """, [128 * 256, 256, 256 * 10, 10]),
}


def test_a_sparse_gradient_and_sparse_adam_on_the_simulated_gpu(tmp_path, clean):
    """Autograd keeps a copy of an embedding's sparse gradient, which PyTorch's meta kernel made
    without entries (and SparseAdam then skipped the table): 64 x 8 lookups of 256 fp32 values."""
    report = observe_script(write(tmp_path, """
        import torch
        emb = torch.nn.Embedding(1024, 256, sparse=True).cuda()
        opt = torch.optim.SparseAdam(list(emb.parameters()))
        for i in range(10):
            emb(torch.randint(0, 1024, (64, 8), device="cuda")).square().mean().backward()
            opt.step(); opt.zero_grad()
    """), steps=3, target="h200")
    assert report.timeline["gradients"].max() == 64 * 8 * 256 * 4
    assert report.optimizer_state == {"exp_avg": MiB, "exp_avg_sq": MiB}  # 1024 x 256 fp32 each



def test_sparse_gradients_summed_keep_every_lookup(tmp_path, clean):
    """A knowledge graph's entity table is looked up for heads and tails: autograd sums the two
    sparse gradients, and CUDA concatenates their rows (add_out_sparse_cuda), 64 + 64 of 256 fp32
    values; a second backward before the step adds 128 more in place. PyTorch's meta kernels
    gave the sum no rows: no gradient, and SparseAdam's step skipped the table."""
    report = observe_script(write(tmp_path, """
        import torch
        emb = torch.nn.Embedding(1024, 256, sparse=True).cuda()
        opt = torch.optim.SparseAdam(list(emb.parameters()))
        for i in range(10):
            for _ in range(2):
                h, t = torch.randint(0, 1024, (2, 64), device="cuda")
                (emb(h) * emb(t)).sum().backward()
            opt.step(); opt.zero_grad()
    """), steps=3, target="h200")
    assert report.timeline["gradients"].max() == 4 * 64 * 256 * 4
    assert report.optimizer_state == {"exp_avg": MiB, "exp_avg_sq": MiB}

@pytest.mark.parametrize("habit", list(HABITS))
def test_habits_that_stopped_the_simulated_gpu(tmp_path, habit, clean):
    """Each stopped the simulation before: "Cannot access storage of SparseTensorImpl",
    "Expected parameter loc ... to satisfy the constraint Real()" (a check of values the
    simulation does not follow fails), "aten._ctc_loss makes an output whose shape depends
    on the values of its input", "Cannot access storage of TensorWrapper", "Tried to instantiate
    dummy base class CUDAGraph"."""
    source, sizes = HABITS[habit]
    report = observe_script(write(tmp_path, source), steps=3, target="h200")
    # fp32 parameters, each in its own 512-byte-rounded block of the simulated caching allocator
    assert len(report.steps) == 3 and report.peak.bytes["parameters"] == sum(-(-4 * n // 512) * 512 for n in sizes)


ERRORS = {
    "raises": ("import torch\nraise ValueError('no data at /data')\n",
               ["ValueError: no data at /data", "line 2", "could not observe a training step"]),
    "no_optimizer": ("import torch\nprint(torch.nn.Linear(2, 2)(torch.ones(2)))\n",
                     ["without a training step", "optimizer.step()", "zero their gradients"]),
    "bad_arguments": ("import argparse\nargparse.ArgumentParser().parse_args()\n",
                      ["exited with status 2", "after --"]),
    "one_step_only": ("import torch\nm = torch.nn.Linear(2, 2)\no = torch.optim.SGD(m.parameters(), 0.1)\n"
                      "m(torch.ones(2)).sum().backward()\no.step()\n",
                      ["ended before a tracked step finished", "1 + 3 training steps"]),
    "no_module": ("import torch\nw = torch.nn.Parameter(torch.ones(2))\no = torch.optim.SGD([w], 0.1)\n"
                  "while True:\n    (w * 2).sum().backward()\n    o.step()\n",
                  ["SGD.step() ran, but no module", "model(x)"]),
    "raises_after_tracking": (
        "import torch\nm = torch.nn.Linear(2, 2)\no = torch.optim.SGD(m.parameters(), 0.1)\n"
        "for i in range(10):\n    m(torch.ones(2)).sum().backward()\n    o.step()\n"
        "    if i == 2:\n        raise RuntimeError('CUDA out of memory')\n",
        ["RuntimeError: CUDA out of memory", "after 2 of 3 tracked steps"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_script_errors_name_the_cause(tmp_path, case, clean):
    source, expected = ERRORS[case]
    with pytest.raises(ScriptError) as info:
        observe_script(write(tmp_path, source), ["--bogus"] if case == "bad_arguments" else [], steps=3)
    for text in expected:
        assert text in str(info.value)
    if case == "raises_after_tracking":  # what was measured before the failure comes with it
        assert len(info.value.report.steps) == 2


def test_missing_directory_and_syntax_error(tmp_path, clean):
    with pytest.raises(ScriptError, match="'nope.py' does not exist"):
        observe_script("nope.py")
    with pytest.raises(ScriptError, match="is a directory"):
        observe_script(tmp_path)
    with pytest.raises(ScriptError, match=r"train.py:3: syntax error"):
        observe_script(write(tmp_path, "import torch\n\ndef f(:\n"))


def test_ctrl_c(tmp_path, clean):
    before = write(tmp_path, "raise KeyboardInterrupt\n", "before.py")
    with pytest.raises(KeyboardInterrupt):
        observe_script(before)
    after = write(tmp_path, """
        import torch
        m = torch.nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), 0.1)
        for i in range(10):
            m(torch.ones(4)).sum().backward()
            o.step()
            if i == 2:
                raise KeyboardInterrupt
    """, "after.py")
    report = observe_script(after, steps=5)  # interrupted after 2 tracked steps: those are reported
    assert len(report.steps) == 2


def test_timeout(tmp_path, clean):
    script = write(tmp_path, "import torch\nm = torch.nn.Linear(2, 2)\nwhile True:\n    m(torch.ones(2))\n")
    with pytest.raises(ScriptError, match="no training step finished within the timeout"):
        observe_script(script, timeout=0.3)


def test_timeout_stops_a_script_blocked_outside_any_hook(tmp_path, clean):
    """A prefetcher whose thread failed without passing its error on: the training loop waits on its
    queue for ever, where no hook of memprof's runs to see the deadline. It hung past any --timeout;
    the steps tracked before are reported, and the script's own SIGALRM handling is left as it was."""
    import signal

    script = write(tmp_path, """
        import queue, torch
        m = torch.nn.Linear(512, 512)
        o = torch.optim.SGD(m.parameters(), 0.1)
        for step in range(8):
            m(torch.ones(8, 512)).sum().backward()
            o.step(); o.zero_grad()
        queue.Queue().get()  # the batch that never comes
    """)
    before = signal.getsignal(signal.SIGALRM)
    report = observe_script(script, steps=20, warmup=1, timeout=3.0)
    assert report.meta["observed_steps"] == 7  # 8 steps, the first a warm-up
    assert signal.getsignal(signal.SIGALRM) == before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_script_already_tracking(tmp_path, clean):
    script = write(tmp_path, """
        import torch, memprof
        m = torch.nn.Linear(4, 4)
        o = torch.optim.SGD(m.parameters(), 0.1)
        with memprof.track(m, o):
            for _ in range(10):
                m(torch.ones(4)).sum().backward()
                o.step()
    """)
    with pytest.raises(ScriptError, match="could not start tracking Linear: memprof.track is already active"):
        observe_script(script)


def test_a_distributed_script_stopped_early_can_run_again(tmp_path, clean):
    """A script written for torchrun stops before its own destroy_process_group(): the
    process group it made ends with the run, so the next run (another plan) can make it again."""
    import torch.distributed as dist

    script = write(tmp_path, """
        import os, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("nccl", rank=0, world_size=1)
        model = DDP(torch.nn.Linear(512, 512, bias=False).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(10):
            model(torch.randn(8, 512, device="cuda")).sum().backward()
            opt.step(); opt.zero_grad()
        dist.destroy_process_group()
    """)
    env = dict(os.environ)
    for _ in range(2):
        report = observe_script(script, steps=2, target="h200")
        assert dict(os.environ) == env  # the script's MASTER_ADDR and MASTER_PORT went with it
        assert report.meta["simulation_notes"]["torch.distributed"].startswith("torch.distributed ran one rank of 1")
        assert report.steps["step"].tolist() == [0, 1] and not dist.is_initialized()
        # DDP's reducer keeps a bucket for the 1 MiB weight's gradient beside it (gradient_as_bucket_view
        # off), counted with the temporaries, as are the batch (8 x 512 fp32) and the loss, a 512-byte
        # scalar; the loss's gradient, another, is an activation gradient (the loss's nodes are hooked).
        peak = report.peak.bytes
        assert peak["parameters"] == peak["gradients"] == MiB
        assert peak["temporaries"] == MiB + 8 * 512 * 4 + 512 and peak["activation_gradients"] == 512


@pytest.mark.parametrize("kw", [{"steps": 0}, {"warmup": 0}, {"steps": 1.5}, {"timeout": 0}])
def test_bad_arguments(mlp_script, kw, clean):
    with pytest.raises(ValueError, match=next(iter(kw))):
        observe_script(mlp_script, **kw)


@pytest.mark.parametrize("setting,reserved", [
    ("", 102760448),
    ('os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"', 106954752),
    ('os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"', 106954752),
    ('import torch; torch.cuda.memory._set_allocator_settings("expandable_segments:True")', 106954752),
    pytest.param('import torch; torch._C._accelerator_setAllocatorSettings("expandable_segments:True")', 106954752,
                 marks=pytest.mark.skipif(not hasattr(torch._C, "_accelerator_setAllocatorSettings"),
                                          reason="torch has no _accelerator_setAllocatorSettings")),
])
def test_expandable_segments_asked_for_by_the_script_are_simulated(tmp_path, clean, setting, reserved):
    """A script that asks for expandable segments (often in its own first lines) gets them: its
    16 MiB weight and gradient take 20 MiB pages of one segment (40 MiB) where the default
    allocator makes a 16 MiB segment for each. The same script measured on an H200 (torch 2.11):
    benchmarks/results/expandable-segments-h200.json."""
    source = f"""
        import os
        {setting}
        import torch
        model = torch.nn.Linear(2048, 2048, bias=False).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(10):
            model(torch.randn(64, 2048, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
    """
    report = observe_script(write(tmp_path, source), steps=2, target="h200")
    assert report.steps["peak_reserved"].tolist() == [reserved, reserved]
    assert "expandable segments" not in report.meta.get("simulation_notes", {})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # the script's setting is not the next run's


def test_allocator_settings_that_are_not_modelled_are_noted(tmp_path, clean):
    source = """
        import os
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,garbage_collection_threshold:0.8")
        import torch
        model = torch.nn.Linear(256, 256).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(10):
            model(torch.randn(64, 256, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
    """
    report = observe_script(write(tmp_path, source), steps=2, target="h200")
    assert report.meta["simulation_notes"]["allocator settings"] == (
        "garbage_collection_threshold:0.8 (PYTORCH_CUDA_ALLOC_CONF) not modelled: reserved memory as PyTorch's "
        "allocator reserves it without them")


def test_max_split_size_asked_for_by_the_script_is_simulated(tmp_path, clean):
    """max_split_size_mb:128: a freed 200 MiB tensor is not split for the step's smaller tensors, so the next
    step's 200 MiB one finds it whole; without it they are split off it, and the next 200 MiB tensor takes a
    segment of its own (the fragmentation the setting is for)."""
    source = """
        import os
        {setting}
        import torch
        model = torch.nn.Linear(1024, 1024, bias=False).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(10):
            big = torch.randn(50 * 1024 * 1024, device="cuda"); del big
            model(torch.randn(2048, 1024, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
    """
    reserved = {}
    for name, setting in (("default", ""), ("split", 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:128"')):
        report = observe_script(write(tmp_path, source.replace("{setting}", setting)), steps=2, target="h200")
        assert "allocator settings" not in report.meta.get("simulation_notes", {})
        reserved[name] = report.steps["peak_reserved"].iloc[-1]
    assert reserved["split"] < reserved["default"]


# pytorch/examples' word language model and the "what is torch.nn really" tutorial train
# without a torch.optim optimizer: the update is the script's own.
MANUAL = {
    "data.add_": """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False)).cuda()
        criterion = nn.MSELoss()
        x, y = torch.randn(64, 512).cuda(), torch.randn(64, 512).cuda()
        for i in range(20):
            model.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            print(f"step {i}")
    """,
    "no_grad": """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False)).cuda()
        x, y = torch.randn(64, 512).cuda(), torch.randn(64, 512).cuda()
        for i in range(20):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= p.grad * 0.1
                model.zero_grad()
            print(f"step {i}")
    """,
}


@pytest.mark.parametrize("update", list(MANUAL))
def test_a_loop_without_an_optimizer(tmp_path, update, capsys, caplog, clean):
    """Its steps are seen where the model's next forward begins after a backward and the
    gradients' reset: two found the model, three are tracked, and the script stops in the
    forward of the sixth."""
    with caplog.at_level(logging.INFO, logger="memprof"):
        report = observe_script(write(tmp_path, MANUAL[update]), steps=3, target="h200")
    assert printed_steps(capsys.readouterr().out) == [0, 1, 2, 3, 4]
    assert "tracking Sequential without an optimizer" in caplog.text
    assert report.steps["step"].tolist() == [0, 1, 2]
    peak = report.peak.bytes
    assert peak["parameters"] == 2 * MiB and peak["optimizer_state"] == 0
    assert report.optimizer_state == {}
    # the peak is in backward, where the second weight's gradient is made: 1 MiB
    assert report.modules.loc["Sequential.2", "gradients"] == MiB
    assert report.modules.loc["Sequential.0", "activations_saved_over_step"] == 64 * 512 * 4


def test_an_einsum_of_three_tensors_says_its_order_depends_on_opt_einsum(tmp_path, clean):
    """mamba-minimal's einsum('bld,bln,bld->bldn', delta, B, u): without opt_einsum PyTorch contracts
    left to right and keeps a (b, l, d, n) product for backward; with it, a (b, l, d) one."""
    report = observe_script(write(tmp_path, """
        import torch
        lin = torch.nn.Linear(64, 64).cuda()
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        for i in range(6):
            d, u = lin(torch.randn(8, 16, 64, device="cuda")), torch.randn(8, 16, 64, device="cuda")
            torch.einsum("bld,bln,bld->bldn", d, torch.randn(8, 16, 4, device="cuda"), u).sum().backward()
            opt.step(); opt.zero_grad()
    """), steps=2, target="h200")
    noted = "einsum order" in report.meta.get("simulation_notes", {})
    assert noted == (not torch.backends.opt_einsum.is_available())


def test_an_optimizer_over_a_master_copy_that_no_module_holds(tmp_path, clean):
    """fairseq's FP16Optimizer: the model in fp16, Adam over one flat fp32 master copy of its
    parameters, the model called inside the criterion. The model is the module with as many
    numbers to train; the master copy and its gradient are parameters and gradients."""
    report = observe_script(write(tmp_path, """
        import torch
        from torch import nn
        class Criterion(nn.Module):
            def forward(self, model, x):
                return model(x).float().square().mean()
        model = nn.Linear(512, 512, bias=False).cuda().half()
        criterion = Criterion()
        master = nn.Parameter(torch.cat([p.data.float().view(-1) for p in model.parameters()]))
        master.grad = master.data.new_zeros(master.numel())
        optimizer = torch.optim.Adam([master])
        for i in range(10):
            criterion(model, torch.randn(64, 512, device="cuda").half()).backward()
            master.grad.copy_(torch.cat([p.grad.float().view(-1) for p in model.parameters()]))
            optimizer.step()
            for p in model.parameters():
                p.data.copy_(master.data.view_as(p))
                p.grad = None
    """), steps=3, target="h200")
    assert report.peak.bytes["parameters"] == 512 * 512 * 2 + 512 * 512 * 4  # fp16 weight, fp32 master
    assert report.optimizer_state == {"exp_avg": MiB, "exp_avg_sq": MiB}  # (its step count is on the host)
    start = report.timeline.groupby("step").first()
    assert (start["gradients"] == MiB).all()  # the master's gradient, kept across steps


def test_a_model_run_on_the_host_before_it_moves(tmp_path, clean):
    """YOLOv5 runs its model once on the host to size its strides, then moves it: memprof's
    gradient hooks from that first call, and the tracker's after the move, must see the gradients
    (torch.utils.swap_tensors, which moves parameters onto the simulated GPU, left them unheard)."""
    report = observe_script(write(tmp_path, """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
        model(torch.zeros(1, 512))  # sizing on the host
        model = model.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i in range(10):
            model(torch.randn(64, 512, device="cuda")).square().mean().backward()
            opt.step(); opt.zero_grad()
    """), steps=3, target="h200", oom=False)  # as the advisor runs it: no early tracking, parameters swapped
    after = report.timeline[report.timeline["phase"] == "after backward"]
    assert (after["gradients"] == 2 * MiB).all() and (after["activation_gradients"] == 0).all()


def test_a_model_built_on_meta_is_not_the_simulated_gpus(tmp_path, clean):
    """A script's own meta tensors take no GPU memory, as on a GPU: a 16 GiB model built on meta
    (an RTX 3060 has 12 GB) is not counted, reports device meta, and ``.to("cuda")`` of it raises
    PyTorch's own error; ``to_empty`` makes the simulated GPU's (the memory then counted, exactly),
    as does ``empty_like(t, device="cuda")`` of a meta tensor, and a cast on meta stays on meta."""
    report = observe_script(write(tmp_path, """
        import torch
        from torch import nn
        with torch.device("meta"):
            big = nn.Sequential(*[nn.Linear(8192, 8192, bias=False) for _ in range(64)])  # 16 GiB of fp32
        w = big[0].weight
        assert w.device == torch.device("meta") and not w.is_cuda and w.get_device() == -1, w.device
        assert torch.get_default_device().type == "cpu"
        assert big.to(torch.bfloat16)[0].weight.device.type == "meta"
        assert torch.empty_like(w, device="cuda").device.type == "cuda"
        # Module.to(device=..., dtype=...) parses its arguments in a torch function of its own
        assert nn.Linear(4, 4).to(device="cuda", dtype=torch.bfloat16).weight.device.type == "cuda"
        assert torch.empty(4, device="meta").to(torch.float16).device.type == "meta"
        try:
            big.to("cuda")
        except NotImplementedError as exc:
            assert "to_empty" in str(exc), exc
        else:
            raise AssertionError("moving a meta model with .to() must raise, as on a GPU")
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))
            assert torch.get_default_device().type == "meta"
        model.to_empty(device="cuda")
        assert model[0].weight.device.type == "cuda" and model[0].weight.is_cuda
        torch.set_default_device("cuda")  # the simulated GPU's tensors by default, the script's own meta in a block
        assert torch.empty(4).device.type == "cuda" and torch.get_default_device().type == "cuda"
        with torch.device("meta"):
            assert torch.empty(4).device.type == "meta" and torch.get_default_device().type == "meta"
        torch.set_default_device("cpu")
        for m in (model[0], model[2]):
            nn.init.normal_(m.weight, std=0.02)
        opt = torch.optim.AdamW(model.parameters())
        for i in range(10):
            model(torch.randn(64, 512, device="cuda")).square().mean().backward()
            opt.step(); opt.zero_grad()
    """), steps=2, target="rtx3060")
    assert report.peak.bytes["parameters"] == 2 * MiB and report.peak.bytes["other_models"] == 0
    assert report.optimizer_state == {"exp_avg": 2 * MiB, "exp_avg_sq": 2 * MiB}


def test_fsdp2_meta_device_initialisation(tmp_path, clean, monkeypatch):
    """torchtitan's recipe: the whole model on meta, ``fully_shard`` there, ``to_empty`` onto the
    GPU, then ``nn.init`` of the sharded parameters (DTensor's random operators). A 16 GiB fp32
    model on 8 ranks holds 2 GiB of parameters per rank (rows split 8 ways), as much gradient
    and twice that of Adam's state; before, the meta build ran the simulated 12 GB GPU out of
    memory, and DTensor's generator state failed to reach the device."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    report = observe_script(write(tmp_path, """
        import os, torch, torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(8192, 8192, bias=False) for _ in range(64)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cuda")
        for m in model:
            nn.init.normal_(m.weight, std=0.02)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(4):
            model(torch.randn(8, 8192, device="cuda")).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
        dist.destroy_process_group()
    """), steps=2, target="rtx3060")
    shard = 64 * 8192 * 8192 * 4 // 8
    assert report.peak.bytes["parameters"] == shard == 2 * 1024 * MiB
    assert report.peak.bytes["gradients"] == shard
    assert report.optimizer_state == {"exp_avg": shard, "exp_avg_sq": shard}


def test_files_a_simulated_save_did_not_write_are_copied_and_moved_in_the_simulation(tmp_path, clean):
    """pytorch/examples' ImageNet copies its checkpoint to ``model_best.pth.tar`` after ``torch.save``,
    which writes nothing here: the copy failed (no such file), or copied a stale checkpoint of that
    name over the user's best one. Copies, moves and removals of what this run saved stay in the
    simulation; the files on disk are left as they were, and what was saved loads from its new name.
    Loading a host state dict into the simulated GPU's model warns nothing, as on a GPU."""
    (tmp_path / "checkpoint.pth.tar").write_bytes(b"stale")
    (tmp_path / "model_best.pth.tar").write_bytes(b"the user's best")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = observe_script(write(tmp_path, """
            import os, shutil
            import torch
            from torch import nn
            model = nn.Linear(512, 512).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model.load_state_dict(nn.Linear(512, 512).state_dict())  # a host state dict onto the GPU's model
            for step in range(10):
                model(torch.randn(32, 512, device="cuda")).square().mean().backward()
                opt.step(); opt.zero_grad()
                if step == 1:
                    torch.save({"state_dict": model.state_dict(), "optimizer": opt.state_dict()}, "checkpoint.pth.tar")
                    shutil.copyfile("checkpoint.pth.tar", "model_best.pth.tar")
                    torch.save(model.state_dict(), "tmp.pt")
                    os.replace("tmp.pt", "last.pt")
                    os.makedirs("archive", exist_ok=True)
                    shutil.copy("last.pt", "archive")
                    os.remove("checkpoint.pth.tar")
                    best = torch.load("model_best.pth.tar", map_location="cuda")
                    assert best["state_dict"]["weight"].shape == (512, 512) and best["state_dict"]["weight"].is_cuda
                    assert torch.load(os.path.join("archive", "last.pt"))["bias"].shape == (512,)
        """), steps=3, target="h200")
    assert not [w for w in caught if "non-meta" in str(w.message)]
    assert report.peak.bytes["parameters"] == 512 * 512 * 4 + 512 * 4
    # The loaded checkpoint, kept in a variable, is another copy of the model on the GPU (not temporaries).
    assert report.other_models == {"best['state_dict']": 512 * 512 * 4 + 512 * 4}
    assert (tmp_path / "checkpoint.pth.tar").read_bytes() == b"stale"
    assert (tmp_path / "model_best.pth.tar").read_bytes() == b"the user's best"
    assert not (tmp_path / "last.pt").exists() and not (tmp_path / "tmp.pt").exists()
    assert not (tmp_path / "archive" / "last.pt").exists()


def test_safetensors_writes_nothing_and_loads_what_was_saved(tmp_path, clean):
    """Accelerate's ``save_state`` and ``save_pretrained`` save through safetensors, imported under another
    name (``from safetensors.torch import save_file as safe_save_file``): it wrote the simulated tensors'
    placeholder values (ones) over the user's file, or read past a large one's host copy ("Bad address").
    It writes nothing, as torch.save; what was saved loads back onto the simulated GPU or the host; a
    file of the disk loads as it is."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.full((2, 2), 7.0)}, str(tmp_path / "model.safetensors"))
    save_file({"w": torch.full((3,), 5.0)}, str(tmp_path / "other.safetensors"))
    before = (tmp_path / "model.safetensors").read_bytes()
    observe_script(write(tmp_path, f"""
        import os, torch
        from torch import nn
        from safetensors.torch import load_file, load_model, save_file as safe_save_file, save_model
        os.chdir({str(tmp_path)!r})
        model = nn.Linear(1024, 4096).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            model(torch.randn(32, 1024, device="cuda")).square().mean().backward()
            opt.step(); opt.zero_grad()
            if step == 1:
                safe_save_file(model.state_dict(), "model.safetensors")
                save_model(model, "model.safetensors")
                back = load_file("model.safetensors", device="cuda")
                assert back["weight"].shape == (4096, 1024) and back["weight"].is_cuda
                assert load_file("model.safetensors")["bias"].device.type == "cpu"
                load_model(model, "model.safetensors")
                assert load_file("other.safetensors")["w"].tolist() == [5.0, 5.0, 5.0]
    """), steps=3, target="h200")
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_nested_jagged_tensors_train_on_the_simulated_gpu(tmp_path, clean):
    """PyTorch's nested-tensor tutorial's habit: a batch of sequences of lengths 100 and 28 as one jagged
    tensor, attention on it (PyTorch's jagged path, flash on the H200 in bf16), to_padded_tensor for the
    loss. Its bytes are its packed values': the activations saved for backward at the loss are the GELU's
    input and the second layer's, 128 tokens x 256 x 4 bytes each (the first layer's input is the batch)."""
    report = observe_script(write(tmp_path, """
        import torch
        import torch.nn.functional as F
        from torch import nn
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            x = torch.nested.nested_tensor([torch.randn(100, 64), torch.randn(28, 64)], layout=torch.jagged,
                                           device="cuda")
            q = x.unflatten(-1, (4, 16)).transpose(1, 2).to(torch.bfloat16).requires_grad_()
            with torch.no_grad():
                attended = F.scaled_dot_product_attention(q, q, q)
            assert attended.is_nested and attended.dtype == torch.bfloat16
            model(x).to_padded_tensor(0.0).square().mean().backward()
            opt.step(); opt.zero_grad()
    """), steps=2, target="h200")
    loss = report.timeline[report.timeline["phase"] == "loss"]
    assert not loss.empty and (loss["activations"] == 2 * 128 * 256 * 4).all()
    # The linear layers' products on the packed values take cuBLAS's workspaces, forward's and backward's
    # threads' (32 MiB each on the H200), as dense layers do; they ran below the simulation's modes.
    assert (loss["workspaces"] == 2 * 32 * MiB).all()
    assert report.peak.bytes["parameters"] == (64 * 256 * 4 + 256 * 4) + (256 * 64 * 4 + 512)  # 64 floats: 512 B


def test_set_device_parses_as_cuda_does(tmp_path, clean):
    """``torch.cuda.set_device(torch.device("cuda"))`` raises on a GPU (no index); the simulated GPU took it,
    so a script that fails on the GPU ran here (a Muon speedrun written that way, caught on the H200)."""
    report = observe_script(write(tmp_path, """
        import torch
        try:
            torch.cuda.set_device(torch.device("cuda"))
        except ValueError as exc:
            assert "specified index" in str(exc), exc
        else:
            raise AssertionError("set_device without an index must raise, as CUDA's does")
        torch.cuda.set_device("cuda:0"); torch.cuda.set_device(0); torch.cuda.set_device(torch.device("cuda", 0))
        model = torch.nn.Linear(512, 512, bias=False).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(6):
            model(torch.randn(8, 512, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
    """), steps=2, target="h200")
    assert report.peak.bytes["parameters"] == MiB


def test_a_compiled_function_is_named_in_the_note(tmp_path, clean):
    """``@torch.compile`` on a function (a Muon's Newton-Schulz iteration), not the model: the note
    names it and says what compiling it would spare (its temporaries), not the model's activations."""
    report = observe_script(write(tmp_path, """
        import torch
        @torch.compile
        def newton_schulz(g):
            return g @ g.T
        model = torch.nn.Linear(512, 512, bias=False).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(6):
            model(torch.randn(8, 512, device="cuda")).sum().backward()
            newton_schulz(model.weight.grad)
            opt.step(); opt.zero_grad()
    """), steps=2, target="h200")
    assert report.meta["simulation_notes"]["torch.compile"].startswith("simulated eagerly (newton_schulz)")


def test_torchscript_parts_of_a_model_are_simulated_and_noted(tmp_path, clean):
    """pytorch/benchmarks' custom_lstms.py style: a scripted recurrent body inside an eager model, its
    initial state made inside TorchScript. Moving it to the GPU failed (its parameters' dict has no
    ``get``), and so did tracking (its class's ``forward`` raises when read, and it takes no hooks). Its
    tensors are the simulated GPU's all the same (TorchScript allocates through the dispatcher): the
    1024 x 1024 weight and its state, and the note says what TorchScript's interpreter does not see.
    A model scripted whole is tracked as one module (hooks through nn.Module's own methods)."""
    source = """
        import sys, torch
        from torch import nn

        class Body(nn.Module):
            def __init__(self):
                super().__init__()
                self.cell = nn.Linear(1024, 1024, bias=False)

            def forward(self, x):
                h = torch.zeros(x.size(1), 1024, device=x.device)
                for t in range(x.size(0)):
                    h = torch.tanh(self.cell(x[t] + h))
                return h

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.jit.script(Body())
                self.head = nn.Linear(1024, 8, bias=False)

            def forward(self, x):
                return self.head(self.body(x))

        model = Model() if sys.argv[1:] != ["whole"] else torch.jit.script(Model())
        model = model.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(6):
            model(torch.randn(4, 16, 1024, device="cuda")).square().mean().backward()
            opt.step(); opt.zero_grad()
    """
    report = observe_script(write(tmp_path, source), steps=2, target="h200")
    assert report.peak.bytes["parameters"] == 4 * MiB + 8 * 1024 * 4  # cell and head
    assert report.optimizer_state == {"momentum_buffer": 4 * MiB + 8 * 1024 * 4}
    assert "autocast does not cast its operators" in report.meta["simulation_notes"]["TorchScript"]
    whole = observe_script(write(tmp_path, source), ["whole"], steps=2, target="h200")
    assert whole.peak.bytes["parameters"] == report.peak.bytes["parameters"]
    assert whole.optimizer_state == report.optimizer_state
    assert whole.peak.phase == "backward RecursiveScriptModule"  # its steps seen by the root's hooks


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit that stops it
def test_a_prefetching_thread_moves_batches_to_the_simulated_gpu(tmp_path, clean):
    """A custom prefetcher as public repos write it: a thread pins host batches, moves them to the GPU
    on its own stream and queues them. PyTorch's modes are per thread, so the thread met no simulated
    GPU ("not linked with support for cuda devices" on a CPU build, the real driver on a CUDA one) and
    the script stopped. It now runs with the simulated device's modes: its batches are the GPU's, and the
    one the model takes is inputs (64 x 1024 fp32: 256 KiB). Stopped after the steps memprof needs, the
    script leaves the thread running: it is stopped with the simulated device, not left to fail on the
    real one (or keep the process alive)."""
    import threading

    report = observe_script(write(tmp_path, """
        import queue, threading, torch
        model = torch.nn.Linear(1024, 1024, bias=False).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches, stop = queue.Queue(maxsize=3), threading.Event()

        def produce():
            stream = torch.cuda.Stream()
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    x = torch.randn(64, 1024).pin_memory().to("cuda", non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                try:
                    batches.put((x, done), timeout=0.1)
                except queue.Full:
                    continue

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        for step in range(6):
            x, done = batches.get(timeout=60)
            torch.cuda.current_stream().wait_event(done)
            x.record_stream(torch.cuda.current_stream())
            model(x).square().mean().backward()
            opt.step(); opt.zero_grad()
        stop.set()
        thread.join()
    """), steps=2, target="h200", timeout=120)
    assert report.peak.bytes["parameters"] == 4 * MiB
    assert report.peak.bytes["inputs"] == 256 * 1024
    assert not [t for t in threading.enumerate() if t.name.endswith("(produce)")]


def test_a_device_mesh_makes_the_process_group_itself(tmp_path, clean, monkeypatch):
    """PyTorch's tensor-parallel tutorial calls init_device_mesh without init_process_group: the mesh
    makes the default group with its own import of init_process_group, which was not the simulated one
    (NCCL on a CPU build; a rendezvous waiting for ranks that never come with WORLD_SIZE=4). One rank of
    four holds a quarter of a column-parallel weight, and Adam's state of that quarter."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29511")
    report = observe_script(write(tmp_path, """
        import torch
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        mesh = init_device_mesh("cuda", (4,))
        model = parallelize_module(nn.Linear(1024, 1024, bias=False).cuda(), mesh, ColwiseParallel())
        opt = torch.optim.Adam(model.parameters())
        for step in range(6):
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step(); opt.zero_grad()
    """), steps=2, target="h200", timeout=120)
    assert "one rank of 4 " in report.meta["simulation_notes"]["torch.distributed"]
    assert report.peak.bytes["parameters"] == 1024 * 1024 * 4 // 4
    assert report.optimizer_state["exp_avg"] == 1024 * 1024 * 4 // 4


def test_a_dtensors_own_operators_are_simulated(tmp_path, clean, monkeypatch):
    """loss_parallel's cross-entropy (PyTorch's tensor-parallel tutorial, torchtitan) runs its
    backward in DTensor's handler on the local logits: zeros_like, exp, their sum and its product
    with the incoming gradient, three of the logits' size live at once. The simulation saw the
    handler's output only (64 MiB), where the GPU held 192 MiB more (an H200, torch 2.11: 534.43
    MiB at the peak of benchmarks/scripts/tp_llama.py, simulated 406.37 MiB before)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29512")
    rises = tmp_path / "rises.txt"
    observe_script(write(tmp_path, f"""
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
        mesh = init_device_mesh("cuda", (1,))
        head = nn.Linear(512, 8192, bias=False).cuda()
        head = parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        opt = torch.optim.AdamW(head.parameters())
        for step in range(6):
            labels = torch.randint(0, 8192, (2048,), device="cuda")
            with loss_parallel():
                loss = F.cross_entropy(head(torch.randn(2048, 512, device="cuda")), labels)
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                loss.backward()
            with open({str(rises)!r}, "a") as f:
                f.write(f"{{torch.cuda.max_memory_allocated() - before}}\\n")
            opt.step(); opt.zero_grad()
    """), steps=2, target="h200", timeout=120)
    logits = 2048 * 8192 * 4  # 64 MiB of fp32
    seen = [int(rise) for rise in rises.read_text().split()]
    assert len(seen) >= 3  # + the targets' masks and indices: 66.5 KiB
    assert all(3 * logits <= rise < 3 * logits + 2**20 for rise in seen), seen


def test_the_scripts_switches_do_not_outlive_its_run(tmp_path, clean):
    """A script that turns TF32 on (nanoGPT, the jagged-tensor tutorial's habit), cuDNN's autotuner or
    off an attention kernel set them for the process: the runs after it (the advisor's plans in another
    run, the caller's own code) met them. They are put back as they were."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
              torch.backends.cudnn.benchmark, torch.backends.cuda.flash_sdp_enabled())
    observe_script(write(tmp_path, """
        import torch
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.enable_flash_sdp(False)
        model = torch.nn.Linear(512, 512, bias=False).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(6):
            model(torch.randn(8, 512, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
    """), steps=2, target="h200")
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
            torch.backends.cudnn.benchmark, torch.backends.cuda.flash_sdp_enabled()) == before == (
        False, "highest", False, True)


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch without the fp32_precision API")
def test_tf32_set_through_fp32_precision(tmp_path, clean):
    """PyTorch's documented TF32 switch (``torch.backends.cuda.matmul.fp32_precision = "tf32"``): the
    simulation read ``allow_tf32`` at every matrix product, which raises once that API was used ("mix
    of the legacy and new APIs") and stopped the script. It runs, its products at the TF32 rate (faster
    than without), and the caller reads TF32 through either API afterwards."""
    def seconds(switch: str) -> float:
        report = observe_script(write(tmp_path, f"""
            import torch
            {switch}
            model = torch.nn.Linear(4096, 4096, bias=False).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(6):
                model(torch.randn(4096, 4096, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
        """), steps=2, target="h200")
        return float(report.steps["seconds"].iloc[-1])

    ieee, tf32 = seconds("pass"), seconds('torch.backends.cuda.matmul.fp32_precision = "tf32"')
    assert tf32 < ieee / 2  # H200: 494 dense TF32 TFLOPS against 67 of fp32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == (False, "highest")
    assert torch.backends.cuda.matmul.fp32_precision in ("none", "ieee")


LAZY = """
    import torch
    from torch import nn
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.LazyLinear(16)
            self.head = nn.Linear(16, 4)
        def forward(self, x):
            return self.head(torch.relu(self.body(x)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Net()
    model.head.weight.tag = "kept"
    model = model.to(device)
    assert model.head.weight.tag == "kept" and isinstance(model.body.weight, nn.UninitializedParameter)
    model(torch.randn(8, 32, device=device))  # the dry run nn.LazyModuleMixin's docs advise
    opt = torch.optim.Adam(model.parameters())
    for _ in range(4):
        model(torch.randn(8, 32, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("target", [None, "h200"])
def test_lazy_modules_materialise_in_the_first_forward(tmp_path, clean, target):
    """A lazy module's parameters exist after its first forward: the gradient hooks wait for
    them (they raised on an UninitializedParameter, on a GPU too), and ``.to("cuda")`` on the
    simulated GPU keeps a parameter's class and attributes, as ``set_data`` does. 16 x 32 + 16
    and 4 x 16 + 4 fp32 parameters: 2384 bytes; 3584 in 512-byte blocks on the GPU."""
    report = observe_script(write(tmp_path, LAZY), steps=2, target=target)
    params = 2384 if target is None else 2048 + 3 * 512
    assert (report.peak.bytes["parameters"], report.peak.bytes["gradients"]) == (params, params)
    assert report.optimizer_state["exp_avg"] == report.optimizer_state["exp_avg_sq"] == params


FROZEN = """
    import torch
    from torch import nn
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device).eval().requires_grad_(False)
    image = torch.randn(8, 64, device=device).requires_grad_(True)
    opt = torch.optim.LBFGS([image])
    for _ in range(3):
        def closure():
            opt.zero_grad()
            loss = net(image).square().sum()
            loss.backward()
            return loss
        opt.step(closure)
"""


def test_an_optimizer_over_the_input_of_a_frozen_model(tmp_path, clean):
    """Style transfer's habit: L-BFGS steps the input image through a frozen network. The model
    is the module called, the image (8 x 64 fp32, 2048 bytes) the optimizer's own tensor beside
    its 4810 frozen parameters; the simulated GPU says how L-BFGS's history follows values."""
    script = write(tmp_path, FROZEN)
    report = observe_script(script, steps=2)
    assert report.peak.bytes["parameters"] == 4810 * 4 + 2048
    # the image's gradient, between backward and the step (the peak falls where L-BFGS's history ends)
    step = report.timeline[report.timeline["step"] == 1]
    assert (step["gradients"] + step["activation_gradients"]).max() == 2048
    simulated = observe_script(script, steps=2, target="h200")
    assert simulated.peak.bytes["parameters"] == 16384 + 512 + 2560 + 512 + 2048
    assert "history_size=100 pairs" in simulated.meta["simulation_notes"]["L-BFGS"]


def test_a_script_that_trains_in_spawned_processes_says_so(tmp_path, clean):
    """pytorch/examples' ImageNet trains in ``mp.spawn``'s processes, where this process's hooks
    do not see: the error names them and the ways out."""
    script = write(tmp_path, """
        import torch
        import torch.multiprocessing as mp
        def main_worker(rank):
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
        if __name__ == "__main__":
            mp.spawn(main_worker, nprocs=1)
    """)
    with pytest.raises(ScriptError, match=r"it trained in 1 process\(es\) it started with torch.multiprocessing.spawn"):
        observe_script(script, steps=2)
