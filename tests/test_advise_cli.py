"""`memprof advise SCRIPT` end to end (CPU: every plan simulated on a catalogue GPU)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import cuda

MiB = 1 << 20

ROOT = Path(__file__).resolve().parents[1]


def memprof(*args, cwd=ROOT, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "memprof.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})},
    )


def advise_source(tmp_path, source: str, budget: str = "24GiB"):
    """``memprof advise`` on a script of ``source``: its JSON advice and the finished process."""
    script, out = tmp_path / "train.py", tmp_path / "advice.json"
    script.write_text(source)
    r = memprof("advise", script, "--budget", budget, "--json", out)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r


def check_schema(data: dict) -> None:
    """docs/advise-json.md, key by key."""
    assert data["schema"] == 1
    assert isinstance(data["script"], str) and isinstance(data["target"], str)
    assert isinstance(data["budget_bytes"], int) and isinstance(data["world_size"], int)
    assert isinstance(data["simulated"], bool)
    assert data["best"] is None or isinstance(data["best"], str)
    assert isinstance(data["code_change"], list) and all(isinstance(c, str) for c in data["code_change"])
    assert data["script_does"] is None or set(data["script_does"]) == {
        "autocast", "forward_dtype", "micro_batches", "checkpointed", "optimizer", "implementation", "parameters", "frozen", "batch",
        "also_trains", "checkpointing_switch", "in_backward", "selective_checkpointing", "carried_state", "idle_blocks",
        "recomputed_by", "expandable_segments", "transformed", "transforms_inside", "coupled_by", "trainer"}
    assert isinstance(data["cache_excess_bytes"], int) and data["cache_excess_bytes"] >= 0
    assert isinstance(data["evaluation_peak_allocated_bytes"], int) and data["evaluation_peak_allocated_bytes"] >= 0
    assert isinstance(data["varying_batch_shapes"], list)
    assert isinstance(data["skipped"], dict) and isinstance(data["failed"], dict)
    assert data["plans"] and data["plans"][0]["plan"] == (data["best"] or data["plans"][0]["plan"])
    for p in data["plans"]:
        assert set(p) == {"plan", "peak_allocated", "peak_reserved", "fits", "seconds", "slowdown", "device_share", "why",
                          "changes"}
        assert isinstance(p["changes"], str) and (not p["changes"] or "accum" in p["plan"])  # accumulation's alone
        assert 0 < p["device_share"] <= 1  # simulated: the device's busy share of the step
        assert isinstance(p["peak_allocated"], int) and isinstance(p["peak_reserved"], int)
        assert isinstance(p["fits"], bool) and isinstance(p["seconds"], float)
        assert p["fits"] == (p["peak_reserved"] * 1.05 <= data["budget_bytes"])
    assert data["verified"] is None or isinstance(data["verified"], list)
    from memprof import Report

    assert Report.from_dict(data["baseline"]).source == "simulate"


def test_gpt_script_advised(tmp_path):
    out = tmp_path / "advice.json"
    # A budget between the plain step's peak and what checkpointing brings it to.
    r = memprof("advise", "examples/train_gpt.py", "--budget", "180MiB", "--json", out, "--", "--batch-size", "64",
                env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "no GPU here: every plan is simulated on the RTX4090-24GB" in r.stdout
    assert "plans for 180.00 MiB per rank on simulated RTX4090-24GB" in r.stdout
    data = json.loads(out.read_text())
    check_schema(data)
    plans = {p["plan"]: p for p in data["plans"]}
    assert not plans["baseline"]["fits"]
    assert data["best"] is not None and plans[data["best"]]["fits"]
    fitting = [p for p in data["plans"] if p["fits"]]
    assert data["best"] == min(fitting, key=lambda p: p["seconds"])["plan"]
    assert plans["ckpt"]["peak_allocated"] < plans["baseline"]["peak_allocated"]
    assert plans["accum4"]["peak_allocated"] < plans["accum2"]["peak_allocated"] < plans["baseline"]["peak_allocated"]
    assert f"recommended: {data['best']}" in r.stdout
    # What the script already does: bf16 autocast and 2 micro-batches, so no bf16 plan is offered again.
    does = data["script_does"]
    assert does["autocast"] == "bf16" and does["micro_batches"] == 2 and does["checkpointed"] == []
    assert does["optimizer"] == "AdamW" and does["batch"] == {"idx": [[64, 64], "int64"], "targets": [[64, 64], "int64"]}
    assert "  mixed precision: bf16 autocast" in r.stdout and "  micro-batches per optimizer step: 2" in r.stdout
    assert not any(p.startswith("bf16") for p in plans) and "bf16+ckpt" in data["skipped"]
    assert "from 2 to 4 micro-batches" in " ".join(accumulation_change(data, "accum2"))
    # Distinct results only, and every plan name whole in an 80-column terminal.
    results = [(p["peak_allocated"], p["peak_reserved"], p["seconds"]) for p in data["plans"]]
    assert len(set(results)) == len(results)
    lines = r.stdout.splitlines()
    rows = [line for line in lines if line.split() and line.split()[0] in plans]
    assert len(rows) == len(plans) and all(len(line) <= 80 for line in rows)
    # The script ran once, quietly: its own lines are in the log, not on the terminal.
    assert "parameters on cuda" not in r.stdout and "step 0: loss" not in r.stdout
    log = next(line.split(" is in ")[1].split(" (")[0] for line in lines if "the script's own output is in" in line)
    text = Path(log).read_text()
    assert text.count("parameters on cuda") == 1 and "step 0: loss" in text


def accumulation_change(data: dict, plan: str) -> list[str]:
    """The code change of ``plan`` as the advice phrases it for this script."""
    from memprof.strategies import Accumulation

    return [Accumulation(int(plan[5:])).code_change(type("Facts", (), data["script_does"]))]


LEAVES_A_BAR = """\
import sys, torch

class Bar:  # a progress bar prints its last state as it is finalised (tqdm's __del__)
    def __del__(self):
        print("bar closed", file=sys.stderr)

model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
bar = Bar()
bar.me = bar  # in a cycle: only the garbage collector finalises it
for _ in range(100):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step(); opt.zero_grad()
"""


def test_what_the_stopped_script_leaves_writes_to_its_log(tmp_path):
    data, r = advise_source(tmp_path, LEAVES_A_BAR)
    assert "bar closed" not in r.stdout + r.stderr
    log = next(line.split(" is in ")[1].split(" (")[0] for line in r.stdout.splitlines()
               if "the script's own output is in" in line)
    assert "bar closed" in Path(log).read_text()


def test_progress_bar_on_a_terminal_only(tmp_path):
    import os
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "memprof.cli", "advise", "examples/train_mlp.py", "--budget", "t4"],
                            cwd=ROOT, stdout=slave, stderr=slave, stdin=slave, env={**os.environ, "COLUMNS": "80"})
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=600) == 0, out.decode(errors="replace")[-2000:]
    text = out.decode(errors="replace")
    import re

    assert re.search(r"plans \((now|done): [a-z0-9_+]+\).*\d+/\d+", text)  # the bar: current plan, plans done
    piped = memprof("advise", "examples/train_mlp.py", "--budget", "t4")
    assert piped.returncode == 0 and "plans (" not in piped.stdout + piped.stderr


def test_gpu_without_bf16_gets_fp16_plans(tmp_path):
    out = tmp_path / "advice.json"
    r = memprof("advise", "examples/train_mlp.py", "--budget", "t4", "--json", out)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    names = [p["plan"] for p in data["plans"]]
    assert data["target"] == "T4-16GB" and data["script_does"]["autocast"] is None
    assert "fp16" in names and "fp16+offload_act" in names and not any("bf16" in n for n in names)
    # The script makes its batch on the device and computes the loss outside the
    # model: accumulation runs 1/K of both. Its peak (Adam's first step) holds the
    # input x alone of the batch: 64 x 784 fp32 = 200,704 B, of which 1/K remains
    # (the targets, 64 int64, fill one 512-byte block either way).
    plans = {p["plan"]: p for p in data["plans"]}
    assert all("ckpt" in name for name in data["failed"])  # an MLP has no repeated blocks to checkpoint
    for k in (2, 4, 8):
        saved = plans["baseline"]["peak_allocated"] - plans[f"accum{k}"]["peak_allocated"]
        assert saved == 200_704 - 200_704 // k


def test_hf_script_advised():
    pytest.importorskip("transformers")
    r = memprof("advise", "examples/train_hf.py", "--budget", "24GiB", "--top", "3", "--world-size", "4")
    assert r.returncode == 0, r.stderr
    assert "recommended: baseline" in r.stdout  # a 2-layer model fits 24 GiB as it is
    assert "(GPT2LMHeadModel)" in r.stdout


def test_vision_script_advised():
    pytest.importorskip("torchvision")
    r = memprof("advise", "examples/train_vision.py", "--budget", "rtx3060", "--top", "3")
    assert r.returncode == 0, r.stderr
    assert "RTX3060-12GB" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["advise", "no_such_script.py"], "no_such_script.py"),
        (["advise", "examples/train_mlp.py", "--budget", "lots"], "neither a size"),
        (["advise", "examples/train_mlp.py", "--budget", "rtx9090"], "RTX4090-24GB"),
        (["advise", "examples/train_mlp.py", "--world-size", "0"], "--world-size must be >= 1"),
    ],
)
def test_bad_input(args, message):
    r = memprof(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_script_errors(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    r = memprof("advise", bad)
    assert r.returncode == 2 and "syntax" in r.stderr.lower() and "Traceback" not in r.stderr
    raises = tmp_path / "raises.py"
    raises.write_text("raise RuntimeError('no data found')\n")
    r = memprof("advise", raises)
    assert r.returncode == 2 and "no data found" in r.stderr and "could not observe a training step" in r.stderr
    nothing = tmp_path / "nothing.py"
    nothing.write_text("import torch\nprint(torch.ones(2).sum())\n")
    r = memprof("advise", nothing)
    assert r.returncode == 2 and "optimizer" in r.stderr and "Traceback" not in r.stderr


def test_the_script_watch_sees_checkpointing_accumulation_and_the_optimizer():
    """What the advisor reports the script does: blocks recomputed in backward,
    forwards per optimizer step, the optimizer's implementation, the batch by argument name."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from memprof.script_advice import _Watch

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).relu()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(8, 1)
            self.head.requires_grad_(False)

        def forward(self, tokens):
            for b in self.blocks:
                tokens = checkpoint(b, tokens, use_reentrant=False)
            return self.head(tokens)

    net = Net()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], foreach=True)
    critic = nn.Linear(1000, 10)  # another model, trained by an optimizer of its own
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    watch = _Watch(net, opt)
    for _ in range(2):  # two optimizer steps of three micro-batches
        with torch.no_grad():  # evaluation between steps: not a micro-batch, not the batch
            net(torch.randn(16, 8))
        for _ in range(3):
            net(torch.randn(4, 8)).sum().backward()
        opt.step()
        critic(torch.randn(2, 1000)).sum().backward()
        critic_opt.step()
        watch.step()
    facts = watch.close()
    assert sorted(facts.checkpointed) == ["blocks.0", "blocks.1"] and facts.micro_batches == 3
    assert (facts.optimizer, facts.implementation, facts.autocast) == ("AdamW", "foreach", None)
    assert facts.parameters == {"fp32": 2 * (8 * 8 + 8) + 8 + 1} and facts.frozen == 9
    assert facts.batch == {"tokens": ([4, 8], "fp32")}
    assert facts.also_trains == ["SGD over 0.01 M parameters"]  # 1000 x 10 + 10, once


def test_an_fp64_model_is_not_offered_autocast_nor_a_host_optimizer_as_another_model():
    """A Gaussian process in float64 with an embedding table on the host: autocast leaves fp64
    alone (the bf16 plans changed nothing), the header said "fp32 compute", and SparseAdam over
    the host's table was called another model's, whose memory would be the GPU's temporaries."""
    from memprof.script_advice import ScriptFacts, _Watch, what_is_done
    from memprof.strategies import Accumulation, Autocast

    from memprof.virtual_cuda import VirtualCUDA

    with VirtualCUDA("h200"):
        net = nn.Linear(3, 4).double().cuda()
        table = nn.Embedding(100, 4, sparse=True)  # on the host, as the script keeps it
        opt, host = torch.optim.Adam(net.parameters()), torch.optim.SparseAdam(table.parameters())
        watch = _Watch(net, opt)
        for _ in range(2):
            pooled = table(torch.tensor([1, 2])).sum().cuda()
            (net(torch.randn(8, 3, dtype=torch.float64, device="cuda")).sum() + pooled).backward()
            opt.step()
            host.step()
            watch.step()
        facts = watch.close()
    assert facts.also_trains == [] and facts.compute == "fp64" and facts.lines()[0] == "mixed precision: none (fp64 compute)"
    done = what_is_done({"bf16": [Autocast("bf16")], "accum2": [Accumulation(2)]}, facts, net, "script")
    assert done == {"bf16": "the script's parameters are fp64, which autocast leaves as they are (it casts fp32 only)"}
    assert ScriptFacts(parameters={"fp32": 10, "fp64": 2}).compute == "fp32"


