"""The memprof command: end to end through subprocesses, and in-process for the quick parts."""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from memprof import Report
from memprof.cli import main, parse_count
from memprof.devices import get_gpu
from memprof.units import GiB

ROOT = Path(__file__).resolve().parents[1]
GPT_EXAMPLE = ROOT / "examples" / "train_gpt.py"


def memprof(*args, cwd=ROOT):
    """Run ``python -m memprof.cli ARGS`` as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "memprof.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300
    )


# -- track: script errors -------------------------------------------------------
SCRIPTS = {
    "syntax": ("def f(:\n", "bad.py:1: syntax error"),
    "raises": ("import sys\nraise ValueError('no data: ' + ' '.join(sys.argv[1:]))\n",
               "the script raised ValueError: no data: --data /x (at bad.py line 2); "
               "memprof could not observe a training step"),
    "asserts": ("x = 1\nassert x == 2\n",
                "the script raised AssertionError (at bad.py line 2); memprof could not observe a training step"),
    "no_optimizer": ("import torch\ntorch.nn.Linear(2, 2)(torch.ones(2))\n",
                     "the script ended without a training step"),
}


@pytest.mark.parametrize("case", ["missing", *SCRIPTS])
def test_track_script_errors(tmp_path, case):
    if case != "missing":
        source, expected = SCRIPTS[case]
        (tmp_path / "bad.py").write_text(source)
    else:
        expected = "script 'bad.py' does not exist"
    r = memprof("track", "bad.py", "--steps", "2", "--", "--data", "/x", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"memprof: error: {expected}" in r.stderr
    assert "Traceback" not in r.stderr


# -- track, then report: the GPT example end to end ------------------------------------
def gpt_parameter_bytes():
    """fp32 bytes of the example's default GPT, counted from its own model class."""
    spec = importlib.util.spec_from_file_location("train_gpt_example", GPT_EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # defines the classes; main() runs only as __main__
    model = example.GPT(example.GPTConfig())
    return 4 * sum(p.numel() for p in model.parameters())  # the tied lm_head/wte weight once


def test_track_gpt_example_then_report(tmp_path):
    out = tmp_path / "out.json"
    r = memprof("track", "examples/train_gpt.py", "--steps", "2", "--json", out)
    assert r.returncode == 0, r.stderr
    assert "step 0: loss" in r.stdout  # the script's own logging
    assert "device: cpu" in r.stdout
    assert "without allocator counters: temporaries and fragmentation need CUDA" in r.stdout
    assert "optimizer_state.exp_avg" in r.stdout  # the category table
    assert "(CausalSelfAttention)" in r.stdout  # the module tree
    assert "tracking GPT with AdamW" in r.stderr

    report = Report.load(out)
    assert len(report.steps) == 2
    assert report.peak.bytes["parameters"] == gpt_parameter_bytes()
    # AdamW: exp_avg and exp_avg_sq are fp32 copies of every parameter.
    assert report.optimizer_state["exp_avg"] == report.optimizer_state["exp_avg_sq"] == gpt_parameter_bytes()
    assert report.modules.index[0] == "GPT"
    assert report.meta["script"] == "examples/train_gpt.py"

    r = memprof("report", out)
    assert r.returncode == 0, r.stderr
    assert "report of examples/train_gpt.py: 2 step(s)" in r.stdout
    assert "optimizer_state.exp_avg" in r.stdout and "(CausalSelfAttention)" in r.stdout


def test_track_simulates_a_catalogue_gpu(tmp_path):
    out = tmp_path / "sim.json"
    r = memprof("track", "examples/train_gpt.py", "--steps", "2", "--target", "rtx4090", "--json", out)
    assert r.returncode == 0, r.stderr
    assert "simulating RTX4090-24GB" in r.stdout
    assert "device: simulated (RTX4090-24GB)" in r.stdout
    assert "on cuda" in r.stdout  # the script took its CUDA path
    report = Report.load(out)
    assert report.source == "simulate" and report.meta["target"] == "RTX4090-24GB"
    # On a (simulated) GPU the parameters occupy 512-byte allocator blocks, so at
    # least their bytes; AdamW's step counters stay on the host.
    assert report.peak.bytes["parameters"] >= gpt_parameter_bytes()
    assert set(report.optimizer_state) == {"exp_avg", "exp_avg_sq"}
    # cuBLAS's workspace before Hopper, for the training thread and autograd's.
    assert report.peak.bytes["workspaces"] == 2 * (8 * 2**20 + 8 * 16 * 2**10)
    r = memprof("track", "examples/train_gpt.py", "--target", "rtx9090")
    assert r.returncode == 2 and "rtx9090" in r.stderr and "Traceback" not in r.stderr


def test_examples_run_standalone():
    for script in ("train_gpt.py", "train_mlp.py"):
        r = subprocess.run([sys.executable, ROOT / "examples" / script, "--steps", "3"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "step 0: loss" in r.stdout


# -- in-process: report, gpus, estimate, argument errors ----------------------------------
def test_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json")]) == 2
    assert "memprof: error: no report at" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["report", str(tmp_path / "bad.json")]) == 2
    assert "is not a memprof report (invalid JSON" in capsys.readouterr().err


def test_gpus(capsys):
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    for name in ("H100-80GB", "H200-141GB", "A100-40GB", "RTX4090-24GB"):
        assert name in out


def test_estimate_mixed_precision_7b(capsys):
    # Mixed-precision AdamW: 2 (fp16 param) + 4 (fp32 grad) + 4 (master) + 8 (m, v)
    # = 18 B/param; 7e9 * 18 = 126e9 B = 126e9 / 2**30 GiB = 117.35 GiB.
    assert 7 * 10**9 * 18 / GiB == pytest.approx(117.3466, abs=1e-4)
    assert main(["estimate", "--params", "7e9", "--precision", "mixed_fp16"]) == 0
    out = capsys.readouterr().out
    assert "on the GPU: 117.35 GiB per rank (126,000,000,000 B, 18.00 B/param)" in out
    assert "activations, temporaries and the CUDA context come on top" in out


def test_estimate_fits_gpu(capsys):
    # H100: 80 GiB < 117.35 GiB, short by (126e9 - 80 * 2**30) B = 37.35 GiB.
    assert main(["estimate", "--params", "7B", "--precision", "mixed_fp16", "--gpu", "h100"]) == 0
    assert "does not fit H100-80GB (80.00 GiB)" in (out := capsys.readouterr().out)
    assert f"{(126 * 10**9 - 80 * GiB) / GiB:.2f} GiB more" in out and "37.35 GiB more" in out
    # H200: 141 GiB holds them, leaving 141 * 2**30 - 126e9 B = 23.65 GiB.
    assert get_gpu("h200").memory_bytes == 141 * GiB
    assert main(["estimate", "--params", "7B", "--precision", "mixed_fp16", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "fits H200-141GB (141.00 GiB)" in out and "leaving 23.65 GiB" in out
    # ZeRO-3 over 8 ranks with parameter offload: device keeps the sharded fp32 grads,
    # 7e9 / 8 * 4 B = 3.5e9 B; host takes master + Adam + params = 7e9 / 8 * (4 + 8 + 2) B.
    args = ["--params", "7B", "--precision", "mixed_bf16", "--zero-stage", "3", "--world-size", "8",
            "--offload", "optimizer+parameters"]
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    assert "on the GPU: 3.26 GiB per rank (3,500,000,000 B, 0.50 B/param)" in out
    assert "offloaded to host memory: 11.41 GiB per rank (12,250,000,000 B)" in out


@pytest.mark.parametrize(
    "text, n",
    [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("7b", 7 * 10**9), ("1.5B", 1_500_000_000), ("124M", 124 * 10**6),
     ("350k", 350_000), ("7_000_000_000", 7 * 10**9), ("1,000", 1000), ("2T", 2 * 10**12), ("12", 12)],
)
def test_parse_count(text, n):
    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["7X", "0", "1.5", "-5", "", "abc", "1e-3", "1.2.3M"])
def test_parse_count_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="use e.g. 7e9, 7B"):
        parse_count(text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["estimate", "--params", "7e9", "--offload", "optimizer"],
         "memprof: error: offload='optimizer' needs zero_stage >= 1"),
        (["estimate", "--params", "7e9", "--gpu", "a100"],
         "memprof: error: GPU name 'a100' is ambiguous: it matches A100-40GB, A100-80GB"),
        (["estimate", "--params", "7e9", "--gpu", "tpu"], "memprof: error: unknown GPU 'tpu'; valid names: V100-32GB"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["estimate", "--params", "7X"], "argument --params: '7X' is not a whole number of parameters"),
        (["estimate", "--params", "7e9", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["track", "train.py", "--lr", "3"],
         "unrecognized arguments: --lr 3; pass the script's own arguments after --"),
        (["track", "train.py", "--steps", "0"], "argument --steps: '0' is not an integer >= 1"),
        (["gpus", "--", "x"], "only `memprof track` and `memprof advise` run one"),
        ([], "required: COMMAND"),
    ],
)
def test_argparse_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
