"""HTML pages: their content, exactly, and what headless Chromium makes of them."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch

import memprof
import memprof.cli
from memprof.advisor import advise
from memprof.categories import ALLOCATED
from memprof.html import advice_html, report_html, save_advice_html
from memprof.strategies import Autocast, Checkpointing
from memprof.units import fmt_bytes
from memprof.workload import Workload
from models import FF, MiB

get_plotlyjs = pytest.importorskip("plotly.offline", reason="the HTML report needs plotly: pip install 'memprof[html]'").get_plotlyjs

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = [c.value for c in ALLOCATED]


def figures(page: str) -> dict[str, dict]:
    """The page's figures as embedded, by the id of the div each is drawn in."""
    found = re.findall(r'<script type="application/json" class="figure" data-div="([^"]+)">(.*?)</script>', page, re.S)
    return {div: json.loads(spec) for div, spec in found}


class Rows(HTMLParser):
    """The rows of one table of a page: (the row's attributes, [(cell attributes, cell text)])."""

    def __init__(self, page: str, table: str) -> None:
        super().__init__()
        self.table, self.inside, self.rows = table, False, []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.inside = attrs.get("id") == self.table
        elif self.inside and tag == "tr":
            self.rows.append((attrs, []))
        elif self.inside and tag in ("td", "th"):
            self.rows[-1][1].append((attrs, ""))

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False

    def handle_data(self, data):
        if self.inside and self.rows and self.rows[-1][1]:
            attrs, text = self.rows[-1][1][-1]
            self.rows[-1][1][-1] = (attrs, text + data)


def texts(row) -> list[str]:
    return [text.strip() for _, text in row[1]]


@pytest.fixture(scope="module")
def page(report):
    return report_html(report)


def test_timeline_stacks_each_category_that_holds_memory(report, page):
    fig = figures(page)["timeline-plot"]
    tl = report.timeline
    stacked = [t for t in fig["data"] if t.get("stackgroup")]
    # One area per category that holds memory in the timeline, in the categories' order; no
    # fragmentation on the CPU (no reserved bytes).
    assert [t["name"] for t in stacked] == [c for c in CATEGORIES if tl[c].any()]
    for t in stacked:
        assert t["y"] == tl[t["name"]].tolist() and t["x"] == list(range(len(tl)))
        assert t["customdata"] == [fmt_bytes(v) for v in tl[t["name"]]]
    # The sample's own line: its step, phase (module) and allocated bytes, first in the unified hover.
    line = fig["data"][-1]
    assert line["name"] == "allocated" and line["y"] == tl["allocated"].tolist()
    assert line["customdata"] == [[s, p, fmt_bytes(a)] for s, p, a in zip(tl["step"], tl["phase"], tl["allocated"])]
    assert fig["layout"]["hovermode"] == "x unified"
    # A band per run of forward, backward and optimizer samples of each step, labelled where the label fits.
    rects = [s for s in fig["layout"]["shapes"] if s["type"] == "rect"]
    assert len(rects) == 3 * tl["step"].nunique()
    wide = [r for r in rects if r["x1"] - r["x0"] >= 0.06 * len(tl)]
    bands = [a["text"] for a in fig["layout"]["annotations"] if a.get("text") in ("forward", "backward", "optimizer")]
    assert bands == [("forward", "backward", "optimizer")[rects.index(r) % 3] for r in wide] and bands
    # Ticks in base-2 units.
    assert "10 MiB" in fig["layout"]["yaxis"]["ticktext"] and fig["layout"]["yaxis"]["tickvals"][1] == 5 * MiB


def test_peak_marked_at_the_sample_with_the_most_allocated(report, page):
    tl = report.timeline
    last = tl[tl["step"] == report.peak.step]
    at = last.index[last["allocated"] == last["allocated"].max()][0]
    (peak,) = [a for a in figures(page)["timeline-plot"]["layout"]["annotations"] if a.get("name") == "peak"]
    assert (peak["x"], peak["y"]) == (at, report.peak.allocated) == (at, 11 * MiB + 8)  # Adam's step counter: 8 B
    assert peak["text"] == "peak 11.00 MiB<br>step 2, backward Sequential.1"


