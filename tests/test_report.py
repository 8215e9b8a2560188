"""Report: tables, JSON round trip, rich rendering."""

import json

import pytest
from rich.console import Console

import memprof
from memprof import Breakdown, Report
from models import MiB


def test_to_dataframe_matches_peak(report):
    df = report.to_dataframe()
    assert df["bytes"].sum() == report.peak.allocated  # CPU: no fragmentation rows
    assert dict(zip(df["category"], df["bytes"])) == report.peak.bytes
    assert df["share"].sum() == pytest.approx(1.0)


def test_save_load_round_trip(report, tmp_path):
    path = report.save(tmp_path / "sub" / "r.json")
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left behind
    back = Report.load(path)
    assert back.peak == report.peak
    assert back.optimizer_state == report.optimizer_state
    assert back.modules.astype(report.modules.dtypes).equals(report.modules)
    assert back.steps["peak_allocated"].tolist() == report.steps["peak_allocated"].tolist()
    assert back.timeline[["allocated", "activations"]].values.tolist() == report.timeline[["allocated", "activations"]].values.tolist()


def test_save_is_atomic(report, tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("previous")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", boom)
    with pytest.raises(OSError, match="disk full"):
        report.save(path)
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no report at"):
        Report.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a memprof report"):
        Report.load(bad)
    bad.write_text(json.dumps({"schema": 99}))
    with pytest.raises(ValueError, match="schema 99"):
        Report.load(bad)


def test_rich_rendering(report):
    console = Console(width=120, record=True, color_system=None)
    console.print(report)
    text = console.export_text()
    for word in ("parameters", "activations", "temporaries", "optimizer_state.exp_avg_sq", "Sequential", "(Linear)"):
        assert word in text
    assert "2.00 MiB" in text  # parameters of two 1 MiB weights
    assert str(report) == memprof.render.report_text(report)


def test_breakdown_properties():
    b = Breakdown(step=0, phase="x", bytes={"parameters": 3 * MiB, "temporaries": MiB, "fragmentation": MiB})
    assert b.allocated == 4 * MiB
    assert b.reserved == 5 * MiB
    assert b.named_fraction == 0.75
    assert Breakdown(0, "x", {"parameters": MiB}).reserved is None


def test_phase_vocabulary():
    from memprof.report import Phase, phase_kind, phase_module

    assert phase_kind("forward GPT.transformer.h.3.attn") is Phase.FORWARD
    assert phase_module("forward GPT.transformer.h.3.attn") == "GPT.transformer.h.3.attn"
    assert phase_kind("recompute GPT.transformer.h.3") is Phase.RECOMPUTE
    assert phase_kind("backward GPT.lm_head") is Phase.BACKWARD
    assert phase_module("backward GPT.lm_head") == "GPT.lm_head"
    assert phase_kind("backward") is Phase.BACKWARD and phase_module("backward") == ""
    for kind in (Phase.LOSS, Phase.AFTER_BACKWARD, Phase.OPTIMIZER_STEP, Phase.ZERO_GRAD, Phase.BETWEEN_STEPS):
        assert phase_kind(kind.value) is kind and phase_module(kind.value) == ""
    assert str(Phase.OPTIMIZER_STEP) == "optimizer step"
    assert phase_kind("other") is None and phase_kind("forward:GPT.h.0") is None and phase_kind("loss GPT") is None


def test_module_columns(report):
    m = report.modules
    assert m.columns.tolist() == [
        "type", "parameters", "buffers", "gradients", "optimizer_state", "activations", "activation_gradients",
        "inputs", "workspaces", "activations_saved_over_step", "forward_peak_delta", "backward_peak_delta",
    ]
    # The root row is the category table at the peak, category by category.
    for cat in memprof.report.MODULE_CATEGORIES:
        assert m.at["Sequential", cat.value] == report.peak.bytes[cat.value], cat


def test_module_tree_is_at_the_peak(report):
    console = Console(width=200, record=True, color_system=None)
    console.print(memprof.render.module_tree(report))
    text = console.export_text()
    assert f"modules at the peak (step {report.peak.step}, {report.peak.phase}), submodules included" in text
    root = next(line for line in text.splitlines() if "Sequential (Sequential)" in line)
    # The root's cells are the category table's: 2 MiB of parameters, 1 MiB of
    # gradients (only the second Linear's, at the ReLU's backward), ...
    cells = ("params 2.00 MiB", "grads 1.00 MiB", "optim 4.00 MiB", "activ 1.00 MiB", "act.grads 2.00 MiB", "inputs 1.00 MiB")
    for cell in cells:
        assert cell in root, cell
    console = Console(width=200, record=True, color_system=None)
    console.print(memprof.render.module_tree(report, over_step=True))
    text = console.export_text()
    assert "saved for backward over the step" in text
    assert "activ saved over step 3.00 MiB" in text  # x, the ReLU's output, and its output the loss saves
    page = report.to_html()
    assert "<h2>Modules at the peak</h2>" in page and '<section id="modules">' in page  # its content: test_html.py


def test_breakdown_metrics_and_summary(report):
    peak = report.peak
    metrics = peak.metrics()
    assert metrics["parameters_GiB"] == 2 * MiB / 2**30 and metrics["optimizer_state_GiB"] == (4 * MiB + 8) / 2**30
    assert metrics["peak_allocated_GiB"] == peak.allocated / 2**30 and "peak_reserved_GiB" not in metrics  # CPU
    assert peak.summary() == (f"peak {peak.allocated / 2**30:.3f} GiB allocated in step 2 (backward Sequential.1); "
                              "parameters 0.002 GiB, gradients 0.001 GiB, optimizer_state 0.004 GiB, activations 0.001 "
                              "GiB, activation_gradients 0.002 GiB, inputs 0.001 GiB")
    assert peak.summary("global step 3").startswith(f"peak {peak.allocated / 2**30:.3f} GiB allocated in global step 3 (")


def test_saved_files_get_the_usual_permissions(report, tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        assert report.save(tmp_path / "r.json").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_old_schema_is_refused(report):
    d = report.to_dict()
    assert d["schema"] == 2
    d["schema"] = 1  # phases as "forward:<module>", module rows over the step
    with pytest.raises(ValueError, match="schema 1 is not supported"):
        Report.from_dict(d)


def test_other_models_round_trip_and_older_files_load(report):
    """Reports keep the other models by name; a file saved before they were kept loads with none."""
    from dataclasses import replace

    d = replace(report, other_models={"teacher": 3 * MiB}).to_dict()
    assert Report.from_dict(d).other_models == {"teacher": 3 * MiB}
    del d["other_models"]
    assert Report.from_dict(d).other_models == {}


def test_module_tree_folds_a_stack_of_identical_blocks():
    """Twelve transformer layers that hold the same are one line, not twelve."""
    import torch
    from torch import nn

    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)], nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memprof.track(model, opt) as prof:
        for _ in range(3):
            model(torch.randn(512, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
    console = Console(width=200, record=True, color_system=None)
    console.print(memprof.render.module_tree(prof.report()))
    lines = console.export_text().splitlines()
    # at the peak (the last Linear's backward) each block holds 256 x 256 + 256 fp32 parameters
    # and its ReLU's output (512 x 256 fp32), which the next layer saved
    block = next(line for line in lines if "(Sequential x4, each)" in line)
    assert block.split("──")[1].startswith(" 0-3 (Sequential x4, each)")
    assert block.endswith("params 257.00 KiB  activ 512.00 KiB")
    assert any(" 4 (Linear)" in line for line in lines) and not any(" 1 (Sequential)" in line for line in lines)
    assert sum(" 0 (Linear)" in line for line in lines) == 1  # the first block's own submodules stand for all


def test_simulation_notes_are_shown_with_the_report(report):
    """What the simulated GPU ran differently (an upper bound for x[mask], torch.compile run eagerly)
    shows under the category table and in the HTML page, not only in the run's log."""
    import copy

    from memprof.render import report_text

    noted = copy.deepcopy(report)
    noted.meta["simulation_notes"] = {"upper bound: x[mask]": "on values not followed, sized as if every element "
                                                              "were selected"}
    assert ("simulated differently: upper bound: x[mask]: on values not followed, sized as if every element were "
            "selected") in report_text(noted, width=200)
    assert "<li><b>upper bound: x[mask]</b>: on values not followed" in noted.to_html()
    assert "simulated differently" not in report_text(report, width=200)


def test_memory_that_grows_from_step_to_step_is_named():
    """``running_loss += loss`` keeps each step's graph: what is allocated at the steps' ends
    rises by at least 1 MiB (and 1 %) every step. Steps that level off, or only two, say nothing."""
    import pandas as pd

    from memprof.render import growth_note

    leaking = pd.DataFrame({"allocated": [100 * MiB, 110 * MiB, 120 * MiB, 130 * MiB]})
    note = growth_note(leaking)
    assert note.startswith("memory grows across steps: 10.00 MiB more is allocated at the end of each step "
                           "(100.00 MiB after the first observed step, 130.00 MiB after the last)")
    assert growth_note(pd.DataFrame({"allocated": [100 * MiB, 110 * MiB, 110 * MiB, 120 * MiB]})) is None
    assert growth_note(pd.DataFrame({"allocated": [100 * MiB, 100 * MiB + MiB // 2, 101 * MiB]})) is None
    assert growth_note(leaking.head(2)) is None