def test_state_the_model_gets_back_is_not_cut_into_micro_batches():
    """Transformer-XL passes the memory its forward returns back to its next forward, as long as
    the segment (dim 0): accumulation plans cut it with the batch, then measured later plans on
    the shrunken memory, and the recommended accum2 did not fit when run."""
    from memprof.script_advice import _Watch, what_is_done
    from memprof.strategies import Accumulation, Checkpointing

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.Linear(8, 8)

        def forward(self, x, *mems):
            h = self.cell(x) + (mems[0] if mems else 0)
            return [h.square().mean(), h.detach()]

    net = Recurrent()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = _Watch(net, opt)
    mems = ()
    for _ in range(3):
        loss, *mems = net(torch.randn(16, 8), *mems)
        loss.backward()
        opt.step()
        watch.step()
    facts = watch.close()
    assert facts.carried_state == 1
    # truncated backpropagation through time: the loop detaches the state (a new tensor over its storage)
    watch, state = _Watch(net, opt), ()
    for _ in range(3):
        loss, *state = net(torch.randn(16, 8), *state)
        state = [s.detach() for s in state]
        loss.backward()
        opt.step()
        watch.step()
    assert watch.close().carried_state == 1
    watch = _Watch(net, opt)  # a fresh batch each step carries nothing
    for _ in range(3):
        net(torch.randn(16, 8))[0].backward()
        opt.step()
        watch.step()
    assert watch.close().carried_state == 0
    done = what_is_done({"accum2": [Accumulation(2)], "ckpt": [Checkpointing(blocks=["cell"])]}, facts, net, "script")
    assert list(done) == ["accum2"] and "back to its next forward" in done["accum2"]


def test_accumulation_much_faster_than_the_whole_batch_is_left_out():
    """An exact Gaussian process factorizes a kernel matrix over its batch (N^3): accum4 was
    predicted 5x faster than the step as it is, and recommended, though four GPs of a quarter
    of the points each are another model. K micro-batches are never much faster than one."""
    from types import SimpleNamespace

    from memprof.script_advice import _coupled_batches
    from memprof.strategies import Accumulation, Autocast

    built = {"baseline": [], "accum4": [Accumulation(4)], "bf16": [Autocast("bf16")],
             "bf16+accum2": [Autocast("bf16"), Accumulation(2)]}
    preds = {n: SimpleNamespace(seconds=s) for n, s in
             (("baseline", 1.0), ("accum4", 0.2), ("bf16", 0.5), ("bf16+accum2", 0.45))}
    skipped: dict = {}
    _coupled_batches(built, preds, skipped)
    assert list(preds) == ["baseline", "bf16", "bf16+accum2"] and list(skipped) == ["accum4"]
    assert skipped["accum4"].startswith("accum4 is predicted 5.0x faster than baseline: the step's work grows")


def test_a_zero_redundancy_optimizer_is_stage_one_done():
    """A script whose optimizer is ZeroRedundancyOptimizer shards its state already: stage 1 is
    not offered again; stage 2 (gradients too) is."""
    from memprof.script_advice import ScriptFacts, what_is_done
    from memprof.strategies import ZeRO

    facts = ScriptFacts(optimizer="ZeroRedundancyOptimizer")
    done = what_is_done({"zero1x8": [ZeRO(1, 8)], "zero2x8": [ZeRO(2, 8)]}, facts, nn.Linear(2, 2), "script")
    assert done == {"zero1x8": "the script's ZeroRedundancyOptimizer shards the optimizer's state already (ZeRO stage 1)"}


def test_the_watch_counts_micro_batches_by_backward():
    """NeRF calls its network once per chunk of rays and runs one backward for all: one
    micro-batch a step, not one per forward."""
    from memprof.script_advice import _Watch

    net = nn.Linear(3, 4)
    opt = torch.optim.Adam(net.parameters())
    watch = _Watch(net, opt)
    for _ in range(2):
        torch.cat([net(torch.randn(64, 3)) for _ in range(12)]).sum().backward()
        opt.step()
        watch.step()
    assert watch.close().micro_batches == 1


def test_the_watch_counts_two_backwards_of_one_forward_once():
    """A multi-task step runs backward twice through one forward (``loss_a.backward(retain_graph=True);
    loss_b.backward()``): one micro-batch a step, not two; two forwards and backwards are two."""
    from memprof.script_advice import _Watch

    for forwards in (1, 2):
        net = nn.Linear(3, 4)
        opt = torch.optim.Adam(net.parameters())
        watch = _Watch(net, opt)
        for _ in range(3):
            for _ in range(forwards):
                out = net(torch.randn(8, 3))
                out[:, :2].sum().backward(retain_graph=True)
                out[:, 2:].sum().backward()
            opt.step()
            opt.zero_grad()
            watch.step()
        assert watch.close().micro_batches == forwards


@pytest.mark.parametrize("habit", ["sam", "pgd", "pgd-set-to-zero"])
def test_passes_whose_gradients_are_reset_are_not_micro_batches(habit):
    """SAM runs two forward and backward passes a step and zeroes the gradients between them
    (first_step(zero_grad=True)); PGD adversarial training runs backward through the model for
    each attack iteration, then zero_grad, then the training pass. Each was taken for gradient
    accumulation (2, 4 micro-batches), and its advice said to raise an accumulation the script
    does not have. A pass counts where the gradient the pass before left is still there."""
    from memprof.script_advice import _Watch

    net = nn.Linear(3, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = _Watch(net, opt)
    for _ in range(3):
        x = torch.randn(8, 3)
        if habit == "sam":
            net(x).square().sum().backward()
            opt.zero_grad()  # first_step(zero_grad=True), after moving to the worst case near the weights
            net(x).square().sum().backward()
        else:
            delta = torch.zeros_like(x, requires_grad=True)
            for _ in range(3):  # the attack: backward through the model, its gradients accumulated
                net(x + delta).square().sum().backward()
                delta = (delta + delta.grad.sign()).detach().requires_grad_(True)
            opt.zero_grad(set_to_none=habit == "pgd")
            net(x + delta.detach()).square().sum().backward()
        opt.step()
        watch.step()
    assert watch.close().micro_batches == 1


def test_the_watch_tells_selective_checkpointing():
    """torchtitan's per-op checkpointing keeps what its policy names and recomputes the rest:
    recomputed modules as with full checkpointing, told apart, and full checkpointing is not
    called done without saying how to get it."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from memprof.script_advice import _Watch, what_is_done
    from memprof.strategies import Checkpointing

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    class Block(nn.Sequential):
        pass

    for selective in (False, True):
        context = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)} if selective else {}

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])

            def forward(self, x):
                for block in self.blocks:
                    x = checkpoint(block, x, use_reentrant=False, **context)
                return x

        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        watch = _Watch(net, opt)
        for _ in range(2):
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
            watch.step()
        facts = watch.close()
        assert facts.checkpointed == ["blocks.0", "blocks.1"] and facts.selective_checkpointing is selective
        done = what_is_done({"ckpt": [Checkpointing()]}, facts, net, "script")["ckpt"]
        assert done.startswith("the script already checkpoints the repeated blocks")
        assert ("PREFER_RECOMPUTE" in done) is selective


def test_the_watch_names_a_custom_function_that_runs_the_blocks_again_in_backward():
    """An ODE solved by the adjoint method (torchdiffeq): a custom autograd Function keeps only
    the final state in forward and runs the blocks again in its backward. That is no
    torch.utils.checkpoint: the facts name the Function, and so does the reason checkpointing
    is left out (it said "already checkpoints")."""
    from memprof.script_advice import _Watch, what_is_done
    from memprof.strategies import Checkpointing

    class Block(nn.Sequential):
        pass

    blocks = nn.ModuleList([Block(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])

    class Adjoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, *params):
            with torch.no_grad():
                for block in blocks:
                    y = y + block(y)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, a):
            (y,) = ctx.saved_tensors
            params = list(blocks.parameters())
            with torch.enable_grad():
                y = y.detach().requires_grad_()
                f = y + blocks[1](y + blocks[0](y))
                grads = torch.autograd.grad(f, (y, *params), a)
            return grads

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            return Adjoint.apply(x, *self.blocks.parameters())

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = _Watch(net, opt)
    for _ in range(2):
        net(torch.randn(4, 8, requires_grad=True)).sum().backward()
        opt.step()
        watch.step()
    facts = watch.close()
    assert facts.checkpointed == ["blocks.0", "blocks.1"] and facts.recomputed_by == "AdjointBackward"
    done = what_is_done({"ckpt": [Checkpointing()]}, facts, net, "script")["ckpt"]
    assert done.startswith("the script already runs the repeated blocks again in backward, inside AdjointBackward")


def test_a_wrapper_optimizer_is_named_with_its_base():
    """timm's Lookahead(RAdam) steps its base inside its own step, its step hooked only from its
    first zero_grad (it does not call Optimizer.__init__): the facts name both, whichever the
    script was found with."""
    from collections import OrderedDict, defaultdict

    from memprof.script_advice import ScriptFacts, _Watch

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, base):
            self.base_optimizer, self.param_groups, self.defaults = base, base.param_groups, base.defaults
            self.state = defaultdict(dict)
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()

        def step(self, closure=None):
            return self.base_optimizer.step(closure)

    net = nn.Linear(3, 4)
    base = torch.optim.RAdam(net.parameters())
    opt = Lookahead(base)
    assert ScriptFacts.of(net, opt).optimizer == "Lookahead(RAdam)"
    watch = _Watch(net, base)
    for _ in range(3):
        net(torch.randn(8, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        watch.step()
    assert watch.close().optimizer == "Lookahead(RAdam)"


def test_the_watch_leaves_out_a_gan_generators_backward_through_the_discriminator():
    """A GAN's generator step runs backward through the discriminator (the model watched), whose
    gradients the discriminator's next zero_grad throws away: one micro-batch a step, not two;
    with zero_grad(set_to_none=False) too. Accumulation over 3 backward passes is 3."""
    from memprof.script_advice import _Watch

    for set_to_none, k in ((True, 1), (False, 1), (True, 3)):
        d, g = nn.Linear(4, 1), nn.Linear(2, 4)
        opt_d, opt_g = torch.optim.Adam(d.parameters()), torch.optim.Adam(g.parameters())
        watch = _Watch(d, opt_d)
        for _ in range(3):
            opt_d.zero_grad(set_to_none=set_to_none)
            for _ in range(k):
                (d(torch.randn(8, 4)).mean() - d(g(torch.randn(8, 2)).detach()).mean()).backward()
            opt_d.step()
            opt_g.zero_grad(set_to_none=set_to_none)
            d(g(torch.randn(8, 2))).mean().backward()
            opt_g.step()
            watch.step()
        assert watch.close().micro_batches == k


ACCUMULATING = """\
import argparse, torch, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--accum", type=int, default=1); a = p.parse_args()
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]).cuda()
opt = torch.optim.AdamW(model.parameters())
for it in range(12):
    for mb in range(a.accum):
        loss = model(torch.randn(8192 // a.accum, 1024, device="cuda")).square().mean() / a.accum
        loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_an_accumulation_plan_peaks_as_the_script_accumulating_does(tmp_path):
    """The plan runs one micro-batch of K a step; each after the first adds into the gradients the
    earlier ones left, which live through its backward (the step's peak here; the first
    micro-batch's alone was 6 % lower for K = 2). The prediction's peak allocated is the script's
    own accumulation's, to the byte."""
    script, advice = tmp_path / "train.py", tmp_path / "advice.json"
    script.write_text(ACCUMULATING)
    r = memprof("advise", script, "--target", "h200", "--budget", "24GiB", "--json", advice)
    assert r.returncode == 0, r.stderr
    predicted = {p["plan"]: p["peak_allocated"] for p in json.loads(advice.read_text())["plans"]}
    for k in (2, 4):
        out = tmp_path / f"track{k}.json"
        r = memprof("track", tmp_path / "train.py", "--target", "h200", "--steps", "3", "--json", out,
                    "--", "--accum", str(k))
        assert r.returncode == 0, r.stderr
        assert predicted[f"accum{k}"] == json.loads(out.read_text())["steps"][-1]["peak_allocated"]


def test_a_step_that_fits_only_by_its_allocated_memory_runs_again_with_expandable_segments(tmp_path):
    """The script's step allocates less than the budget (with the 5 % margin) but reserves more: the
    script runs again from its start with expandable segments, and the plan "expandable" is that
    run's step, as memprof track measures the script with PYTORCH_CUDA_ALLOC_CONF set."""
    script, advice = tmp_path / "train.py", tmp_path / "advice.json"
    script.write_text(ACCUMULATING)
    track = {}
    for setting in ("", "expandable_segments:True"):
        out = tmp_path / f"track-{bool(setting)}.json"
        r = memprof("track", script, "--target", "h200", "--steps", "3", "--json", out,
                    env={"PYTORCH_CUDA_ALLOC_CONF": setting})
        assert r.returncode == 0, r.stderr
        track[setting] = json.loads(out.read_text())["steps"][-1]
    allocated, reserved = track[""]["peak_allocated"], track[""]["peak_reserved"]
    budget = int(allocated * 1.05) + 1
    assert budget < reserved * 1.05
    r = memprof("advise", script, "--target", "h200", "--budget", budget, "--json", advice,
                env={"PYTORCH_CUDA_ALLOC_CONF": ""})
    assert r.returncode == 0, r.stderr
    data = json.loads(advice.read_text())
    check_schema(data)
    plans = {p["plan"]: p for p in data["plans"]}
    assert (plans["baseline"]["peak_allocated"], plans["baseline"]["peak_reserved"]) == (allocated, reserved)
    expandable = track["expandable_segments:True"]
    assert (plans["expandable"]["peak_allocated"], plans["expandable"]["peak_reserved"]) == (
        expandable["peak_allocated"], expandable["peak_reserved"])
    assert plans["expandable"]["seconds"] == plans["baseline"]["seconds"]
    assert "with expandable segments expandable reserves" in plans["expandable"]["why"]
    assert data["script_does"]["expandable_segments"] is False
    # A script that asks for them in its first lines runs every plan with them, and is told so.
    script.write_text('import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"\n' + ACCUMULATING)
    r = memprof("advise", script, "--target", "h200", "--budget", budget, "--json", advice,
                env={"PYTORCH_CUDA_ALLOC_CONF": ""})
    assert r.returncode == 0, r.stderr
    data = json.loads(advice.read_text())
    plans = {p["plan"]: p for p in data["plans"]}
    assert data["script_does"]["expandable_segments"] is True and "allocator: expandable segments" in r.stdout
    assert "expandable" not in plans and plans["baseline"]["peak_reserved"] == expandable["peak_reserved"]


VARYING = """\
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
opt = torch.optim.AdamW(model.parameters())
for it in range(12):
    n = 1024 + 64 * it  # a batch whose size changes every step (graphs, token buckets)
    model(torch.randn(n, 256, device="cuda")).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_accumulation_plans_whose_batch_was_not_found_fail(tmp_path):
    """A plan that cut nothing ran the whole batch: it is not K micro-batches, and said so
    (it was ranked with the step as it is, as if accumulation saved nothing)."""
    data, _ = advise_source(tmp_path, VARYING)
    accumulating = ("accum2", "accum4", "accum8", "bf16+accum2")
    assert all("found nothing of the batch's size (1088 samples" in data["failed"][p] for p in accumulating)
    assert "baseline" in {p["plan"] for p in data["plans"]} and "bf16" in {p["plan"] for p in data["plans"]}


def test_micro_batches_the_script_makes_that_do_not_divide_say_so(tmp_path):
    """Two micro-batches of 4 samples made by the script: 8 micro-batches per step cannot be cut from them,
    and the reason given was that the batch changed size from step to step."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(24):",
        "    for micro in range(2):",
        "        (model(torch.randn(4, 256).cuda()).square().mean() / 2).backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    assert data["failed"]["accum8"].startswith("the script makes its micro-batches of 4 samples itself, which do not "
                                               "divide into 8")


ENDS_IN_ERROR = """\
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
opt = torch.optim.AdamW(model.parameters())
for it in range(8):
    model(torch.randn(1024, 256, device="cuda")).mean().backward()
    opt.step()
    opt.zero_grad()
raise EOFError("Ran out of input")  # ZeRO's consolidate_state_dict on ranks that are not there
"""


def test_an_error_after_the_last_step_is_not_a_plans(tmp_path):
    """The script fails at its end, after the steps, where the next plan was applied but none of
    its steps began: that plan (and, for accumulation, every plan with as many micro-batches) was
    blamed; they run in the next run of the script instead."""
    data, _ = advise_source(tmp_path, ENDS_IN_ERROR)
    assert not any("EOFError" in why for why in data["failed"].values())
    assert {"accum2", "accum4", "accum8", "bf16", "offload_act"} <= {p["plan"] for p in data["plans"]}


def test_an_error_before_a_plans_first_forward_fails_that_plan_only(tmp_path):
    """The script checks its batch against its labels before calling the model; the labels stay
    on the host, where memprof does not cut them, so every accumulation plan raises there, in a
    run where no plan's step ran yet. Those plans fail, with the cut's explanation; the plans
    after them run (they all failed with the accumulation's error before)."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch",
        "import torch.nn.functional as F",
        "model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(6):",
        "    x = torch.randn(32, 64).cuda()",
        "    y = torch.randint(0, 4, (32,))",
        "    if x.shape[0] != y.shape[0]:",
        "        raise ValueError(f'{x.shape[0]} inputs but {y.shape[0]} labels')",
        "    F.cross_entropy(model(x), y.cuda()).backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    accumulating = {p for p in data["failed"] if "accum" in p}
    assert accumulating == {f"{pre}accum{k}" for pre in ("", "ckpt+", "bf16+", "bf16+ckpt+") for k in (2, 4, 8)}
    assert all("ValueError: 16 inputs but 32 labels" in data["failed"][p] for p in accumulating if p.endswith("accum2"))
    assert all("cutting its tensors where they reach the device" in data["failed"][p] for p in accumulating)
    assert {p["plan"] for p in data["plans"]} == {"baseline", "bf16", "offload_act", "bf16+offload_act",
                                                  "offload_states", "bf16+offload_states"}


AVERAGED = """\
import sys, torch, torch.nn as nn
from torch.optim.swa_utils import AveragedModel, update_bn
root = "--root" in sys.argv
model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                      nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
swa = AveragedModel(model)
loader = [(torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))) for _ in range(2)]
for step in range(8):
    x, y = torch.randn(128, 3, 32, 32, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    swa.update_parameters(model)
    if step % 2 == 1:
        if root:  # the same pass over the model itself: an evaluation
            model.eval()
            with torch.no_grad():
                for xb, _ in loader:
                    model(xb.cuda())
            model.train()
        else:  # SWA's batch-norm statistics: train mode, no gradients, momentum None
            update_bn(loader, swa, device="cuda")
"""


def test_an_averaged_models_statistics_pass_is_no_plans_step(tmp_path):
    """torch.optim.swa_utils.update_bn runs the averaged model (another model) over 256-sample
    batches every second step: that step was a plan's, so accumulation plans peaked at the pass's
    activations (accum8 324 MiB instead of 89) and the step's time held it. Such a step is left
    out as an evaluation of the model itself is: the plans are those of the script without it."""
    from memprof.advisor import default_plans
    from memprof.script_advice import advise_script

    script = tmp_path / "swa.py"
    script.write_text(AVERAGED)
    plans = {k: v for k, v in default_plans().items() if k in ("baseline", "bf16", "accum8")}
    tables = [advise_script(str(script), args, budget="24GiB", target="h200", plans=plans, progress=False).table
              for args in ([], ["--root"])]
    columns = ["peak_allocated", "peak_reserved", "seconds"]
    assert tables[0][columns].to_dict() == tables[1][columns].to_dict()
    assert tables[0].loc["accum8", "peak_allocated"] < tables[0].loc["baseline", "peak_allocated"] / 2


def test_an_epochs_short_last_batch_is_no_plans_step(tmp_path):
    """A DataLoader keeps an epoch's last 8 samples as a batch of their own (drop_last=False, its
    default): an accumulation plan whose step met it found nothing of 2048 samples to cut and
    failed, with every plan of as many micro-batches; a plan without accumulation ran 8 samples.
    Such a step is left out: the next one is the plan's."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "from torch.utils.data import DataLoader, TensorDataset",
        "dl = DataLoader(TensorDataset(torch.randn(3 * 2048 + 8, 512), torch.randint(0, 10, (3 * 2048 + 8,))),",
        "                batch_size=2048, shuffle=True)",
        "model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()",
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "step = 0",
        "while step < 40:",
        "    for x, y in dl:",
        "        x, y = x.cuda(), y.cuda()",
        "        nn.functional.cross_entropy(model(x), y).backward()",
        "        opt.step(); opt.zero_grad()",
        "        step += 1",
    ]) + "\n")
    assert not any("nothing of the batch's size" in why for why in data["failed"].values()), data["failed"]
    peaks = {p["plan"]: p["peak_allocated"] for p in data["plans"]}
    assert {"accum2", "accum4", "accum8", "bf16+accum8"} <= set(peaks)
    # each the step of its own micro-batch: 2048 / K samples' activations (2048 x 2048 fp32 = 16 MiB, twice)
    assert peaks["baseline"] > peaks["accum2"] > peaks["accum4"] > peaks["accum8"]


