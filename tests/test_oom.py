"""Out of memory: the simulated GPU runs out where the target would, and what was live then is kept.

Exact bytes from shapes; the error the caller receives is the one raised.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memprof
from memprof import Report
from memprof.caching import SimulatedOOM
from memprof.devices import get_gpu
from memprof.simulate import usable_bytes

sys.path.insert(0, str(Path(__file__).parent))
from test_cli import ROOT  # noqa: E402
from test_cli import memprof as memprof_cli  # noqa: E402

MiB = 2**20
WIDTH = 8192
LAYER = (WIDTH * WIDTH + WIDTH) * 4  # one Linear(8192, 8192)'s fp32 weight and bias


def _wide(layers: int, batch: int):
    def setup():
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(batch, WIDTH, device="cuda")

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        return model, opt, step

    return setup


def test_simulation_runs_out_where_the_target_would(tmp_path, monkeypatch, caplog):
    """12 Linear(8192, 8192) with AdamW on an RTX 3060: 4.5 GiB of weights and
    4.5 of gradients fit in its 10.65 GiB, Adam's two states of 4.5 GiB each do not."""
    monkeypatch.chdir(tmp_path)
    gpu = get_gpu("rtx3060")
    with caplog.at_level(logging.ERROR, logger="memprof"), pytest.raises(torch.OutOfMemoryError) as info:
        memprof.simulate(_wide(12, 64), target="rtx3060", steps=2)
    error = info.value
    assert isinstance(error, SimulatedOOM)
    assert str(error).startswith("CUDA out of memory. Tried to allocate 256.00 MiB")  # PyTorch's own opening
    assert error.capacity == usable_bytes(gpu) and error.requested == WIDTH * WIDTH * 4
    assert error.reserved + error.alloc_size > error.capacity
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    assert json_path.with_suffix(".html").exists()
    r = Report.load(json_path)
    info = r.meta["out_of_memory"]
    assert r.source == "simulate" and r.meta["target"] == gpu.name
    assert info["requested"] == error.requested and info["capacity"] == error.capacity
    assert r.peak.phase == "optimizer step" and r.peak.step == 0
    assert r.peak.bytes["parameters"] == 12 * LAYER
    assert r.peak.bytes["gradients"] == 12 * LAYER
    assert r.peak.allocated == info["allocated"] == error.allocated
    # Adam creates exp_avg and exp_avg_sq for every parameter before it steps: what it made
    # before the failing 256 MiB is optimizer state, and the largest category.
    state = r.peak.bytes["optimizer_state"]
    assert state > r.peak.bytes["parameters"] and r.modules.loc["Sequential", "optimizer_state"] == state
    (message,) = [m for m in caplog.messages if m.startswith("out of memory")]
    assert "The largest category was optimizer_state" in message and json_path.name in message


def test_a_forward_that_does_not_fit_names_where(tmp_path, monkeypatch, caplog):
    """Each Linear(8192, 8192) saves its 2 GiB input (65536 x 8192 fp32): a few
    layers in, the next output no longer fits, and the breakdown says where."""
    monkeypatch.chdir(tmp_path)

    def setup():
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)]).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(65536, WIDTH, device="cuda")

        def step():
            model(x).square().mean().backward()
            opt.step()

        return model, opt, step

    with caplog.at_level(logging.ERROR, logger="memprof"), pytest.raises(torch.OutOfMemoryError) as info:
        memprof.simulate(setup, target="rtx3060", steps=1)
    assert info.value.requested == 65536 * WIDTH * 4
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    r = Report.load(json_path)
    # Struck inside a layer's forward: the phase is that layer's, not the unwound one's.
    assert r.peak.phase.startswith("forward Sequential.")
    assert r.peak.bytes["parameters"] == 8 * LAYER
    assert r.peak.bytes["inputs"] == 65536 * WIDTH * 4
    saved = r.peak.bytes["activations"]
    assert saved > 0 and saved % (65536 * WIDTH * 4) == 0  # the saved inputs of the layers before
    assert saved == r.modules.loc["Sequential", "activations"]
    (message,) = [m for m in caplog.messages if m.startswith("out of memory")]
    assert f"({r.peak.phase})" in message and "The largest category was activations" in message


