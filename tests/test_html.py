"""HTML reports: content, and what headless Chromium renders of them."""

import shutil
import subprocess

import pytest

import memprof

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def test_html_holds_the_report(report, tmp_path):
    path = report.save_html(tmp_path / "r.html")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for text in ("parameters", "optimizer_state.exp_avg_sq", "2.00 MiB", "(Linear)", "Sequential"):
        assert text in page
    # One area per category that holds memory in the last profiled step's timeline.
    last = report.timeline[report.timeline["step"] == report.timeline["step"].max()]
    present = [c.value for c in memprof.categories.ALLOCATED if last[c.value].any()]
    assert page.count('class="layer"') == len(present)
    for cat in present:
        assert f'data-category="{cat}"' in page


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package chromium)")
def test_chromium_renders_it(report, tmp_path):
    path = report.save_html(tmp_path / "r.html")
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert "Where the memory went" in dom and "optimizer_state" in dom
    assert dom.count("<polygon") >= 4  # the timeline drew its areas
    shot = tmp_path / "r.png"
    subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1100,900",
         path.as_uri()],
        capture_output=True, timeout=120,
    )
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a page with content, not a blank