PREDICTING_WITH_GRADIENTS = """\
import sys, torch, torch.nn as nn
model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.ReLU())]).cuda()
opt = torch.optim.Adam(model.parameters())
xv = torch.randn(2048, 1024)
for step in range(40):
    x, y = torch.randn(256, 1024).cuda(), torch.randn(256, 1024).cuda()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step(); opt.zero_grad()
    if "--predict" in sys.argv and step % 3 == 2:  # pytorch-tabnet's predict: eval mode, gradients on
        model.eval()
        preds = [model(xb.cuda()).cpu().detach() for xb in xv.split(1024)]
        model.train()
"""


def test_a_prediction_in_eval_mode_with_gradients_on_is_no_plans_step(tmp_path):
    """A prediction pass in eval mode without torch.no_grad(): its graphs, never backpropagated,
    fell into whichever plan's step met them (accum8 peaking at the pass's 1024 rows). A forward
    in eval mode that no backward follows is an evaluation."""
    from memprof.advisor import default_plans
    from memprof.script_advice import advise_script

    script = tmp_path / "predict.py"
    script.write_text(PREDICTING_WITH_GRADIENTS)
    plans = {k: v for k, v in default_plans().items() if k in ("baseline", "accum8")}
    advice = [advise_script(str(script), args, budget="24GiB", target="h200", plans=plans, progress=False)
              for args in ([], ["--predict"])]
    assert advice[0].evaluation[0] == 0 and advice[1].evaluation[0] > 0
    columns = ["peak_allocated", "seconds"]
    assert advice[1].table[columns].to_dict() == advice[0].table[columns].to_dict()


