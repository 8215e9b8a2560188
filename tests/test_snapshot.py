"""Reading allocator snapshots recorded without memprof: safely, and attributed by their frames."""

import pickle

import pytest

from memprof import snapshot
from memprof.cli import main

MiB = 2**20
BASE = 0x7F0000000000


def _frames(*pairs):
    return [{"filename": f, "line": 1, "name": n} for f, n in pairs]


PARAM = _frames(("/usr/lib/python3/site-packages/torch/nn/modules/module.py", "_apply"), ("train.py", "<module>"))
STATE = _frames(("/usr/lib/python3/site-packages/torch/optim/adamw.py", "_init_group"), ("train.py", "<module>"))
ACT = _frames(("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "forward"), ("/home/me/model.py", "forward"),
              ("train.py", "<module>"))
GRAD = _frames(("/usr/lib/python3/site-packages/torch/autograd/graph.py", "_engine_run_backward"),
               ("/usr/lib/python3/site-packages/torch/_tensor.py", "backward"), ("train.py", "<module>"))
TMP = _frames(("train.py", "<module>"))
# address, size, frames: 4 MiB of weights, 8 of Adam's state, 2 of activations, 1 of gradients, 512 KiB else
BLOCKS = [(BASE, 4 * MiB, PARAM), (BASE + 4 * MiB, 8 * MiB, STATE), (BASE + 12 * MiB, 2 * MiB, ACT),
          (BASE + 14 * MiB, MiB, GRAD), (BASE + 15 * MiB, MiB // 2, TMP)]


def _snapshot(from_start: bool = True) -> dict:
    """One 20 MiB segment; the trace allocates the five blocks, then frees the last three."""
    trace = [{"action": "segment_alloc", "addr": BASE, "size": 20 * MiB, "stream": 0, "frames": TMP}] if from_start else []
    for addr, size, frames in BLOCKS if from_start else BLOCKS[2:]:  # a ring buffer may have lost the start
        trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames})
    for addr, size, frames in BLOCKS[2:]:
        trace.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": frames})
        trace.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": frames})
    blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated", "frames": f}
              for a, s, f in BLOCKS[:2]]
    blocks.append({"address": BASE + 12 * MiB, "size": 8 * MiB, "requested_size": 0, "state": "inactive", "frames": []})
    seg = {"device": 0, "address": BASE, "total_size": 20 * MiB, "allocated_size": 12 * MiB, "active_size": 12 * MiB,
           "requested_size": 12 * MiB, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
           "is_expandable": False, "frames": TMP, "blocks": blocks}
    return {"segments": [seg], "device_traces": [trace], "allocator_settings": {}}


@pytest.mark.parametrize("from_start", [True, False])
def test_the_peak_of_the_trace_by_category(tmp_path, from_start):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot(from_start)))
    r = snapshot.to_report(snapshot.load(path))
    b = r.peak.bytes
    assert r.peak.allocated == 15 * MiB + MiB // 2 == int(r.steps["peak_allocated"].iloc[0])
    assert (b["parameters"], b["optimizer_state"], b["activations"], b["gradients"], b["temporaries"]) == (
        4 * MiB, 8 * MiB, 2 * MiB, MiB, MiB // 2)
    assert b["fragmentation"] == 20 * MiB - (15 * MiB + MiB // 2)
    assert int(r.steps["peak_reserved"].iloc[0]) == 20 * MiB and int(r.steps["allocated"].iloc[0]) == 12 * MiB
    assert r.modules.loc["snapshot.model:forward", "activations"] == 2 * MiB
    assert r.source == "snapshot" and "buffers are counted as parameters" in r.meta["unknowable"]


class _Writes:
    """Unpickled, this would open (and so create) a file."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return open, (self.target, "w")


def test_a_pickle_that_would_run_code_is_refused(tmp_path, capsys):
    target = tmp_path / "written-by-the-pickle"
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Writes(str(target))]]}))
    with pytest.raises(ValueError, match=r"was refused: it names io\.open\. A memory snapshot holds only plain"):
        snapshot.load(path)
    assert not target.exists()
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "was refused: it names io.open" in err and "Traceback" not in err
    assert not target.exists()


def test_report_command_reads_a_snapshot(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    html = tmp_path / "snap.html"
    assert main(["report", str(path), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "optimizer_state" in out and "8.00 MiB" in out
    assert "not told apart in a snapshot:" in out and html.exists()
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    assert main(["report", str(tmp_path / "junk.pickle")]) == 2
    assert "is not a memory snapshot" in capsys.readouterr().err


def test_a_report_written_as_a_snapshot_reads_back_and_in_torchs_viewer(tmp_path):
    """A tracked step's peak, written in PyTorch's format: torch.cuda._memory_viz
    reads it with memprof's names in the frames, and memprof reads it back to the byte."""
    import torch
    from torch import nn
    from torch.cuda import _memory_viz

    import memprof

    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))  # 1 MiB weights
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(model, opt, warmup=2) as prof:
        for _ in range(2):
            model(torch.randn(64, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    report = prof.report()
    path = report.save_snapshot(tmp_path / "peak.pickle")
    snap = snapshot.load(path)  # plain containers only: the safe loader takes it
    lines = _memprof_lines(_memory_viz.memory(snap, format_flamegraph=lambda lines: lines))
    assert any("parameters Sequential.0" in line for line in lines)
    assert any("optimizer_state Sequential.2" in line for line in lines)
    assert "TOTAL MEM" in _memory_viz.trace(snap)
    back = snapshot.to_report(snap)
    for category in ("parameters", "gradients", "optimizer_state", "activations", "inputs", "temporaries"):
        assert back.peak.bytes[category] == report.peak.bytes[category], category
    assert back.peak.allocated == report.peak.allocated
    for module in ("Sequential.0", "Sequential.2"):
        assert back.modules.loc[f"snapshot.{module}", "parameters"] == report.modules.loc[module, "parameters"]
    # and through the command line, from a saved report
    report.save(tmp_path / "r.json")
    assert main(["report", str(tmp_path / "r.json"), "--snapshot", str(tmp_path / "cli.pickle")]) == 0
    assert snapshot.load(tmp_path / "cli.pickle") == snap


def _memprof_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "memprof" in line]


# -- on a real GPU ---------------------------------------------------------------------
from conftest import cuda  # noqa: E402


@cuda
@pytest.mark.cuda
def test_a_snapshot_recorded_on_the_gpu_without_memprof_is_attributed(tmp_path):
    """Three AdamW steps of an MLP recorded with PyTorch's own _record_memory_history:
    the trace's peak is the allocator's own peak (within 1 %), and the weights and
    Adam's two states are found by their frames."""
    import torch
    from torch import nn

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(8)]).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            model(torch.randn(4096, 2048, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        path = tmp_path / "recorded.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # The snapshot holds every block live when it was taken, also those allocated
    # before recording began (cuBLAS's workspaces, an earlier test's leftovers),
    # so its peak is the process's: the allocator's own.
    recorded = torch.cuda.max_memory_allocated()
    r = snapshot.to_report(snapshot.load(path))
    weights = 8 * (2048 * 2048 + 2048) * 4
    print(f"recorded peak {recorded} B, memprof's {r.peak.allocated} B; {r.peak.bytes}")
    assert abs(r.peak.allocated - recorded) <= 0.01 * recorded
    assert r.peak.bytes["parameters"] == weights
    assert r.peak.bytes["optimizer_state"] == 2 * weights
    del model, opt
    torch.cuda.empty_cache()