def test_category_table_is_the_breakdown(report, page):
    rows = Rows(page, "category-table").rows
    peak = report.peak
    body = {texts(r)[0]: r for r in rows[1:]}
    for cat in CATEGORIES:
        b = peak.bytes[cat]
        assert texts(body[cat]) == [cat, fmt_bytes(b), f"{100 * b / peak.allocated:.1f} %"]
        assert body[cat][1][1][0]["data-bytes"] == str(b)
    assert texts(body["allocated"]) == ["allocated", "11.00 MiB", "100.0 %"]
    # The optimizer's state by name, under its row.
    names = [texts(r)[0] for r in rows[1:]]
    at = names.index("optimizer_state")
    assert names[at + 1:at + 4] == ["optimizer_state.exp_avg", "optimizer_state.exp_avg_sq", "optimizer_state.step"]
    assert texts(body["optimizer_state.exp_avg_sq"]) == ["optimizer_state.exp_avg_sq", "2.00 MiB", ""]


def test_other_models_are_named_under_their_row(report):
    """Each other model the script keeps (report.other_models) under the category's row, in
    the page and in the terminal's table."""
    from dataclasses import replace

    from memprof.render import report_text

    other = replace(report, other_models={"teacher": MiB, "vae": 3 * MiB})
    rows = Rows(report_html(other), "category-table").rows
    names = [texts(r)[0] for r in rows[1:]]
    at = names.index("other_models")
    assert names[at + 1:at + 3] == ["other_models.teacher", "other_models.vae"]
    assert texts(rows[1 + at + 2]) == ["other_models.vae", "3.00 MiB", ""]
    text = report_text(other)
    assert "other_models.teacher" in text and "other_models.vae" in text


def test_module_bars_and_table_are_the_module_table(report, page):
    modules = report.modules
    fig = figures(page)["module-plot"]
    # The root's children (ReLU's activations included); the root is the category table.
    names = ["Sequential.0", "Sequential.1", "Sequential.2"]
    assert fig["layout"]["barmode"] == "stack"
    for trace in fig["data"]:
        assert trace["y"] == names and trace["orientation"] == "h"
        assert trace["x"] == modules.loc[names, trace["name"]].tolist()
    bars = {t["name"]: dict(zip(t["y"], t["x"])) for t in fig["data"]}
    assert bars["parameters"]["Sequential.0"] == MiB  # a 512x512 fp32 weight
    assert set(bars) == {c for c in memprof.report.MODULE_CATEGORIES if modules.loc[names, c.value].any()}
    # The tree as a table, indented by depth; sizes exact in data-bytes.
    rows = Rows(page, "module-table").rows
    head = texts(rows[0])
    assert head[:2] == ["module", "type"] and head[-1] == "total"
    assert [r[0]["data-module"] for r in rows[1:]] == list(modules.index)
    assert texts(rows[1])[:2] == ["Sequential", "Sequential"] and texts(rows[2])[:2] == ["0", "Linear"]
    assert "padding-left:2.3em" in rows[2][1][0][0]["style"]
    for r in rows[1:]:
        cells = dict(zip(head, r[1]))
        for cat in head[2:-1]:
            assert int(cells[cat][0]["data-bytes"]) == modules.at[r[0]["data-module"], cat]
    assert texts(rows[1])[-1] == fmt_bytes(report.peak.allocated)  # the root holds all but temporaries (none here)


def test_page_is_offline_and_holds_plotly_once(page):
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]*\bsrc=", page) and not re.search(r"<link[^>]*href=", page)
    assert page.count(get_plotlyjs()) == 1
    # What the report adds to plotly.js is small.
    assert len(page) - len(get_plotlyjs()) < 100_000


def test_user_strings_are_escaped(report):
    evil = "<script>alert(1)</script>"
    renamed = {n: n.replace("Sequential.2", f"Sequential.{evil}") for n in report.modules.index}
    tl = report.timeline.copy()
    tl["phase"] = tl["phase"].str.replace("Sequential.1", f"Sequential.{evil}", regex=False)
    r = dataclasses.replace(report, modules=report.modules.rename(index=renamed), timeline=tl)
    page = report_html(r, title=f"run {evil}")
    assert "alert(1)" in page and "<script>alert" not in page
    assert f"<title>run {evil.replace('<', '&lt;').replace('>', '&gt;')}</title>" in page
    assert f'data-module="Sequential.&lt;script&gt;alert(1)&lt;/script&gt;"' in page
    # In the figures, escaped for plotly's own markup (which reads entities).
    fig = figures(page)
    assert "Sequential.&lt;script&gt;alert(1)&lt;/script&gt;" in fig["module-plot"]["data"][0]["y"]
    assert any(c[1] == "backward Sequential.&lt;script&gt;alert(1)&lt;/script&gt;"
               for c in fig["timeline-plot"]["data"][-1]["customdata"])