def test_a_fault_after_the_step_as_it_is_is_said_not_a_key_error(tmp_path, monkeypatch):
    """memprof's own fault between the step as it is and the plans (here: emptying the cache)
    failed the step as it is after its report was taken; ranking then crashed with KeyError."""
    from memprof.advisor import default_plans
    from memprof.runner import ScriptError
    from memprof.script_advice import advise_script
    from memprof.tracker import Tracker

    script = tmp_path / "train.py"
    script.write_text("\n".join([
        "import torch",
        "model = torch.nn.Linear(64, 64).cuda()",
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "for step in range(12):",
        "    model(torch.randn(32, 64, device='cuda')).square().mean().backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")

    def broken(self):
        raise RuntimeError("a fault of memprof's own")

    monkeypatch.setattr(Tracker, "empty_cache", broken)
    plans = {k: v for k, v in default_plans().items() if k in ("baseline", "bf16")}
    with pytest.raises(ScriptError, match="could not take the script's step as it is: .*a fault of memprof's own"):
        advise_script(str(script), budget="24GiB", target="h200", plans=plans, progress=False)


WRAPPED = """\
import functools
import torch, torch.nn as nn
from types import MethodType
from torch.utils.checkpoint import checkpoint

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(64), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.fc(self.norm(x)).relu()

model = nn.Sequential(nn.Linear(16, 64), *[Block() for _ in range(2)], nn.Linear(64, 4)).cuda()
# Hugging Face's way (GradientCheckpointingLayer): each block's forward checkpointed, its hooks outside.
for block in model[1:3]:
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
# Accelerate's way (Trainer(bf16=True)): autocast entered inside the model's forward, after its hooks.
model.forward = MethodType(torch.autocast("cuda", dtype=torch.bfloat16)(type(model).forward), model)
opt = torch.optim.AdamW(model.parameters())
for _ in range(4):
    x = torch.randn(32, 16, device="cuda")
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_watch_sees_a_wrapped_forward(tmp_path):
    """Autocast and checkpointing applied by wrapping ``forward`` (Accelerate, Hugging
    Face's layers) are what the script does: those plans are left out."""
    data, r = advise_source(tmp_path, WRAPPED)
    assert data["script_does"]["autocast"] == "bf16" and data["script_does"]["checkpointed"] == ["1", "2"]
    assert "  checkpointed: 1, 2" in r.stdout
    names = {p["plan"] for p in data["plans"]}
    assert not any("bf16" in n or "ckpt" in n for n in names) and {"baseline", "accum2", "offload_act"} <= names
    assert data["skipped"]["bf16+ckpt"] == "the script already runs its forward under bf16 autocast"
    assert data["skipped"]["ckpt+accum2"] == "the script already checkpoints the repeated blocks"


def test_the_watch_sees_parameters_in_16_bits():
    """A forward whose parameters are bf16 (a cast model; FSDP's MixedPrecisionPolicy
    gathers them so) computes in bf16 without autocast: no bf16 plan is offered."""
    from memprof.advisor import default_plans
    from memprof.script_advice import _Watch, what_is_done

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(torch.bfloat16)
    opt = torch.optim.AdamW(net.parameters())
    watch = _Watch(net, opt)
    net(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    watch.step()
    facts = watch.close()
    assert (facts.autocast, facts.forward_dtype, facts.parameters) == (None, "bf16", {"bf16": 8 * 8 + 8 + 8 + 1})
    assert facts.lines()[0] == "mixed precision: bf16 parameters in forward"
    plans = {name: make() for name, make in default_plans().items()}
    skipped = what_is_done(plans, facts, net, "script")
    assert set(skipped) == {name for name in plans if "bf16" in name}
    assert skipped["bf16+accum2"] == "the script's forward already computes with bf16 parameters"


def test_micro_batches_must_divide_the_batch():
    from contextlib import ExitStack

    from memprof.script_advice import ScriptFacts, apply_to_script
    from memprof.strategies import Accumulation

    net = nn.Linear(8, 1)
    facts = ScriptFacts(batch={"x": ([4, 8], "fp32")})
    with ExitStack() as stack:
        # the tensor and dimension it was taken from: a time-major batch (35 steps x 20) is not 35 samples
        with pytest.raises(ValueError, match=r"a batch of 4 samples \(dimension 0 of x \(4, 8\)\) cannot be cut "
                                             "into 8 micro-batches of equal size; where the batch is not the first"):
            apply_to_script([Accumulation(8)], net, torch.optim.SGD(net.parameters(), lr=0.1), True, stack, facts)
        w = apply_to_script([Accumulation(2)], net, torch.optim.SGD(net.parameters(), lr=0.1), True, stack, facts)
        assert w.micro_batches == 2


@pytest.mark.cuda
@cuda
def test_verify_measures_each_plan_in_a_fresh_run(tmp_path):
    """--verify runs each plan in a process of its own: the step as it is measures what
    the advice measured in its own (first) run of the script, to the byte."""
    out = tmp_path / "advice.json"
    r = memprof("advise", "examples/train_mlp.py", "--budget", "24GiB", "--verify", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    verified = {v["plan"]: v for v in json.loads(out.read_text())["verified"]}
    assert len(verified) >= 2 and not any(isinstance(v.get("error"), str) for v in verified.values())
    base = verified["baseline"]
    assert base["measured_peak_allocated"] == base["predicted_peak_allocated"]
    # The steps measured after the first: a spread of two or more steps, a number >= 0.
    assert all(v["measured_spread"] >= 0 for v in verified.values())
    assert all(0 < v["predicted_device_share"] <= 1 for v in verified.values())


def test_verified_plans_show_their_step_time_error():
    """What `--verify` prints per plan: predicted next to measured, and the step time's error."""
    import pandas as pd
    from rich.console import Console

    from memprof.cli import _verified_table

    df = pd.DataFrame([
        {"plan": "accum2", "predicted_peak_reserved": 3 * 2**30, "measured_peak_reserved": 3 * 2**30 + 2**29,
         "predicted_seconds": 0.110, "predicted_device_share": 0.98, "measured_seconds": 0.100,
         "measured_spread": 0.07, "fits_budget": True},
        {"plan": "accum4", "predicted_peak_reserved": 2 * 2**30, "measured_peak_reserved": 2 * 2**30,
         "predicted_seconds": 0.150, "predicted_device_share": 0.6, "measured_seconds": 0.200,
         "measured_spread": 0.3, "fits_budget": True},
        {"plan": "ckpt", "error": "OutOfMemoryError: CUDA out of memory."},
    ]).set_index("plan")
    console = Console(width=200, record=True)
    console.print(_verified_table(df))
    text = console.export_text()
    lines = [line.split() for line in text.splitlines()]
    assert ["accum2", "3.00", "GiB", "3.50", "GiB", "110.0", "ms", "100.0", "ms", "+10", "%", "7", "%", "yes"] in lines
    # A host-bound prediction is marked, and the caption says what the mark means.
    assert ["accum4", "2.00", "GiB", "2.00", "GiB", "150.0", "ms*", "200.0", "ms", "-25", "%", "30", "%", "yes"] in lines
    assert "* host-bound: the host issuing kernels" in text
    assert ["ckpt", "OutOfMemoryError:", "CUDA", "out", "of", "memory.", "no"] in lines
    # Without host-bound predictions (or without the column), no mark and no caption.
    console = Console(width=200, record=True)
    console.print(_verified_table(df.drop(index="accum4").drop(columns="predicted_device_share")))
    assert "*" not in console.export_text()


def _advise_with_targets(tmp_path, *targets: str, loss: str = "torch.nn.functional.cross_entropy(model(x), y)",
                         before: str = "y = None") -> dict:
    """``memprof advise`` on a classifier whose ``loss``, outside the model, compares
    its output with targets made by the ``targets`` lines (ending in ``y = ...``)
    in the step, after ``before`` outside the loop."""
    script = tmp_path / "targets.py"
    script.write_text("\n".join([
        "import torch",
        "model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        before,
        "for step in range(6):",
        "    x = torch.randn(32, 64, device='cuda')",
        *(f"    {line}" for line in targets),
        f"    {loss}.backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    out = tmp_path / "advice.json"
    r = memprof("advise", script, "--budget", "24GiB", "--json", out)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_accumulation_cuts_targets_from_a_python_list(tmp_path):
    data = _advise_with_targets(tmp_path, "y = torch.tensor([i % 4 for i in range(32)], device='cuda')")
    assert all("ckpt" in name for name in data["failed"]), data["failed"]  # no repeated blocks, only that
    assert {"accum2", "accum4", "accum8"} <= {p["plan"] for p in data["plans"]}


def test_accumulation_cuts_a_batch_made_before_the_plan_began(tmp_path):
    # The next step's targets are made before this step's optimizer step (a prefetcher's
    # habit: timm's PrefetchLoader copies the next batch while this one trains), so the
    # first step of a plan meets whole targets: the loss takes their first 1/K too.
    data = _advise_with_targets(
        tmp_path, "y_next = torch.randint(0, 4, (32,), device='cuda')",
        loss="torch.nn.functional.cross_entropy(model(x), y if y is not None else y_next)",
        before="y = None")
    data_joined = _advise_with_targets(
        tmp_path, "halves = [torch.full((16,), i, dtype=torch.long, device='cuda') for i in (0, 1)]",
        "y = torch.cat(halves)")  # joined from two halves, not a batch memprof cuts where it is made
    for d in (data, data_joined):
        assert all("ckpt" in name for name in d["failed"]), d["failed"]
        assert {"accum2", "accum4", "accum8"} <= {p["plan"] for p in d["plans"]}


def test_accumulation_leaves_evaluation_whole(tmp_path):
    # pytorch/examples' VAE evaluates under no_grad and reshapes with the batch size it was
    # given (recon_batch.view(args.batch_size, ...)): evaluation is not the step memprof cuts.
    data = _advise_with_targets(
        tmp_path, "y = torch.randint(0, 4, (32,), device='cuda')", "with torch.no_grad():",
        "    xe = torch.randn(32, 64).cuda(); model(xe).view(32, 2, 2)")
    assert all("ckpt" in name for name in data["failed"]), data["failed"]
    assert {"accum2", "accum4", "accum8"} <= {p["plan"] for p in data["plans"]}


def test_accumulation_that_cannot_follow_says_so(tmp_path):
    # The loss compares flattened tensors: the cut output's 16 x 4 values against 32 x 4
    # one-hot targets, a whole batch's samples times their values, which the loss cuts with
    # them; less four values each, neither is a batch's multiple: the step cannot follow.
    targets = ("halves = [torch.full((16,), i, dtype=torch.long, device='cuda') for i in (0, 1)]",
               "y = torch.nn.functional.one_hot(torch.cat(halves), 4).float()")
    data = _advise_with_targets(tmp_path, *targets, loss="torch.nn.functional.mse_loss(model(x).flatten(), y.flatten())")
    assert {"accum2", "accum4", "accum8"} <= {p["plan"] for p in data["plans"]}
    data = _advise_with_targets(
        tmp_path, *targets, loss="torch.nn.functional.mse_loss(model(x).flatten()[:-4], y.flatten()[:-4])")
    assert {"accum2", "accum4", "accum8"} <= set(data["failed"])
    assert "cutting its tensors where they reach the device" in data["failed"]["accum2"]
    assert "The size of tensor a (60) must match the size of tensor b (124)" in data["failed"]["accum2"]


def test_a_micro_batch_too_small_fails_only_plans_that_small(tmp_path):
    # A batch of 8 cut in 8 is a micro-batch of one, which BatchNorm after a global pool
    # refuses, as on a GPU; 2 and 4 micro-batches run, with checkpointing too.
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "class Block(nn.Module):",
        "    def __init__(self):",
        "        super().__init__(); self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())",
        "    def forward(self, x):",
        "        return x + self.body(x)",
        "model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[Block() for _ in range(3)], nn.AdaptiveAvgPool2d(1),",
        "                      nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.Flatten(), nn.Linear(16, 10)).cuda()",
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "for step in range(8):",
        "    x, y = torch.randn(8, 3, 64, 64, device='cuda'), torch.randint(0, 10, (8,), device='cuda')",
        "    nn.functional.cross_entropy(model(x), y).backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    assert {"accum8", "ckpt+accum8", "bf16+accum8"} <= set(data["failed"])
    assert all(p.endswith("accum8") for p in data["failed"] if "accum" in p), data["failed"]
    assert "Expected more than 1 value per channel when training" in data["failed"]["accum8"]
    assert {"accum2", "accum4", "ckpt+accum2", "ckpt+accum4"} <= {p["plan"] for p in data["plans"]}


def test_a_model_trained_through_its_methods_gets_the_same_plans(tmp_path):
    """An RL agent's loop calls agent.act(x), which calls its children; the model's forward
    never runs. bf16, accumulation and offload were bound to that forward only, so every plan
    ran as the step as it is (bf16 "saved" nothing). Now the first of the model's and its
    children's forwards to run applies the plan: the plans equal those of the same agent
    called as agent(x)."""
    def script(call: str) -> str:
        return "\n".join([
            "import torch, torch.nn as nn",
            "class Agent(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            "        self.body = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU())",
            "        self.head = nn.Linear(512, 1)",
            "    def act(self, x):",
            "        return self.head(self.body(x))",
            "    forward = act",
            "agent = Agent().cuda()",
            "opt = torch.optim.Adam(agent.parameters())",
            "for step in range(8):",
            f"    loss = {call}(torch.randn(4096, 512, device='cuda')).mean()",
            "    opt.zero_grad(); loss.backward(); opt.step()",
        ]) + "\n"

    (tmp_path / "m").mkdir()
    (tmp_path / "f").mkdir()
    method, _ = advise_source(tmp_path / "m", script("agent.act"))
    called, _ = advise_source(tmp_path / "f", script("agent"))
    # Peak allocated and step time alike; reserved may differ by a block, as autocast's cache of
    # bf16 weights empties where each child's autocast ends instead of the model's.
    plans = {p["plan"]: (p["peak_allocated"], p["seconds"]) for p in called["plans"]}
    assert {p["plan"]: (p["peak_allocated"], p["seconds"]) for p in method["plans"]} == plans
    assert plans["bf16"][0] < plans["baseline"][0] and plans["accum2"][0] < plans["baseline"][0]
    assert called["script_does"]["batch"] == {"x": [[4096, 512], "fp32"]}  # the model's argument
    assert method["script_does"]["batch"] == {"input": [[4096, 512], "fp32"]}  # its body's


def test_a_failing_checkpoint_fails_no_plan_without_it(tmp_path):
    """Blocks whose recomputation differs from their forward (a path taken outside backward
    only) break every checkpointing plan; ckpt+accum2's failure failed bf16+accum2/4/8 too,
    as if their micro-batches had been the cause. Plans without checkpointing now run."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "class Block(nn.Module):",
        "    def __init__(self):",
        "        super().__init__(); self.fc = nn.Linear(256, 256)",
        "    def forward(self, x):",
        "        y = self.fc(x)",
        "        if torch._C._current_graph_task_id() == -1:",
        "            y = y * torch.sigmoid(y)",
        "        return x + torch.relu(y)",
        "model = nn.Sequential(*[Block() for _ in range(3)], nn.Linear(256, 10)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(8):",
        "    x, y = torch.randn(64, 256, device='cuda'), torch.randint(0, 10, (64,), device='cuda')",
        "    nn.functional.cross_entropy(model(x), y).backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    assert data["failed"] and all("ckpt" in p for p in data["failed"]), data["failed"]
    assert "CheckpointError" in data["failed"]["ckpt"]
    assert {"accum2", "accum4", "accum8", "bf16+accum2", "bf16+accum4", "bf16+accum8"} <= {
        p["plan"] for p in data["plans"]}


def test_accumulation_that_fails_on_a_sequence_first_batch_says_so(tmp_path):
    """nn.Transformer lays out its batch sequence first (S, N, E): memprof cuts the first
    dimension, the sequence, and the padding masks (N, S) no longer match. The plans fail,
    saying which module takes its batch that way; checkpointing the layers runs."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2, num_decoder_layers=2,",
        "                       dim_feedforward=128).cuda()",
        "opt = torch.optim.Adam(model.parameters())",
        "for step in range(8):",
        "    src, tgt = torch.randn(24, 16, 64, device='cuda'), torch.randn(20, 16, 64, device='cuda')",
        "    pad = torch.zeros(16, 24, dtype=torch.bool, device='cuda')",
        "    out = model(src, tgt, src_key_padding_mask=pad, memory_key_padding_mask=pad)",
        "    out.square().mean().backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    assert {"accum2", "accum4", "accum8"} <= set(data["failed"])
    assert "Transformer takes its batch sequence first" in data["failed"]["accum2"]
    assert "ckpt" in {p["plan"] for p in data["plans"]}


def test_two_optimizers_over_one_model(tmp_path):
    # SGD for one layer, Adam for the other: each optimizer's step ended a plan's step, so
    # accumulation's was Adam's step alone, predicted 4 times faster than the baseline.
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()",
        "opt1 = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9, nesterov=True)",
        "opt2 = torch.optim.Adam(model[2].parameters(), lr=1e-3)",
        "for step in range(10):",
        "    loss = model(torch.randn(512, 1024, device='cuda')).square().mean()",
        "    opt1.zero_grad(); opt2.zero_grad()",
        "    loss.backward()",
        "    opt1.step(); opt2.step()",
    ]) + "\n")
    seconds = {p["plan"]: p["seconds"] for p in data["plans"]}
    assert seconds["baseline"] < seconds["accum2"] < seconds["accum4"] < seconds["accum8"]


EVALUATING = """\
import torch, torch.nn as nn
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    if {every} and step % {every} == {every} - 1:  # a validation pass, four times the batch, every few steps
        model.eval()
        with torch.no_grad():
            model(torch.randn(4096, 1024, device="cuda"))
        model.train()
    model(torch.randn(1024, 1024, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_an_evaluation_between_steps_is_no_plans_step(tmp_path):
    """A validation every few steps fell into whichever plan's step it met: accumulation plans
    peaked at the evaluation's 4096 rows, not their micro-batches'. A step with an evaluation in it
    is not a plan's: every plan's peak allocated is the one it has without the evaluations."""
    peaks, reserved = [], []
    for every in (0, 3):
        data, _ = advise_source(tmp_path, EVALUATING.format(every=every))
        peaks.append({p["plan"]: p["peak_allocated"] for p in data["plans"]})
        reserved.append({p["plan"]: p["peak_reserved"] for p in data["plans"] if p["plan"] != "baseline"})
    assert set(peaks[0]) == set(peaks[1]) and {"baseline", "accum2", "accum4", "bf16+accum8"} <= set(peaks[0])
    assert peaks[1] == peaks[0]
    # Nor is what the evaluation cached (4 x the batch): an accumulation plan reserves what its own step
    # does. (The bf16 plans still reserve up to 68 MiB more after an evaluation: left open.)
    accumulating = ("accum2", "accum4", "accum8")
    assert [reserved[1][p] for p in accumulating] == [reserved[0][p] for p in accumulating]
    # Above a budget the evaluation is said to be what does not fit, whatever the plan
    _, r = advise_source(tmp_path, EVALUATING.format(every=3), budget="100MiB")
    said = r.stdout + r.stderr
    assert "an evaluation between the script's training steps" in said and "above the budget" in said, said


VALIDATING_AFTER_THE_STEP = """\
import torch
import torch.nn.functional as F
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(7):
    x = torch.randn(64, 1024, device="cuda")
    F.mse_loss(model(x), x).backward()
    opt.step(); opt.zero_grad()
    if {validate} and step % 3 == 0:  # at the first step too, as nanoGPT and the Reformer's enwik8 script do
        model.eval()
        with torch.no_grad():
            model(torch.randn(65536, 1024, device="cuda")).sum().item()
        model.train()
"""


def test_a_validation_after_the_first_step_is_in_no_plans_peak(tmp_path):
    """A validation of 1024 x the batch after steps 0, 3 and 6: in the first tracked step of each
    run of the script. That step was the step as it is (870 MiB reserved against 102, and state
    offload, made from its samples, as much above), and the first of a plan in a later run;
    and where the cache was emptied after a validation the next step's peak reserved kept it."""
    reserved, evaluation = [], []
    for validate in (False, True):
        data, _ = advise_source(tmp_path, VALIDATING_AFTER_THE_STEP.format(validate=validate))
        reserved.append({p["plan"]: p["peak_reserved"] for p in data["plans"]})
        evaluation.append(data["evaluation_peak_allocated_bytes"])
    plans = ["baseline", "accum2", "accum4", "accum8", "offload_act", "offload_states", "bf16", "bf16+offload_states"]
    assert [reserved[1][p] for p in plans] == [reserved[0][p] for p in plans]
    assert evaluation[0] == 0 and evaluation[1] > 512 * 2**20  # two 256 MiB activations, said apart


def test_another_optimizer_over_the_models_parameters_is_tracked_with_it(tmp_path):
    """Muon beside AdamW (modded-nanogpt): SGD with momentum for the hidden layer, Adam for the head.
    The advisor followed the first optimizer only: the second's momentum (4 MiB) was temporaries in
    every plan, and its step fell into the next step. Both are the model's optimizers, as ``track`` has them,
    each named with its own implementation (the facts once gave the first's to both)."""
    from memprof.script_advice import advise_script

    script = tmp_path / "two_optimizers.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 256, bias=False)).cuda()
        adam = torch.optim.Adam([model[2].weight], lr=1e-3, fused=True)
        sgd = torch.optim.SGD([model[0].weight], lr=0.1, momentum=0.9, foreach=False)
        for step in range(30):
            model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
            for o in (adam, sgd):
                o.step()
            model.zero_grad(set_to_none=True)
    """))
    advice = advise_script(str(script), budget="24GiB", target="h200", progress=False)
    # fused Adam keeps its step count on the device: a 0-d fp32 tensor, one 512-byte block
    assert advice.baseline.optimizer_state == {"exp_avg": MiB, "exp_avg_sq": MiB, "step": 512,
                                               "momentum_buffer": 4 * MiB}
    assert (advice.facts.optimizer, advice.facts.implementation) == ("Adam + SGD", "fused + for-loop")
    assert "optimizer: Adam (fused) + SGD (for-loop)" in advice.facts.lines()


def test_plans_run_on_batches_of_other_shapes_say_so(tmp_path):
    """Dynamic padding (Hugging Face's DataCollatorWithPadding): each batch is as long as its longest
    sequence, so each plan's step ran on a batch of another length, and the table compared the batches
    as much as the plans (a BERT-base advise recommended activation offload measured on sequences of
    268 where the script's longest are 512). The shapes seen are said; fixed shapes say nothing."""
    data, r = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1000)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(40):",
        "    ids = torch.randint(0, 1000, (8, (128, 64, 32)[step % 3])).cuda()",
        "    nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    assert data["varying_batch_shapes"] == [[[32]], [[64]], [[128]]]
    assert "the script's batches change shape from step to step (3 shapes" in r.stdout + r.stderr
    fixed, _ = advise_source(tmp_path, EVALUATING.format(every=0))
    assert fixed["varying_batch_shapes"] == []
    # a model called twice a step on inputs of two shapes (a knowledge graph's positives, then its
    # negatives): the same step every time, no change of shape
    twice, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(40):",
        "    pos, neg = torch.randint(0, 1000, (8, 3)).cuda(), torch.randint(0, 1000, (8, 64)).cuda()",
        "    (model(neg).mean() - model(pos).mean()).backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    assert twice["varying_batch_shapes"] == []
    # two micro-batches a step and an evaluation every third: a run of the script stops at its step
    # limit mid-step, and that step's forwards are no step's (they joined the next run's first: 4 for 2)
    cut_short, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)], nn.Linear(256, 10))",
        "model = model.cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(60):",
        "    for _ in range(2):",
        "        x, y = torch.randn(32, 256, device='cuda'), torch.randint(0, 10, (32,), device='cuda')",
        "        nn.functional.cross_entropy(model(x), y).backward()",
        "    opt.step(); opt.zero_grad()",
        "    if step % 3 == 2:",
        "        model.eval()",
        "        with torch.no_grad():",
        "            model(torch.randn(32, 256, device='cuda'))",
        "        model.train()",
    ]) + "\n")
    assert cut_short["varying_batch_shapes"] == []