def test_track_re_raises_the_very_error_and_removes_its_hooks(tmp_path, caplog):
    """On the CPU too: the error leaves unchanged, the breakdown names it, no hook stays."""
    from torch.nn.modules import module as nn_module

    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))  # 512x512 fp32: exactly 1 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = len(nn_module._global_forward_hooks), len(nn_module._global_forward_pre_hooks)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with caplog.at_level(logging.ERROR, logger="memprof"), pytest.raises(torch.OutOfMemoryError) as info:
        with memprof.track(model, opt, oom_dir=tmp_path) as prof:
            loss = model(torch.ones(8, 512)).sum()
            raise error
    assert info.value is error and info.value.__traceback__ is not None
    assert (len(nn_module._global_forward_hooks), len(nn_module._global_forward_pre_hooks)) == hooks
    json_path, html_path = prof.oom_files
    r = Report.load(json_path)
    assert r.meta["out_of_memory"]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert r.peak.phase == "loss"
    assert r.peak.bytes["parameters"] == 2 * (MiB + 512 * 4)
    assert r.modules.loc["Sequential.0", "parameters"] == MiB + 512 * 4
    assert html_path.read_text().startswith("<!DOCTYPE html>")
    assert any(m.startswith("out of memory on the cpu") for m in caplog.messages)
    del loss

    with pytest.raises(torch.OutOfMemoryError):
        with memprof.track(model, opt, oom_dir=None) as prof:
            raise torch.OutOfMemoryError("CUDA out of memory.")
    assert prof.oom_files is None and sorted(tmp_path.iterdir()) == [html_path, json_path]


def test_an_error_the_script_catches_is_not_kept(tmp_path):
    """A script that catches the error and retries smaller must get the failed
    forward's memory back: the tracker keeps no reference to the error."""
    import gc
    import weakref

    kept = []

    class Fails(nn.Module):
        def forward(self, x):
            big = torch.ones(1024, 1024)
            kept.append(weakref.ref(big))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")

    model = nn.Sequential(nn.Linear(4, 4), Fails())
    with memprof.track(model, oom_dir=tmp_path) as prof:
        try:
            model(torch.ones(2, 4))
        except torch.OutOfMemoryError:
            pass
        gc.collect()
        assert kept[0]() is None
    assert prof.oom_files is None and not list(tmp_path.iterdir())  # caught inside: nothing to explain


GROWING = """\
import torch
from torch import nn

model = nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.GELU()) for _ in range(8)], nn.Linear(4096, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
batch = 4096
for step in range(10):  # a curriculum that doubles the batch every step
    x = torch.randn(batch, 4096, device="cuda")
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch *= 2
"""


