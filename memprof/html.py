"""A Report as one self-contained HTML page: the category table, a chart of
the timeline's categories, and the module tree. No scripts, no network."""

from __future__ import annotations

import html
import io
from typing import TYPE_CHECKING

from rich.console import Console

from .categories import ALLOCATED
from .units import fmt_bytes

if TYPE_CHECKING:
    from .report import Report

__all__ = ["report_html"]

# One colour per allocated category, in ALLOCATED's order.
_COLOURS = ["#4e79a7", "#76b7b2", "#f28e2b", "#e15759", "#59a14f", "#edc948", "#b07aa1", "#bab0ac"]


def timeline_svg(report: "Report", width: int = 900, height: int = 260) -> str:
    """Stacked areas of the categories over the samples of the last profiled step."""
    tl = report.timeline
    if tl.empty:
        return "<p>No profiled step: no timeline.</p>"
    tl = tl[tl["step"] == tl["step"].max()].reset_index(drop=True)
    cats = [c.value for c in ALLOCATED]
    top = max(int(tl[cats].sum(axis=1).max()), 1)
    n = max(len(tl) - 1, 1)

    def x(i: int) -> float:
        return 40 + (width - 50) * i / n

    def y(v: float) -> float:
        return height - 20 - (height - 30) * v / top

    layers = []
    below = [0.0] * len(tl)
    for cat, colour in zip(cats, _COLOURS):
        above = [b + float(v) for b, v in zip(below, tl[cat])]
        if any(a > b for a, b in zip(above, below)):
            pts = [f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(above)]
            pts += [f"{x(i):.1f},{y(v):.1f}" for i, v in reversed(list(enumerate(below)))]
            layers.append(f'<polygon class="layer" data-category="{cat}" fill="{colour}" points="{" ".join(pts)}"><title>{cat}</title></polygon>')
        below = above
    legend = "".join(
        f'<span class="key"><span style="background:{c}"></span>{cat}</span>' for cat, c in zip(cats, _COLOURS)
    )
    step = int(tl["step"].iloc[0])
    return (
        f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">'
        f'<text x="40" y="12" font-size="11">{fmt_bytes(top)}</text>'
        f'<line x1="40" y1="{height - 20}" x2="{width - 10}" y2="{height - 20}" stroke="#333"/>'
        f'{"".join(layers)}</svg><figcaption>Allocated memory by category over the {len(tl)} samples of step {step} '
        f'(forward, backward, optimizer). {legend}</figcaption></figure>'
    )


def report_html(report: "Report", title: str | None = None) -> str:
    from .render import category_table, module_tree

    console = Console(record=True, width=120, file=io.StringIO(), color_system="truecolor")
    console.print(category_table(report))
    table = console.export_html(inline_styles=True, code_format="<pre class=\"rich\">{code}</pre>")
    console.print(module_tree(report))
    tree = console.export_html(inline_styles=True, code_format="<pre class=\"rich\">{code}</pre>")
    title = title or f"memprof report ({report.source}) on {report.device}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
pre.rich {{ font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.3; }}
.key {{ margin-left: 1em; white-space: nowrap; }}
.key span {{ display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.3em; vertical-align: middle; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<section id="categories"><h2>Where the memory went</h2>{table}</section>
<section id="timeline"><h2>Timeline</h2>{timeline_svg(report)}</section>
<section id="modules"><h2>Modules at the peak</h2><p>What each module held at the moment of the peak, its
submodules included, so the root's figures are the category table's. Bytes saved over the whole step are in
<code>report.modules["activations_saved_over_step"]</code>.</p>{tree}</section>
</body></html>
"""