def test_an_evaluation_with_gradients_on_is_not_cut(tmp_path):
    """The Hugging Face Trainer's evaluation loop, after model.eval(), moves its batch to the device and
    pads predictions with gradients on (only the forward runs under no_grad): the accumulation plans cut
    those tensors as a training batch's (a batch of 8 became 1 under accum8)."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(40):",
        "    model.train()",
        "    model(torch.randn(8, 16).cuda()).square().mean().backward()",
        "    opt.step(); opt.zero_grad()",
        "    if step % 4 == 3:",
        "        model.eval()",
        "        batch = torch.randn(8, 16).cuda()",
        "        with torch.no_grad():",
        "            out = model(batch)",
        "        padded = out.new_full((8, 16), -100.0)",
        f"        open({str(tmp_path / 'shapes.txt')!r}, 'a').write(f'{{len(batch)}} {{len(out)}} {{len(padded)}}\\n')",
    ]) + "\n")
    assert not {"accum2", "accum4", "accum8"} & set(data["failed"]), data["failed"]
    shapes = (tmp_path / "shapes.txt").read_text().split()
    assert shapes and set(shapes) == {"8"}


def test_accumulation_zeroes_a_sequence_parallel_gradient_pending_its_reduction(monkeypatch):
    """A sequence-parallel norm's weight gradient is a DTensor pending its reduction (Partial), which
    refuses the in-place zero accumulation asks of zero_grad ("in-place operations that require placement
    changes are not supported"): every plan of the tensor-parallel tutorial's Llama failed, said to be the
    script's end. Its local tensor is zeroed instead."""
    from memprof.script_advice import advise_script
    from memprof.strategies import Accumulation, ActivationOffload

    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29512")):
        monkeypatch.setenv(name, value)
    script = Path(__file__).parents[1] / "benchmarks" / "scripts" / "tp_llama.py"
    advice = advise_script(str(script), ["--steps", "12"], budget="24GiB", target="h200", progress=False,
                           plans={"accum2": lambda: [Accumulation(2)], "offload_act": lambda: [ActivationOffload()]})
    assert "accum2" not in advice.failed, advice.failed
    assert "accum2" in advice.table.index
    # save_on_cpu copies a DTensor's saved activations into a plain tensor, which PyTorch refuses
    assert advice.skipped["offload_act"].startswith("the script shards the model by tensor parallelism")


def test_accumulation_of_a_nested_jagged_batch_says_why_it_cannot_run():
    """Sequences packed as one nested jagged tensor: PyTorch slices none along its batch, and the plans
    failed with its slicing error at a line of the script; they say what memprof cannot cut."""
    from memprof.script_advice import advise_script
    from memprof.strategies import Accumulation

    script = Path(__file__).parents[1] / "benchmarks" / "scripts" / "jagged_packing.py"
    advice = advise_script(str(script), ["--steps", "12"], budget="24GiB", target="h200", progress=False,
                           plans={"accum2": lambda: [Accumulation(2)]})
    assert "the batch is a nested jagged tensor" in advice.failed["accum2"]


def test_micro_batch_cut_takes_the_batch_where_it_reaches_the_device():
    import torch

    from memprof.script_advice import _MicroBatchCut

    seen = []
    whole = torch.ones(8, 5, device="meta")  # a batch made before the cut began
    weight = torch.nn.Parameter(torch.ones(8, device="meta"))
    stats = torch.ones(8, device="meta")  # a second model's batch norm, as many channels as samples
    cut = _MicroBatchCut(2, batch=8, script_micro_batches=3)
    forward = cut.wrap(lambda x, n: seen.append((tuple(x.shape), tuple(torch.arange(n, device="meta").shape))))
    with cut:
        assert cut.sizes == {8, 24}
        assert torch.randint(0, 9, (8,), device="meta").shape == (4,)  # made there
        assert torch.ones(8, 5).to("meta").shape == (4, 5)  # copied to the device: half of it
        assert torch.ones(24).to("meta").shape == (12,)  # a batch the script splits in 3 itself
        # once a batch came from the host, what is made on the device is the step's own: drop-path
        # noise of two views of 4 joined
        assert torch.rand(8, 1, 1, device="meta").shape == (8, 1, 1)
        assert torch.ones(8).shape == (8,)  # on the host: not yet the batch
        assert torch.ones(6, 8, device="meta").shape == (6, 8)  # not of the batch's size
        forward(torch.ones(8, 2, device="meta"), 8)  # given whole: cut; the model's own tensors: not
        forward(torch.ones(4, 2, device="meta"), 8)
        part = torch.ones(4, 5, device="meta")
        assert torch.nn.functional.mse_loss(part, whole, reduction="none").shape == (4, 5)  # a loss: cut
        assert (part.argmax(1) == whole[:, 0]).shape == (4,)  # accuracy: cut
        assert torch.nn.functional.mse_loss(part[:, 0], weight[:4]).shape == ()
        assert torch.cat([part, whole]).shape == (12, 5)  # joined, not compared: not cut
        assert torch.nn.functional.batch_norm(torch.ones(4, 8, device="meta"), stats, stats).shape == (4, 8)
    assert seen == [((4, 2), (8,)), ((4, 2), (8,))]


def test_micro_batch_cut_takes_the_parts_a_script_joins_into_the_batch():
    """DPO's chosen and rejected answers reach the device apart, 8 pairs each, and are joined into
    the model's batch of 16: each part is cut, so the joined batch is the micro-batch's (and the
    frozen reference model's inputs, and the labels the loss gathers with, are too)."""
    import torch

    from memprof.script_advice import _MicroBatchCut

    seen = []
    cut = _MicroBatchCut(2, batch=16)
    forward = cut.wrap(lambda ids: seen.append(tuple(ids.shape)))
    with cut:
        chosen, rejected = (torch.ones(8, 32, dtype=torch.long).to("meta") for _ in range(2))
        assert chosen.shape == rejected.shape == (4, 32)
        forward(torch.cat([chosen, rejected]))  # 8: not cut again
        assert torch.ones(5, 32).to("meta").shape == (5, 32)  # no part of the batch
        assert torch.ones(4, 32).to("meta").shape == (2, 32)  # a quarter: a part too (four views)
        assert torch.ones(16, 32).to("meta").shape == (8, 32)  # the batch whole: cut as before
    assert seen == [(8, 32)]
    assert _MicroBatchCut(4, batch=16)._joined == {16, 8, 4}
    assert _MicroBatchCut(8, batch=16)._joined == {16, 8}


def test_micro_batch_cut_leaves_host_data_made_from_the_cut_batch_alone():
    """RAFT adds noise made on the host at its images' shape: after the images (16) are copied
    and cut to 8, the noise of 8 is the micro-batch's own, not a half of the batch to cut again."""
    import torch

    from memprof.script_advice import _MicroBatchCut

    with _MicroBatchCut(2, batch=16):
        image = torch.ones(16, 3, 8, 8).to("meta")
        noise = torch.randn(*image.shape).to("meta")
        assert image.shape == noise.shape == (8, 3, 8, 8)
        assert (image + noise).shape == (8, 3, 8, 8)
        assert torch.ones(16).to("meta").shape == (8,)  # the batch whole: still cut


def test_micro_batch_cut_leaves_a_collators_work_on_the_host_alone():
    """A script that accumulates 2 micro-batches of 16 itself: 16 rows are a whole batch and a
    micro-batch of 32 at once. Its collator's ``labels.masked_fill(mask.ne(1), -100)`` (Hugging
    Face's CTC and Whisper collators) meets nothing of another size and stays whole; a loss that
    meets 8 rows beside 16 cuts the 16."""
    import torch

    from memprof.script_advice import _MicroBatchCut

    mask, labels = torch.ones(16, 5, dtype=torch.long), torch.zeros(16, 5, dtype=torch.long)
    with _MicroBatchCut(2, batch=16, script_micro_batches=2) as cut:
        assert labels.masked_fill(mask.ne(1), -100).shape == (16, 5)
        assert torch.nn.functional.mse_loss(torch.ones(8, 5), labels.float(), reduction="none").shape == (8, 5)
    assert cut.cuts == 1


def test_the_batch_in_a_list_argument():
    """DINO's ``model(crops)``: each crop a batch of one view's size; torchvision's detectors'
    ``model(images, targets)``: one image per sample, as a list of as many target dicts says."""
    import torch

    from memprof.script_advice import ScriptFacts, tensor_shapes

    crops = [torch.ones(32, 3, 224, 224)] * 2 + [torch.ones(32, 3, 96, 96, dtype=torch.bfloat16)]
    shapes = tensor_shapes({"x": crops})
    assert shapes == {"x[0]": ([32, 3, 224, 224], "fp32"), "x[1]": ([32, 3, 224, 224], "fp32"),
                      "x[2]": ([32, 3, 96, 96], "bf16")}
    assert ScriptFacts(batch=shapes).batch_size == 32
    images, targets = [torch.ones(3, 480, 640)] * 4, [{"boxes": torch.ones(5, 4)}] * 4
    shapes = tensor_shapes({"images": images, "targets": targets})
    assert shapes == {"images": ([4, 3, 480, 640], "fp32")} and ScriptFacts(batch=shapes).batch_size == 4
    # NVIDIA's Tacotron 2: one tuple of the padded text, its lengths, the mels and the longest length (an int);
    # a model given the collated dict.
    inputs = (torch.ones(8, 40, dtype=torch.long), torch.ones(8, dtype=torch.long), torch.ones(8, 80, 40), 40)
    assert tensor_shapes({"inputs": inputs}) == {"inputs[0]": ([8, 40], "int64"), "inputs[1]": ([8], "int64"),
                                                 "inputs[2]": ([8, 80, 40], "fp32")}
    assert tensor_shapes({"batch": {"ids": torch.ones(6, 9, dtype=torch.long), "n": 3}}) == {
        "batch['ids']": ([6, 9], "int64")}


def test_accumulation_of_a_model_given_one_tuple(tmp_path):
    """Tacotron 2's habit: the model takes one tuple (with an int in it), the loss compares its output with
    the same copied mels held apart as targets. The batch (8) was not found in the tuple, so nothing was
    cut where it reached the device: the targets stayed whole against the micro-batch's output and every
    accumulation plan failed (PyTorch's broadcast error). Now the copy is cut: the input of 8 x 256 x 256
    fp32 (2 MiB), which is also the targets, runs as K micro-batches of 1/K each."""
    from memprof.advisor import default_plans
    from memprof.script_advice import advise_script

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(256, 256)

            def forward(self, inputs):
                mels, max_len = inputs
                return self.fc(mels[:, :max_len])

        model = Net().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(12):
            mels = torch.randn(8, 256, 256).to("cuda", non_blocking=True)
            x, y = (mels, 256), mels
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    """))
    plans = {k: v for k, v in default_plans().items() if k in ("baseline", "accum2", "accum4")}
    advice = advise_script(str(script), budget="24GiB", target="h200", plans=plans, progress=False)
    assert advice.failed == {} and advice.facts.batch_size == 8
    saved = {k: advice.table.loc["baseline", "peak_allocated"] - advice.table.loc[f"accum{k}", "peak_allocated"]
             for k in (2, 4)}
    # at least the input's cut half (the output and its gradient shrink alike), more with more micro-batches
    assert saved[2] >= MiB and saved[4] > saved[2]


def test_a_later_micro_batch_carries_the_earlier_ones_sparse_rows():
    """A sparse embedding's gradient is summed by concatenating rows: after 3 micro-batches of 6
    lookups, the 4th of an accumulation plan's K=4 runs beside 18 rows, and the step ends with 24,
    the whole batch's. zero_grad leaves the 18 (zeros, so training is unchanged); a second
    zero_grad (the model's after the optimizer's) adds none; a dense weight's gradient is kept."""
    import torch
    from torch import nn

    from memprof.script_advice import _later_micro_batches

    model = nn.Sequential(nn.Embedding(100, 4, sparse=True), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    table = model[0].weight
    with _later_micro_batches(model, opt, 4):
        assert table.grad is None and model[1].weight.grad.shape == (1, 4)
        for step in range(2):
            model(torch.arange(1, 7)).sum().backward()  # (the host's kernel merges a row found on both sides)
            assert table.grad.is_sparse and table.grad._nnz() == (6 if step == 0 else 24)
            opt.step()
            opt.zero_grad()
            model.zero_grad()
            assert table.grad._nnz() == 18 and float(table.grad._values().abs().sum()) == 0
    with _later_micro_batches(model, opt, 1):  # one micro-batch: nothing carried
        model(torch.arange(1, 7)).sum().backward()
        opt.zero_grad()
        assert table.grad._nnz() == 0


def test_micro_batch_cut_takes_per_sample_lists_given_to_the_model():
    """DETR takes one target dict per image (``labels=[{"class_labels", "boxes"}, ...]``), torchvision's
    detectors a list of images and one of targets: the lists are cut with the batch, their items'
    tensors are left whole (an image's 8 boxes are no batch of 8), and a list that is not one item
    per sample (per-layer tensors, each of the batch's size) is cut as tensors are."""
    import torch

    from memprof.script_advice import _MicroBatchCut

    seen = []
    cut = _MicroBatchCut(2, batch=8)
    forward = cut.wrap(lambda pixels, labels=None, images=(), layers=(), names=(): seen.append(
        (tuple(pixels.shape), [tuple(t["boxes"].shape) for t in labels], len(images), [tuple(t.shape) for t in layers],
         names)))
    labels = [{"class_labels": torch.ones(n, dtype=torch.long, device="meta"), "boxes": torch.ones(n, 4, device="meta")}
              for n in (8, 3, 5, 1, 2, 7, 6, 4)]
    pixels, images, layers = (torch.ones(*shape, device="meta") for shape in ((8, 3, 32, 32), (3, 32, 32), (8, 2)))
    with cut:  # all made before: cut by the forward alone
        forward(pixels, labels=labels, images=[images] * 8, layers=[layers] * 3, names=tuple("abcdefgh"))
        forward(pixels, labels=labels[:5])  # not of the batch's length: no list of samples, its tensors cut as any
    assert seen == [((4, 3, 32, 32), [(8, 4), (3, 4), (5, 4), (1, 4)], 4, [(4, 2)] * 3, ("a", "b", "c", "d")),
                    ((4, 3, 32, 32), [(4, 4), (3, 4), (5, 4), (1, 4), (2, 4)], 0, [], ())]
    assert cut.cuts == 10  # 2 pixel batches, 3 layers, 3 lists, and the second call's 8 labels and 8 boxes


CLASSIFIER = """\
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU())
                                     for _ in range(4)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x.mean((2, 3)))

model = Net().cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.cuda.amp.GradScaler()
loader = DataLoader(TensorDataset(torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))), batch_size=32,
                    pin_memory=True, drop_last=True)
for x, y in loader:
    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    with torch.cuda.amp.autocast():
        loss = nn.functional.cross_entropy(model(x), y, label_smoothing=0.1)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_a_classifier_gets_checkpointing_and_accumulation(tmp_path):
    """A classifier written the common way: blocks that are nn.Sequential(conv,
    norm, act) in a ModuleList, batches from a DataLoader copied to the GPU, the
    loss outside the model against the targets."""
    data, _ = advise_source(tmp_path, CLASSIFIER)
    # channels-last weights, which FSDP2 does not shard: state offload fails before any step
    assert set(data["failed"]) == {"offload_states", "bf16+offload_states"}
    assert all("stem.weight is not contiguous (channels_last)" in why for why in data["failed"].values())
    plans = {p["plan"]: p for p in data["plans"]}
    assert {"ckpt", "accum2", "accum4", "ckpt+accum2"} <= set(plans)
    # Its 4 blocks are checkpointed; fewer samples a micro-batch hold less.
    for plan in ("ckpt", "accum2"):
        assert plans[plan]["peak_allocated"] < plans["baseline"]["peak_allocated"]
    assert plans["accum4"]["peak_allocated"] < plans["accum2"]["peak_allocated"]


@pytest.mark.parametrize("iterations", [2, 4])
def test_a_script_too_short_is_reported_not_a_crash(tmp_path, iterations):
    """A short script with two optimizers (SparseAdam beside Adam). Of four iterations the plans
    see all they need (each optimizer's step ended a plan's step, so a plan's step was under way
    when the script ended: the advice stopped with an IndexError); two end before the baseline's
    step did (an AttributeError): one line says so."""
    script = tmp_path / "short.py"
    script.write_text("\n".join([
        "import torch",
        "from torch import nn",
        "emb, head = nn.Embedding(1024, 256, sparse=True).cuda(), nn.Linear(256, 1).cuda()",
        "sparse, dense = torch.optim.SparseAdam(list(emb.parameters())), torch.optim.Adam(head.parameters())",
        f"for i in range({iterations}):",
        "    head(emb(torch.randint(0, 1024, (64, 8), device='cuda')).mean(1)).square().mean().backward()",
        "    sparse.step(); dense.step(); sparse.zero_grad(); dense.zero_grad()",
    ]))
    out = tmp_path / "advice.json"
    r = memprof("advise", str(script), "--target", "h200", "--budget", "1GiB", "--json", out)
    if iterations == 2:
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].endswith(
            "memprof advise needs 3 optimizer steps of the script (the first finds the model); run it for more "
            "steps, e.g. more iterations after --")
        return
    assert r.returncode == 0, r.stderr[-3000:]
    advice = json.loads(out.read_text())
    assert advice["best"] is not None and {"accum2", "bf16", "offload_act"} <= {p["plan"] for p in advice["plans"]}


MANUAL_UPDATE = """\
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

model = nn.Sequential(*[Block(512) for _ in range(4)]).cuda()
x, y = torch.randn(4096, 512, device="cuda"), torch.randn(4096, 512, device="cuda")
for i in range(100):
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.01)
"""


def test_a_script_without_an_optimizer_gets_the_plans_that_need_none(tmp_path):
    """pytorch/examples' word language model updates the parameters itself: mixed precision,
    checkpointing and accumulation apply; sharding and offloading an optimizer's state do not."""
    data, _ = advise_source(tmp_path, MANUAL_UPDATE)
    assert data["script_does"]["optimizer"] == "none"
    assert data["failed"] == {}
    sharding = {name for name, why in data["skipped"].items() if "no optimizer's state" in why}
    assert sharding == {"offload_states", "bf16+offload_states"}  # the default plans that shard, on one rank
    plans = {p["plan"]: p for p in data["plans"]}
    assert {"baseline", "bf16", "ckpt", "accum2"} <= set(plans)
    for plan in ("bf16", "ckpt", "accum2"):
        assert plans[plan]["peak_allocated"] < plans["baseline"]["peak_allocated"]


def test_a_plan_first_in_a_run_of_the_script_starts_from_an_empty_cache(tmp_path):
    """The script ends after the step as it is, so bf16 runs first in a second run of it: the
    blocks the fp32 step before it cached are not its own (a run with bf16 from the start, or
    its measurement, would not have them). It predicts as when it follows the step as it is."""
    from memprof.script_advice import advise_script
    from memprof.strategies import Autocast

    script = tmp_path / "t.py"
    script.write_text("\n".join([
        "import sys, torch",
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 1024)).cuda()",
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "for step in range(int(sys.argv[1])):",
        "    model(torch.randn(4096, 1024, device='cuda')).square().mean().backward()",
        "    opt.step(); opt.zero_grad()",
    ]) + "\n")
    peaks = {}
    for iterations in ("4", "40"):  # 4: 1 to find the model, 2 as it is, and the script ends
        a = advise_script(str(script), [iterations], budget="24GiB", target="h200", progress=False,
                          plans={"bf16": lambda: [Autocast("bf16")]})
        # (less the cache layout the script's step leaves, which only the longer run has steps to measure)
        peaks[iterations] = [a.table.loc["bf16", "peak_allocated"], a.table.loc["bf16", "peak_reserved"] - a.cache_excess]
    assert peaks["4"] == peaks["40"]