def test_an_empty_report_has_a_page():
    page = memprof.Report(device="cpu").to_html()
    assert "No profiled step yet" in page and "No profiled step: no timeline" in page and figures(page) == {}


def test_without_plotly_the_error_says_what_to_install(report, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "plotly", None)
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    with pytest.raises(ImportError, match=r'pip install plotly \(or pip install "memprof\[html\]"\)'):
        report.to_html()
    # an out-of-memory breakdown is still written, as JSON alone
    from memprof import oom

    (json_path,) = oom.save(report, tmp_path)
    assert json_path.suffix == ".json" and memprof.Report.load(json_path).peak == report.peak
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]
    # and the command line says so before it runs a script
    assert memprof.cli.main(["track", "no_such_script.py", "--html", str(tmp_path / "r.html")]) == 2
    assert 'pip install plotly (or pip install "memprof[html]")' in capsys.readouterr().err


# -- advice ---------------------------------------------------------------------------
def ff_workload():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[FF() for _ in range(2)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8192, 256, device="cuda")
    return Workload(model, opt, x, lambda m, x: m(x).square().mean())


@pytest.fixture(scope="module")
def advice():
    plans = {"baseline": list, "ckpt": lambda: [Checkpointing()], "bf16": lambda: [Autocast("bf16")]}
    first = advise(ff_workload, "80GiB", target="h100", plans=plans, progress=False)
    # A budget between the smallest peak and the baseline's: some plans fit, the baseline does not.
    t = first.table
    budget = int((t["peak_reserved"].min() + t.loc["baseline", "peak_reserved"]) / 2)
    return advise(ff_workload, budget, target="h100", plans=plans, progress=False)


def test_advice_page_holds_each_plan(advice, tmp_path):
    t = advice.table
    assert not t.loc["baseline", "fits"] and t["fits"].any()
    # What a verify() on a GPU would add, for two plans of three.
    verified = pd.DataFrame({"measured_peak_reserved": [t.loc["baseline", "peak_reserved"] + MiB, 3 * MiB],
                             "measured_peak_allocated": [5 * MiB, 2 * MiB], "measured_seconds": [0.02, 0.03],
                             "fits_budget": [False, True]}, index=pd.Index(["baseline", advice.best], name="plan"))
    page = save_advice_html(advice, tmp_path / "a.html", verified).read_text()
    rows = Rows(page, "plan-table").rows
    head = texts(rows[0])
    assert head[:7] == ["plan", "peak reserved", "peak allocated", "saves vs now", "fits", "step time", "vs now"]
    assert head[7:] == ["measured reserved", "measured allocated", "measured step time", "fits, measured", "why"]
    assert [texts(r)[0] for r in rows[1:]] == list(t.index)
    for r in rows[1:]:
        name, cells = texts(r)[0], dict(zip(head, texts(r)))
        p = t.loc[name]
        assert cells["peak reserved"] == fmt_bytes(p["peak_reserved"])
        assert int(r[1][1][0]["data-bytes"]) == p["peak_reserved"]
        assert int(r[1][2][0]["data-bytes"]) == p["peak_allocated"]
        assert cells["fits"] == ("yes" if p["fits"] else "no") and cells["step time"] == (
            f"{1e3 * p['seconds']:.1f} ms" + ("*" if p["device_share"] < 0.9 else ""))
        assert r[0]["class"] == ("best" if name == advice.best else "" if p["fits"] else "nofit")
        if name in verified.index:
            m = verified.loc[name]
            assert cells["measured reserved"] == fmt_bytes(m["measured_peak_reserved"])
            assert cells["measured step time"] == f"{1e3 * m['measured_seconds']:.1f} ms"
        else:
            assert cells["measured reserved"] == ""
    assert ("* host-bound: the host issuing kernels" in page) == bool((t["device_share"] < 0.9).any())
    fig = figures(page)
    assert set(fig) == {"plan-plot", "timeline-plot", "module-plot"}
    bars = {b["name"]: b for b in fig["plan-plot"]["data"]}
    assert list(bars) == ["peak reserved", "peak allocated", "measured peak reserved", "measured peak allocated",
                          "step time", "measured step time"]
    assert bars["peak reserved"]["y"] == list(t.index) and bars["peak reserved"]["x"] == t["peak_reserved"].tolist()
    assert bars["step time"]["x"] == [1e3 * s for s in t["seconds"]]
    assert bars["measured peak reserved"]["x"] == [
        int(verified.at[n, "measured_peak_reserved"]) if n in verified.index else None for n in t.index]
    assert bars["peak reserved"]["marker"]["opacity"] == [1.0 if f else 0.4 for f in t["fits"]]
    # The budget: a line on the plans' chart and on the baseline's timeline.
    assert [s["x0"] for s in fig["plan-plot"]["layout"]["shapes"]] == [advice.budget]
    assert any(s.get("y0") == advice.budget for s in fig["timeline-plot"]["layout"]["shapes"])
    assert page.count(get_plotlyjs()) == 1
    assert f"Recommended: <b>{advice.best}</b>" in page


