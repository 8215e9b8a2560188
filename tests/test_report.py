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