# AssemblyAI's speech-recognition tutorial: log_softmax and nn.CTCLoss outside the model, with
# per-utterance lengths as Python lists.
CTC = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(3)])
        self.classifier = nn.Linear(128, 29)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.classifier(x)

model = Model().cuda()
criterion = nn.CTCLoss(blank=28, zero_infinity=True)
optimizer = torch.optim.AdamW(model.parameters(), 5e-4)
for step in range(40):
    spectrograms = torch.randn(32, 200, 128).cuda()
    labels = torch.randint(0, 28, (32, 40)).float().cuda()
    input_lengths = [200 - (i % 7) for i in range(32)]
    label_lengths = [40 - (i % 5) for i in range(32)]
    optimizer.zero_grad()
    output = F.log_softmax(model(spectrograms), dim=2).transpose(0, 1)  # (time, batch, n_class)
    loss = criterion(output, labels, input_lengths, label_lengths)
    loss.backward()
    optimizer.step()
"""


def test_ctc_outside_the_model_gets_every_plan(tmp_path):
    """Accumulation cuts the lengths lists with the batch (a list of 32 lengths against 16
    utterances failed); bf16 runs the loss and the log_softmax before it under autocast, as its
    code change asks (CTC's loss takes no bf16: every bf16 plan failed)."""
    data, _ = advise_source(tmp_path, CTC)
    assert data["failed"] == {}
    plans = {p["plan"]: p for p in data["plans"]}
    assert len(plans) == 20
    assert plans["bf16"]["peak_allocated"] < plans["baseline"]["peak_allocated"]
    assert plans["accum2"]["peak_allocated"] < plans["baseline"]["peak_allocated"]


def test_an_optimizer_without_a_foreach_option_loops():
    from memprof.script_advice import ScriptFacts

    emb = nn.Embedding(16, 4, sparse=True)
    facts = [ScriptFacts.of(emb, opt) for opt in (torch.optim.SparseAdam(list(emb.parameters())),
                                                  torch.optim.AdamW(emb.parameters()),
                                                  torch.optim.AdamW(emb.parameters(), foreach=False),
                                                  torch.optim.Adafactor(emb.parameters()),
                                                  torch.optim.Adafactor(emb.parameters(), foreach=True))]
    # torch.optim.Adafactor takes its foreach path only when asked (adafactor(): `if foreach:`)
    assert [f.implementation for f in facts] == ["for-loop", "default: foreach on CUDA", "for-loop",
                                                 "default: for-loop", "foreach"]


# Lightning Fabric's own loop: fabric.setup wraps the model in a _FabricModule, whose __setattr__
# passes attributes on to the module it wraps (a plan's forward set on both recursed).
FABRIC = """\
import torch
from torch import nn
import lightning as L

fabric = L.Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
fabric.launch()
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = fabric.setup(model, optimizer)
dataloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2048, 1024)), batch_size=256)
dataloader = fabric.setup_dataloaders(dataloader)
for epoch in range(2):
    for i, (x,) in enumerate(dataloader):
        is_accumulating = i % 2 != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = model(x).square().mean()
            fabric.backward(loss)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    fabric.print(f"epoch {epoch} loss {loss.item():.3f}")
"""


def test_a_lightning_fabric_loop_gets_its_plans(tmp_path):
    data, _ = advise_source(tmp_path, FABRIC)
    does = data["script_does"]
    assert (does["autocast"], does["micro_batches"]) == ("bf16", 2)  # Fabric's precision, its accumulation
    assert all("ckpt" in name for name in data["failed"]), data["failed"]  # no repeated blocks
    plans = {p["plan"]: p for p in data["plans"]}
    assert {"baseline", "accum2", "offload_act"} <= set(plans) and not any("bf16" in p for p in plans)
    assert plans["accum2"]["peak_allocated"] < plans["baseline"]["peak_allocated"]


def test_a_copy_of_the_model_made_during_a_plan_runs_its_own_forward(tmp_path):
    """torchvision's quantization reference copies the model each epoch and evaluates the copy on
    the host: a plan's forward, copied with the module, ran the model the plan was applied to
    ("Tensor on device meta is not on the expected device cpu"), in every plan, the step as it is too."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import copy, torch",
        "model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).cuda()",
        "opt = torch.optim.AdamW(model.parameters())",
        "for step in range(40):",
        "    model(torch.randn(32, 64, device='cuda')).square().mean().backward()",
        "    opt.step(); opt.zero_grad()",
        "    copy.deepcopy(model).cpu()(torch.randn(4, 64))",
    ]) + "\n")
    assert all("ckpt" in name for name in data["failed"]), data["failed"]  # no repeated blocks, only that
    assert {"baseline", "bf16", "accum2", "offload_act"} <= {p["plan"] for p in data["plans"]}


def test_a_frozen_encoder_does_not_make_checkpointing_look_undone():
    """Whisper fine-tuned with ``freeze_encoder()`` and Hugging Face's checkpointing: the decoder's
    layers recompute, the frozen encoder's never run in backward. Checkpointing is done; before,
    the 12 frozen blocks made it look undone and ckpt was advised over the script's own."""
    from memprof.advisor import default_plans
    from memprof.script_advice import ScriptFacts, what_is_done

    def block():
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    net = nn.Module()
    net.encoder, net.decoder = nn.ModuleList(block() for _ in range(3)), nn.ModuleList(block() for _ in range(3))
    net.encoder.requires_grad_(False)
    plans = {name: make() for name, make in default_plans().items()}
    facts = ScriptFacts(checkpointed=["decoder.0", "decoder.1", "decoder.2"])
    skipped = what_is_done(plans, facts, net, "script")
    assert skipped["ckpt"] == "the script already checkpoints the repeated blocks"
    assert "ckpt" not in what_is_done(plans, ScriptFacts(checkpointed=["decoder.0"]), net, "script")
    # A Hugging Face model whose switch is on checkpoints whatever it can, recomputed or not.
    net.is_gradient_checkpointing = True
    assert "ckpt" in what_is_done(plans, ScriptFacts(), net, "script")


def test_the_checkpointing_switch_prefers_the_current_hugging_face_name():
    from memprof.script_advice import _checkpointing_switch

    class Old(nn.Linear):
        supports_gradient_checkpointing = True

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            pass

    class New(Old):
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            pass

    assert _checkpointing_switch(Old(2, 2)) == (
        "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
    assert _checkpointing_switch(New(2, 2)) == (
        "model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})")


def test_optimizers_stepped_in_backward_leave_out_accumulation_and_sharding():
    """Optimizers stepped as each gradient is made keep no gradient past its backward: a
    micro-batch plan could not accumulate, and the sharding and state offload plans are for one
    optimizer stepped after backward. The facts say how the script steps."""
    from memprof.advisor import default_plans
    from memprof.script_advice import _Watch, what_is_done

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opts = {p: torch.optim.AdamW([p]) for p in net.parameters()}

    def step_in_backward(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    watch = _Watch(net, opts[net[0].weight])
    net(torch.randn(4, 8)).sum().backward()
    watch.step()
    facts = watch.close()
    assert facts.in_backward == 4
    assert "optimizer: 4 x AdamW (" in "\n".join(facts.lines())
    plans = {name: make() for name, make in default_plans().items()}
    skipped = what_is_done(plans, facts, net, "script")
    assert {"accum2", "offload_states", "bf16+accum4", "bf16+offload_states"} <= set(skipped)
    assert {"baseline", "bf16", "ckpt", "offload_act"}.isdisjoint(skipped)
    assert skipped["accum2"].startswith("the script's 4 optimizers step inside backward")


def test_every_plan_carries_the_cache_layout_the_scripts_first_step_leaves(tmp_path):
    """A plan's step is simulated on an emptied cache; the script's keeps the layout its first
    step left (Adam's state made among that step's freed activations; the last step's output
    still held when the next forward runs). The script's step run again on an emptied cache
    reserves 40 MiB less here, and each plan's peak reserved carries those 40 MiB."""
    from memprof.advisor import default_plans
    from memprof.script_advice import advise_script

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                                for _ in range(4)]).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(2048, 1024, device="cuda")
        for step in range(20):
            out = model(x)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    """))
    plans = {k: v for k, v in default_plans().items() if k in ("baseline", "ckpt")}
    advice = advise_script(str(script), budget="8GiB", target="h200", plans=plans, progress=False)
    assert advice.cache_excess == 40 * MiB
    # the checkpointed step alone, on an emptied cache: 790 MiB; the script's step: 1014 MiB
    assert advice.table["peak_reserved"].to_dict() == {"baseline": 1014 * MiB, "ckpt": 790 * MiB + 40 * MiB}
    # --verify's run of a plan (here on the simulated H200 in place of a GPU): the script's first step as
    # it is, then the plan on the emptied cache, as the prediction's step ran; the step as it is, whole.
    import functools
    import multiprocessing

    from memprof import script_advice
    from memprof.runner import observe_script

    measured = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(script_advice, "observe_script", functools.partial(observe_script, target="h200"))
        for name in ("baseline", "ckpt"):
            ours, theirs = multiprocessing.Pipe(duplex=False)
            script_advice._measure_plan(theirs, str(script), [], advice.plans[name](), advice.facts, 3)
            measured[name] = ours.recv()["peak_reserved"]
    assert measured == {"baseline": 1014 * MiB, "ckpt": 790 * MiB}


def test_a_module_every_layer_shares_is_not_checkpointed_apart():
    """One rotary embedding shared by every checkpointed layer (torchtune's habit) is named for
    the first layer holding it; recomputed first inside the last layer's backward, it was listed
    as a checkpointed module of its own ("layers.0, layers.0.rope, layers.1, ...")."""
    from torch.utils.checkpoint import checkpoint

    from memprof.script_advice import _Watch

    class Layer(nn.Module):
        def __init__(self, rope: nn.Module) -> None:
            super().__init__()
            self.rope, self.lin = rope, nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(self.rope(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            rope = nn.Tanh()
            self.layers = nn.ModuleList(Layer(rope) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = _Watch(net, opt)
    net(torch.randn(4, 8, requires_grad=True)).sum().backward()
    opt.step()
    watch.step()
    assert watch.close().checkpointed == ["layers.0", "layers.1", "layers.2"]


GRADCACHE = """\
import torch, torch.nn as nn, torch.nn.functional as F
encoder = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 128)).cuda()
opt = torch.optim.AdamW(encoder.parameters())
for step in range(8):
    queries, passages = torch.randn(64, 256).cuda(), torch.randn(64, 256).cuda()
    with torch.no_grad():  # GradCache's first pass: every chunk's embedding, no graph
        q = torch.cat([encoder(c) for c in queries.split(16)])
        p = torch.cat([encoder(c) for c in passages.split(16)])
    q.requires_grad_(), p.requires_grad_()
    F.cross_entropy(q @ p.T / 0.05, torch.arange(q.shape[0], device="cuda")).backward()
    for chunks, cached in ((queries.split(16), q.grad.split(16)), (passages.split(16), p.grad.split(16))):
        for c, g in zip(chunks, cached):  # each chunk again, with its cached gradient
            encoder(c).backward(gradient=g)
    opt.step(); opt.zero_grad()