def test_advice_page_without_measurements(advice):
    page = advice_html(advice)
    head = texts(Rows(page, "plan-table").rows[0])
    assert "measured reserved" not in head
    assert [b["name"] for b in figures(page)["plan-plot"]["data"]] == ["peak reserved", "peak allocated", "step time"]


def test_advise_cli_writes_the_advice_page(tmp_path):
    out, data = tmp_path / "advice.html", tmp_path / "advice.json"
    r = subprocess.run([sys.executable, "-m", "memprof.cli", "advise", "examples/train_mlp.py", "--budget", "t4",
                        "--html", out, "--json", data], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"HTML page saved to {out}" in r.stdout
    page = out.read_text()
    plans = [p["plan"] for p in json.loads(data.read_text())["plans"]]
    assert [row[0]["data-plan"] for row in Rows(page, "plan-table").rows[1:]] == plans
    assert set(figures(page)) == {"plan-plot", "timeline-plot", "module-plot"}
    # The baseline's timeline, simulated: fragmentation above the allocated stack.
    names = [t["name"] for t in figures(page)["timeline-plot"]["data"]]
    assert "fragmentation" in names and "peak since the previous sample" in names


# -- in a browser ---------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("needs Chromium (Debian package chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def open_page(browser, path: Path):
    tab = browser.new_page(viewport={"width": 1200, "height": 900})
    errors = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.on("requestfailed", lambda r: errors.append(r.url))
    tab.goto(path.as_uri())
    tab.wait_for_selector("#timeline-plot .main-svg")
    return tab, errors


def test_chromium_draws_hover_and_zoom(report, browser, tmp_path):
    tab, errors = open_page(browser, report.save_html(tmp_path / "r.html"))
    plot = tab.locator("#timeline-plot")
    plot.scroll_into_view_if_needed()
    area = tab.locator("#timeline-plot .nsewdrag").first.bounding_box()
    # Over the middle of step 1's samples: its hover lists the sample and the categories' sizes.
    tab.mouse.move(area["x"] + area["width"] / 2, area["y"] + area["height"] / 2)
    tab.wait_for_selector("#timeline-plot .hoverlayer .legend", timeout=5000)
    hover = tab.locator("#timeline-plot .hoverlayer").text_content()
    assert "step 1, " in hover and "allocated" in hover
    assert re.search(r"parameters 2\.00 MiB", hover) and re.search(r"optimizer_state \d+\.\d\d MiB", hover)
    # Zoom: the modebar is there, and a drag over the plot narrows the x axis.
    assert tab.locator("#timeline-plot .modebar").count() == 1
    x0 = area["x"] + area["width"] * 0.3
    tab.mouse.move(x0, area["y"] + 20)
    tab.mouse.down()
    tab.mouse.move(x0 + area["width"] * 0.2, area["y"] + 20, steps=5)
    tab.mouse.up()
    lo, hi = tab.evaluate("document.getElementById('timeline-plot').layout.xaxis.range")
    assert 0 < hi - lo < 0.5 * len(report.timeline)
    # Every figure drew; nothing was fetched.
    assert tab.locator(".plot .main-svg").count() >= 2 and errors == []
    shot = tab.screenshot(full_page=True)
    blank = browser.new_page(viewport={"width": 1200, "height": 900})
    empty = blank.screenshot(full_page=True)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20 * len(empty) and len(shot) > 100_000


def test_chromium_draws_the_advice_page(advice, browser, tmp_path):
    tab, errors = open_page(browser, save_advice_html(advice, tmp_path / "a.html"))
    for div in ("plan-plot", "timeline-plot", "module-plot"):
        assert tab.locator(f"#{div} .main-svg").count() >= 1
    bars = tab.locator("#plan-plot .bars .point").count()
    assert bars == 3 * len(advice.table) and errors == []