def test_cli_track_on_a_gpu_too_small(tmp_path):
    """The simulated RTX 3060 runs out in the fourth tracked step's forward:
    status 2, no traceback, the breakdown on disk and named."""
    (tmp_path / "grow.py").write_text(GROWING)
    r = memprof_cli("track", "grow.py", "--target", "rtx3060", "--steps", "5", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    assert (f"memprof: error: the script ran out of memory on the simulated RTX3060-12GB (at grow.py line 9) "
            f"in tracked step 3; what was live then, by category and module, is in {json_path.name}") in r.stderr
    assert "The largest category was activations (8.00 GiB" in r.stderr
    report = Report.load(json_path)
    assert report.peak.bytes["activations"] == 8 * 2**30  # the saved inputs of 4 Linear and 4 GELU, 1 GiB each
    assert report.peak.phase == "forward Sequential.4.0"


def test_cli_track_gpt2_that_does_not_fit_in_its_first_step(tmp_path):
    """GPT-2 124M at 32 x 1024 on an RTX 3060 runs out in the first step's
    forward, before memprof knows the optimizer: the early tracking of the
    first module called explains it all the same."""
    gpt = ("--batch-size", "32", "--block-size", "1024", "--n-layer", "12", "--n-head", "12", "--n-embd", "768",
           "--vocab-size", "50257", "--device", "cuda")
    r = memprof_cli("track", ROOT / "examples" / "train_gpt.py", "--target", "rtx3060", "--steps", "2", "--", *gpt,
                    cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    assert ("memprof: error: the script ran out of memory on the simulated RTX3060-12GB (at train_gpt.py line "
            in r.stderr)
    assert f"before the first tracked step; what was live then, by category and module, is in {json_path.name}" in r.stderr
    report = Report.load(json_path)
    assert report.peak.step == 0 and report.peak.phase.startswith("forward GPT.h.")
    blocks = sum(-(-p.numel() * 4 // 512) * 512 for p in _gpt2().parameters())  # 512-byte allocator blocks
    assert report.peak.bytes["parameters"] == blocks
    assert report.peak.bytes["gradients"] == report.peak.bytes["optimizer_state"] == 0  # none yet
    assert max(report.peak.bytes, key=report.peak.bytes.get) == "activations"
    assert "The largest category was activations" in r.stderr and "most of it in GPT.h " in r.stderr
    # and what would fit: the advisor's top plan for the same GPU, with its code change
    assert "memprof: asking the advisor what fits the RTX3060-12GB" in r.stdout
    (top,) = [line for line in r.stdout.splitlines() if line.startswith("memprof: the advisor's top plan")]
    assert top.startswith("memprof: the advisor's top plan for the RTX3060-12GB: ") and " reserved (simulated)" in top
    peak = float(top.split(": peak ")[1].split(" GiB")[0]) * 2**30
    assert peak <= usable_bytes(get_gpu("rtx3060"))


FIRST_FORWARD_OOM = """
import torch
from torch import nn

class Huge(nn.Module):  # stands for a GPU that runs out: the CUDA caching allocator's own error type
    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

model = nn.Sequential(nn.Linear(512, 512), Huge())
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    model(torch.randn(64, 512)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_cli_track_a_real_run_out_of_memory_in_its_first_forward(tmp_path):
    """Measured, not simulated: the first step's forward runs out before memprof
    knows the optimizer; the early tracking of the first module explains it."""
    (tmp_path / "first.py").write_text(FIRST_FORWARD_OOM)
    r = memprof_cli("track", "first.py", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    assert f"before the first tracked step; what was live then, by category and module, is in {json_path.name}" in r.stderr
    report = Report.load(json_path)
    assert report.peak.step == 0 and report.peak.phase == "forward Sequential.1"
    assert report.peak.bytes["parameters"] == (512 * 512 + 512) * 4
    assert report.peak.bytes["inputs"] == 64 * 512 * 4
    assert report.peak.bytes["gradients"] == report.peak.bytes["optimizer_state"] == 0


def _gpt2():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_example", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with torch.device("meta"):
        return example.GPT(example.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))


# -- on a real GPU ---------------------------------------------------------------------
from conftest import cuda  # noqa: E402


@cuda
@pytest.mark.cuda
def test_a_real_out_of_memory_error_is_explained_and_passed_on(tmp_path):
    """8 Linear(8192, 8192) on a batch of 2^21 rows: each saved input is 64 GiB,
    so the GPU runs out a few layers in; PyTorch's own error reaches the caller."""
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)]).cuda()
    x = torch.empty(2**21, WIDTH, device="cuda")
    with pytest.raises(torch.OutOfMemoryError) as info:
        with memprof.track(model, oom_dir=tmp_path) as prof:
            model(x).sum().backward()
    assert type(info.value) is torch.OutOfMemoryError and str(info.value).startswith("CUDA out of memory.")
    r = Report.load(prof.oom_files[0])
    assert r.peak.phase.startswith("forward Sequential.")
    assert r.peak.bytes["parameters"] == 8 * LAYER  # 512-byte multiples already
    assert r.peak.bytes["inputs"] == 2**21 * WIDTH * 4
    assert r.peak.allocated == r.meta["out_of_memory"]["allocated"]
    del x, info
    torch.cuda.empty_cache()


@cuda
@pytest.mark.cuda
def test_cli_track_on_the_gpu_that_runs_out(tmp_path):
    # The first step's activations (16 tensors of batch x 4096 fp32) take 28 % of the
    # GPU's free memory, the second's 56 %, the third's 112 %: the third fails,
    # whatever else (another test, another process) holds some of the GPU.
    batch = int(0.28 * torch.cuda.mem_get_info()[0]) >> 18
    script = GROWING.replace("batch = 4096", f"batch = {batch}")
    (tmp_path / "grow.py").write_text(script)
    r = memprof_cli("track", "grow.py", "--steps", "5", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "memprof: error: the script ran out of memory on the GPU (at grow.py line" in r.stderr
    (json_path,) = tmp_path.glob("memprof-oom-*.json")
    assert "in tracked step 1;" in r.stderr and json_path.name in r.stderr
    assert "The largest category was activations" in r.stderr