"""


def test_accumulation_of_a_batch_the_script_encodes_in_chunks(tmp_path):
    """GradCache (the gradcache library's habit) moves 64 queries and 64 passages and calls the model on
    chunks of 16, which memprof took for the batch: the 64-row copies were not cut, and each chunk
    was, to 8 rows against its cached gradient's 16 ("Mismatch in shape: grad_output[0] has a shape of
    [16, 128] and output[0] has a shape of [8, 128]"). A half of the script's whole batch is cut where it
    reaches the device, and the script's chunks of it are left as they are: every accumulation plan runs."""
    data, _ = advise_source(tmp_path, GRADCACHE)
    plans = {p["plan"] for p in data["plans"]}
    assert {"accum2", "accum4", "accum8", "bf16+accum2"} <= plans, data["failed"]
    # (checkpointing finds no repeated blocks in a three-layer MLP: that is all that fails)
    assert all("no repeated blocks" in why for why in data["failed"].values()), data["failed"]


def test_micro_batch_cut_leaves_out_padding_only_other_samples_needed():
    """A collate function pads each batch to its longest sample: a micro-batch collated alone is as
    long as its own longest one. torchaudio's Conformer sizes its padding mask from the lengths it
    is given (``arange(max(lengths)) >= lengths``), and met the whole batch's length: every
    accumulation plan failed. The lengths are the ones the script holds beside the batch."""
    import torch

    from memprof.script_advice import _MicroBatchCut

    wav_lens = torch.tensor([3, 5, 2, 4, 9, 7, 8, 6])
    wavs = torch.zeros(8, 9)
    for i, n in enumerate(wav_lens.tolist()):
        wavs[i, :n] = torch.arange(1, n + 1)
    feats = torch.zeros(8, 80, 9)  # padded along the last dimension
    for i, n in enumerate(wav_lens.tolist()):
        feats[i, :, :n] = 1
    silence = torch.zeros(8, 9)
    silence[:, :6] = 1  # no sample is longer than 6: padded to a fixed length of 9, not to the lengths
    cut = _MicroBatchCut(2, batch=8)
    with cut:
        assert wavs.to("meta").shape == (4, 5)  # the first four are at most 5 long
        assert feats.to("meta").shape == (4, 80, 5)
        assert silence.to("meta").shape == (4, 9)  # positions 5 to 8 are not all padding
        assert torch.ones(8, 9).to("meta").shape == (4, 9)  # not padded
        assert wav_lens.to("meta").shape == (4,)
        lengths = [wav_lens]  # one level into a list
        assert wavs.to("meta").shape == (4, 5)
        del wav_lens, lengths
        assert wavs.to("meta").shape == (4, 9)  # no lengths beside it: as the batch is


def test_a_torch_func_transform_inside_the_forward_leaves_activation_offload_out(tmp_path):
    """A contractive autoencoder's Jacobian penalty, ``vmap(jacrev(encode))`` inside the model's
    forward: the tracker's hooks step aside for it, so the script is observed; activation offload's
    save_on_cpu around the forward would meet the transform, which refuses saved-tensors hooks, as
    on a GPU: left out with PyTorch's reason, not run to fail."""
    from memprof.advisor import default_plans
    from memprof.script_advice import advise_script

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from torch.func import functional_call, jacrev, vmap

        class CAE(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc, self.dec = nn.Linear(64, 16), nn.Linear(16, 64)

            def forward(self, x):
                encode = lambda p, xi: torch.sigmoid(functional_call(self.enc, p, (xi,)))
                jac = vmap(jacrev(encode, argnums=1), in_dims=(None, 0))(dict(self.enc.named_parameters()), x)
                return self.dec(torch.sigmoid(self.enc(x))), jac

        model = CAE().cuda()
        opt = torch.optim.AdamW(model.parameters())
        for step in range(12):
            x = torch.randn(32, 64, device="cuda")
            out, jac = model(x)
            ((out - x).square().mean() + 1e-3 * jac.square().sum()).backward()
            opt.step()
            opt.zero_grad()
    """))
    plans = {k: v for k, v in default_plans().items() if k in ("baseline", "bf16", "offload_act")}
    advice = advise_script(str(script), budget="24GiB", target="h200", plans=plans, progress=False)
    assert advice.facts.transforms_inside == "vmap, grad" and advice.facts.transformed == ""
    assert advice.failed == {} and list(advice.skipped) == ["offload_act"]
    assert "refuses saved-tensors hooks" in advice.skipped["offload_act"]
    assert list(advice.table.index) == ["baseline", "bf16"]


def test_micro_batch_cut_takes_the_lengths_the_padding_follows():
    """Tacotron 2's batch holds two lengths of one longest (the text's and the frames'): the
    stop-token targets, 1 from each sample's last frame on, follow the frames'. Trimmed by the
    text's (the first four's longest is the whole length) they stayed whole while the mels were
    trimmed, and the loss compared 38 frames with 37."""
    import torch

    from memprof.script_advice import _MicroBatchCut

    text_lens = torch.tensor([9, 2, 3, 4, 9, 9, 9, 9])
    frame_lens = torch.tensor([3, 5, 2, 4, 9, 7, 8, 6])
    gate = torch.zeros(8, 9)
    for i, n in enumerate(frame_lens.tolist()):
        gate[i, n - 1:] = 1
    with _MicroBatchCut(2, batch=8):
        assert gate.to("meta").shape == (4, 5)  # the first four's frames are at most 5 long
    assert text_lens.max() == frame_lens.max()


MAML = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.func import functional_call, grad, vmap

net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 5)).cuda()
opt = torch.optim.Adam(net.parameters())


def task_loss(x, y):
    params = dict(net.named_parameters())
    loss = lambda p, x, y: F.cross_entropy(functional_call(net, p, (x,)), y)
    g = grad(loss)(params, x, y)
    fast = {k: params[k] - 0.1 * g[k] for k in params}
    return loss(fast, x, y)


for step in range(4):
    x, y = torch.randn(8, 25, 64, device="cuda"), torch.randint(0, 5, (8, 25), device="cuda")
    opt.zero_grad()
    vmap(task_loss)(x, y).sum().backward()
    opt.step()
"""


def test_a_model_run_inside_torch_func_transforms(tmp_path):
    """functorch's MAML habit: the model runs only inside vmap(grad(...)), on wrappers without
    storages, which the script door read and stopped at ("Cannot access storage of
    TensorWrapper"). Accumulation is left out (what to split is what vmap maps over, the
    tasks), and under grad checkpointing and activation offload too (PyTorch refuses
    saved-tensors hooks there); the other plans run."""
    data, _ = advise_source(tmp_path, MAML)
    check_schema(data)
    assert data["script_does"]["transformed"] == "vmap, grad"
    assert data["failed"] == {}
    skipped = data["skipped"]
    assert {"accum2", "ckpt", "offload_act", "bf16+ckpt+accum8"} <= set(skipped)
    assert "saved tensor hooks" in skipped["ckpt"] and "what vmap maps over" in skipped["accum2"]
    assert {p["plan"] for p in data["plans"]} >= {"baseline", "bf16", "offload_states"}


GCN = """
import torch, torch.nn as nn, torch.nn.functional as F


class GCN(nn.Module):  # tkipf/pygcn's layers: support = x W, output = adj @ support
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(256, 64) * 0.1), nn.Parameter(torch.randn(64, 7) * 0.1)

    def forward(self, x, adj):
        h = F.relu(torch.spmm(adj, torch.mm(x, self.w1)))
        return F.log_softmax(torch.spmm(adj, torch.mm(h, self.w2)), dim=1)


n = 2048
adj = torch.sparse_coo_tensor(torch.randint(0, n, (2, 16384)), torch.rand(16384), (n, n)).cuda()
x, labels = torch.randn(n, 256).cuda(), torch.randint(0, 7, (n,)).cuda()
model = GCN().cuda()
opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
for epoch in range(6):
    opt.zero_grad()
    loss = F.nll_loss(model(x, adj)[:1024], labels[:1024])
    loss.backward()
    opt.step()
"""


def test_a_full_batch_graph_network_with_a_sparse_adjacency(tmp_path):
    """pygcn's habit: the adjacency, a sparse tensor, passed to the model. The script door read
    its storage and stopped ("Cannot access storage of SparseTensorImpl"); the graph is one batch
    whose rows the adjacency couples, so accumulation is left out, with the reason."""
    data, _ = advise_source(tmp_path, GCN)
    check_schema(data)
    assert data["script_does"]["coupled_by"] == "adj"
    # two layers, no repeated blocks: checkpointing has nothing to recompute by
    assert set(data["failed"]) == {"ckpt", "bf16+ckpt"} and "no repeated blocks" in data["failed"]["ckpt"]
    assert "one graph" in data["skipped"]["accum2"] and "bf16+accum8" in data["skipped"]
    assert {"baseline", "bf16", "offload_states"} <= {p["plan"] for p in data["plans"]}


def test_inputs_that_couple_the_batchs_rows():
    """A full-batch graph network's batch is one graph: an N x N adjacency (sparse, or dense beside
    the nodes' features) or PyTorch Geometric's 2 x E edge list beside the features couples its
    rows; a square batch, or token ids alone, do not."""
    from memprof.script_advice import _coupling

    x = torch.randn(100, 16)
    adjacency = torch.sparse_coo_tensor(torch.randint(0, 100, (2, 300)), torch.rand(300), (100, 100))
    assert _coupling({"x": x, "adj": adjacency}) == "adj"
    assert _coupling({"x": x, "adj": torch.rand(100, 100)}) == "adj"
    assert _coupling({"x": x, "edge_index": torch.randint(0, 100, (2, 500))}) == "edge_index"
    assert _coupling({"x": torch.randn(64, 64)}) == ""
    assert _coupling({"input_ids": torch.randint(0, 10, (2, 128))}) == ""
    assert _coupling({"images": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2, 8))}) == ""


FLAT_TARGETS = """
import torch, torch.nn as nn

net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 100)).cuda()
opt = torch.optim.Adam(net.parameters())
for it in range(5):
    x = torch.randn(64, 128, 256).cuda()
    y = torch.randint(0, 100, (64 * 128,)).cuda()  # the targets made flat: batch x sequence rows
    loss = nn.CrossEntropyLoss()(net(x).view(-1, 100), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_targets_made_flat_are_cut_with_the_batch(tmp_path):
    """Targets made flat (64 x 128 token labels as 8192 rows) meet the micro-batch's logits
    flattened to 4096 rows (accum2): the loss cuts them to the micro-batch's share, where every
    accumulation plan failed ("Expected input batch_size (4096) to match target batch_size (8192)")."""
    data, _ = advise_source(tmp_path, FLAT_TARGETS)
    assert all("ckpt" in name for name in data["failed"]), data["failed"]  # no repeated blocks, only that
    plans = {p["plan"]: p for p in data["plans"]}
    assert plans["accum2"]["peak_allocated"] < plans["baseline"]["peak_allocated"]


def test_a_per_sample_loop_over_the_whole_batch_runs_in_a_micro_batch(tmp_path):
    """Inpainting code fills a mask made on the device sample by sample, ``for i in range(B)``: cut
    to a micro-batch, the mask has B / K rows, and index B / K raised IndexError in every
    accumulation plan. On the GPU the batch is whole, so the index is taken within the micro-batch."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn",
        "B = 1024",
        "model = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 256)).cuda()",
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        "for step in range(20):",
        "    x = torch.randn(B, 256, device='cuda')",
        "    m = torch.zeros(B, 256, device='cuda')",
        "    for i in range(B):",
        "        m[i, : (i % 256) + 1] = 1.0",
        "    loss = ((model(x * m) - x) ** 2 * m).mean()",
        "    opt.zero_grad(); loss.backward(); opt.step()",
    ]) + "\n")
    assert not [why for why in data["failed"].values() if "IndexError" in why], data["failed"]
    peaks = {p["plan"]: p["peak_allocated"] for p in data["plans"]}
    assert {"accum2", "accum4", "accum8"} <= set(peaks)
    # each micro-batch's activations: B / K rows of 4096 fp32 (16 MiB for the whole batch)
    assert peaks["baseline"] > peaks["accum2"] > peaks["accum4"] > peaks["accum8"]


def test_each_plan_is_measured_on_a_step_like_the_baselines(tmp_path):
    """A GAN with lazy R1 regularization steps the discriminator's optimizer twice every 4th
    iteration. The step a plan was measured on was whichever came next: accum2 met a step of the
    other kind, was predicted 1.6x faster than the baseline and left out as a batch whose samples
    interact. Steps whose other optimizers step another number of times are left out."""
    data, _ = advise_source(tmp_path, "\n".join([
        "import torch, torch.nn as nn, torch.nn.functional as F",
        "B, Z = 64, 128",
        "G = nn.Sequential(nn.Linear(Z, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()",
        "D = nn.Sequential(nn.Linear(1024, 1024), nn.LeakyReLU(0.2), nn.Linear(1024, 1)).cuda()",
        "g_opt = torch.optim.Adam(G.parameters(), betas=(0.0, 0.99))",
        "d_opt = torch.optim.Adam(D.parameters(), betas=(0.0, 0.99))",
        "for i in range(40):",
        "    real = torch.randn(B, 1024, device='cuda')",
        "    d_loss = F.softplus(D(G(torch.randn(B, Z, device='cuda')).detach())).mean() + F.softplus(-D(real)).mean()",
        "    d_opt.zero_grad(); d_loss.backward(); d_opt.step()",
        "    if i % 4 == 0:",
        "        real.requires_grad_(True)",
        "        g, = torch.autograd.grad(D(real).sum(), real, create_graph=True)",
        "        d_opt.zero_grad(); (g.pow(2).sum(1).mean() * 10).backward(); d_opt.step()",
        "    g_loss = F.softplus(-D(G(torch.randn(B, Z, device='cuda')))).mean()",
        "    g_opt.zero_grad(); g_loss.backward(); g_opt.step()",
    ]) + "\n")
    assert data["skipped"] == {}
    seconds = {p["plan"]: p["seconds"] for p in data["plans"]}
    assert {"accum2", "accum4", "accum8"} <= set(seconds)
    # micro-batches run the same kernels on fewer rows: a step of K of them is never faster
    assert seconds["baseline"] < seconds["accum2"] < seconds["accum4"] < seconds["accum8"]
    assert data["varying_batch_shapes"] == []


def test_looking_for_a_batchs_lengths_keeps_no_variable_alive():
    """The script door looks for per-sample lengths among its callers' variables. Read through
    ``frame.f_locals``, before Python 3.13 the frame kept a snapshot of every variable: a micro-batch's
    logits lived on through the next micro-batch's step, after the script had rebound the name."""
    import weakref

    from memprof.script_advice import _lengths_beside

    def copy_batch(batch):  # the code moving the batch to the device, one frame below the loop
        return _lengths_beside(batch)

    def loop():
        logits = torch.ones(8, 16)
        gone = weakref.ref(logits)
        lengths = torch.arange(8)
        found = copy_batch(8)
        logits = None  # rebound: nothing else holds it, while this frame runs on (the next micro-batch)
        return gone() is None, found, lengths

    freed, found, lengths = loop()
    assert freed
    assert len(found) == 1 and found[0] is lengths


def test_the_loop_that_steps_the_optimizer_decides_how_changes_are_phrased():
    """A script that hands its steps to a trainer (Hugging Face's Trainer, Lightning's) is told what to
    set there (TrainingArguments(...), Trainer(...)), not code for a loop it does not write: whose loop
    it is shows in the files on the stack at the first optimizer step."""
    from memprof.script_advice import _loop_owner
    from memprof.strategies import Accumulation

    def called_from(path: str) -> str:
        namespace: dict = {}
        exec(compile("def loop(step):\n    return step()\n", path, "exec"), namespace)
        return namespace["loop"](_loop_owner)

    assert called_from("/venv/site-packages/transformers/trainer.py") == "hf"
    assert called_from("/venv/site-packages/lightning/pytorch/loops/optimization/automatic.py") == "lightning"
    assert called_from("/venv/site-packages/pytorch_lightning/core/optimizer.py") == "lightning"
    assert called_from("/venv/site-packages/accelerate/accelerator.py") == "script"
    assert _loop_owner() == "script"
    accumulation = Accumulation(2)
    assert accumulation.code_change(None, "hf").startswith("TrainingArguments(gradient_accumulation_steps=2")
    assert not accumulation.code_change(None, "script").startswith("TrainingArguments")


MINIBATCHES_FROM_BUFFERS = """\
import numpy as np, torch, torch.nn as nn
policy = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 1)).cuda()
opt = torch.optim.Adam(policy.parameters())
obs = torch.zeros(512, 64).cuda()  # a rollout's buffers, filled on the device without gradients
old = torch.zeros(512).cuda()
inds = np.arange(512)
for epoch in range(6):
    np.random.shuffle(inds)
    for start in range(0, 512, 256):
        mb = inds[start:start + 256]  # a minibatch picked from every buffer by one host index array
        new = policy(obs[mb]).view(-1)
        ratio = (new - old[mb]).exp()  # the minibatch's new values against its old ones
        loss = torch.max(-ratio, -ratio.clamp(0.8, 1.2)).mean()
        opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_minibatch_picked_from_device_buffers_is_cut_where_it_meets_the_micro_batch(tmp_path):
    """PPO's update (cleanrl's): the model's input and the old values are picked from buffers on the
    device by the same indices. The model's forward cuts its input; the old values stay whole until an
    elementwise operator meets them with the micro-batch's new ones (256 against 128 rows would not
    broadcast): every accumulation plan failed there with 'The size of tensor a (256) must match'."""
    data, _ = advise_source(tmp_path, MINIBATCHES_FROM_BUFFERS)
    plans = {p["plan"] for p in data["plans"]}
    assert {"accum2", "accum4", "accum8"} <= plans, data["failed"]
    assert not any(p.startswith(("accum", "bf16+accum")) for p in data["failed"])
