"""A Report, or an advice, as one self-contained interactive HTML page.

The charts are plotly figures (hover, zoom and pan built in): the timeline
stacked by category with the step's phases as bands, the modules' bytes at
the peak as bars, and for an advice each plan's predicted (and measured)
peak and step time. Each figure is embedded as JSON and drawn by plotly.js,
which the page holds once, so it works offline. The tables are plain HTML
tables. plotly is optional: it is imported only here, when a page is made.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from .categories import ALLOCATED, OUTSIDE_ALLOCATED, Category
from .render import batch_shapes_note
from .report import MODULE_CATEGORIES, Phase, _atomic_write, module_children, phase_kind
from .units import GiB, KiB, MiB, fmt_bytes

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from .advisor import Advice
    from .report import Report

__all__ = ["report_html", "advice_html", "save_advice_html", "require_plotly", "timeline_figure", "module_figure", "advice_figure"]

log = logging.getLogger(__name__)

# One colour per category, the same in every chart of a page.
_COLOURS = dict(zip(
    [c.value for c in (*ALLOCATED, Category.FRAGMENTATION)],
    ["#4e79a7", "#76b7b2", "#f28e2b", "#e15759", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
     "#d9d9d9"],
    strict=True,
))
# The phase kinds shaded on the timeline: a band per run of samples of one kind.
_BANDS = {
    Phase.FORWARD: ("forward", "rgba(78,121,167,0.10)"),
    Phase.BACKWARD: ("backward", "rgba(225,87,89,0.09)"),
    Phase.RECOMPUTE: ("backward", "rgba(225,87,89,0.09)"),
    Phase.OPTIMIZER_STEP: ("optimizer", "rgba(89,161,79,0.12)"),
}
#: Modules in the bar chart: a 100-module model stays readable.
TOP_MODULES = 30
# A level line (a budget, the device's use) this far above the chart's data
# would squash it: it is named in a note instead.
_OFF_CHART = 1.5
# Over more steps than these the timeline's bands go unlabelled, and only some steps are named on the axis.
_LABELLED_STEPS = 6
# A band narrower than this share of the samples stays unlabelled (its label would not fit).
_LABEL_WIDTH = 0.06
_STEP_TICKS = 12
_CONFIG = {"responsive": True, "displaylogo": False}
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; font-size: 14px; margin: 0.5em 0 1.5em; }
th, td { padding: 0.2em 0.8em; border-bottom: 1px solid #e4e4e4; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, #module-table td:nth-child(2), #module-table th:nth-child(2) { text-align: left; }
th { background: #f4f4f4; }
tr.sub td, tr.outside td { color: #777; }
tr.sub td:first-child { padding-left: 2em; }
tr.total td, tr.best td { font-weight: 600; }
tr.nofit td { color: #999; }
td.why, th.why { text-align: left; white-space: normal; min-width: 18em; color: #555; }
.wide { overflow-x: auto; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; vertical-align: baseline; }
.plot { width: 100%; }
p.note { color: #555; max-width: 60em; }
"""


def require_plotly():
    """plotly's graph objects, or an ImportError that says how to install it."""
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise ImportError(
            'memprof\'s HTML pages draw their charts with plotly, which is not installed: '
            'pip install plotly (or pip install "memprof[html]")'
        ) from exc
    return go


def _byte_axis(top: float) -> dict[str, Any]:
    """Ticks in base-2 units for an axis of bytes: plotly's own would be SI (1M = 10^6)."""
    if top <= 0:
        return {}
    unit, name = next(((u, n) for u, n in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")) if top >= u), (1, "B"))
    raw = top / unit / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    ticks = [i * step for i in range(int(top / unit / step) + 2)]
    return {"tickvals": [t * unit for t in ticks], "ticktext": [f"{t:.4g} {name}" for t in ticks]}


def _levels(fig: "go.Figure", levels: list[tuple[int, str]], top: float, vertical: bool = False) -> None:
    """Dashed lines at ``levels`` (bytes, label); those far above ``top`` in one note in the corner."""
    far = []
    for y, label in levels:
        if y > _OFF_CHART * top:
            far.append(f"{label} {fmt_bytes(y)}")
        elif vertical:
            fig.add_vline(x=y, line_dash="dash", line_color="#c00", annotation_text=f"{label} {fmt_bytes(y)}",
                          annotation_position="top right", row=1, col=1)
        else:
            fig.add_hline(y=y, line_dash="dash", line_color="#555", annotation_text=f"{label} {fmt_bytes(y)}",
                          annotation_position="top right")
    if far:
        fig.add_annotation(xref="paper", yref="paper", x=1, y=1.02, xanchor="right", yanchor="bottom",
                           showarrow=False, font_size=11, text="above the chart: " + "; ".join(far))


def _peak_sample(tl: pd.DataFrame) -> tuple[int, int]:
    """The timeline's peak, as the report picks it: (row, bytes).

    The highest allocated bytes between two samples (``interval_peak``;
    without allocator counters, the samples'), in the latest step that
    reaches them; at the sample that holds them if one does, else at the
    end of the interval that held them."""
    high = tl["interval_peak"].fillna(tl["allocated"]) if "interval_peak" in tl else tl["allocated"]
    top = int(high.max())
    last = tl["step"] == tl.loc[high == top, "step"].max()
    at = tl.index[last & (tl["allocated"] == top)]
    return int(at[0] if len(at) else tl.index[last & (high == top)][0]), top


def timeline_figure(report: "Report", budget: int | None = None) -> "go.Figure | None":
    """The timeline's samples stacked by category (and fragmentation, where
    the allocator's counters give the reserved bytes), with the phase bands,
    the peak, and the budget and the device's use at the peak as lines.
    None without a timeline."""
    go = require_plotly()
    tl = report.timeline.reset_index(drop=True)
    if tl.empty:
        return None
    x = list(range(len(tl)))
    phases = [html.escape(str(p)) for p in tl["phase"]]
    fig = go.Figure()
    stack = {c.value: tl[c.value].astype("int64") for c in ALLOCATED if c.value in tl and tl[c.value].any()}
    reserved = pd.to_numeric(tl.get("reserved"), errors="coerce") if "reserved" in tl else None
    counters = reserved is not None and reserved.notna().all()
    if counters and (reserved > tl["allocated"]).any():
        stack[Category.FRAGMENTATION.value] = (reserved - tl["allocated"]).clip(lower=0).astype("int64")
    for name, values in stack.items():
        fig.add_trace(go.Scatter(
            x=x, y=values.tolist(), name=name, stackgroup="memory", mode="lines", line={"width": 0.5},
            fillcolor=_COLOURS[name], line_color=_COLOURS[name], customdata=[fmt_bytes(v) for v in values],
            # Hatched: fragmentation is reserved, not allocated.
            fillpattern={"shape": "/", "fgcolor": "#999", "solidity": 0.3} if name == "fragmentation" else None,
            hovertemplate=f"{name} %{{customdata}}<extra></extra>",
        ))
    if counters and "interval_peak" in tl and (tl["interval_peak"] > tl["allocated"]).any():
        # The allocator's peak between two samples: what the stack, read at the samples, cannot show.
        fig.add_trace(go.Scatter(
            x=x, y=tl["interval_peak"].astype("int64").tolist(), name="peak since the previous sample",
            mode="lines", line={"color": "#c00", "width": 1, "dash": "dot", "shape": "vh"},
            customdata=[fmt_bytes(v) for v in tl["interval_peak"]],
            hovertemplate="peak since the previous sample %{customdata}<extra></extra>",
        ))
    # Unified hover lists every trace at one x, the last added first: this line's entry names the sample.
    fig.add_trace(go.Scatter(
        x=x, y=tl["allocated"].astype("int64").tolist(), name="allocated", mode="lines",
        line={"color": "#333", "width": 1}, customdata=[[int(s), p, fmt_bytes(a)] for s, p, a in
                                                        zip(tl["step"], phases, tl["allocated"])],
        hovertemplate="<b>step %{customdata[0]}, %{customdata[1]}</b><br>allocated %{customdata[2]}<extra></extra>",
    ))
    # Sample i closes the interval (i-1, i], which ran in its phase. Over many steps
    # the bands' labels would cover the chart: the hover names the phase anyway.
    kinds = [_BANDS.get(phase_kind(str(p))) for p in tl["phase"]]
    labelled = tl["step"].nunique() <= _LABELLED_STEPS
    start = 0
    for i in range(1, len(tl) + 1):
        if i < len(tl) and kinds[i] == kinds[start] and tl["step"].iat[i] == tl["step"].iat[start]:
            continue
        if kinds[start] is not None:
            label, colour = kinds[start]
            # A label wider than its band would run into the next one's.
            wide = i - 1 - max(start - 1, 0) >= _LABEL_WIDTH * len(tl)
            named = {"annotation_text": label, "annotation_position": "top left", "annotation_font_size": 10,
                     "annotation_font_color": "#666"} if labelled and wide else {}
            fig.add_vrect(x0=max(start - 1, 0), x1=i - 1, fillcolor=colour, line_width=0, layer="below", **named)
        start = i
    row, top = _peak_sample(tl)
    fig.add_annotation(x=row, y=top, name="peak", text=f"peak {fmt_bytes(top)}<br>step {tl['step'].iat[row]}, "
                       f"{phases[row]}", showarrow=True, arrowhead=2, ax=-40, ay=-35, bgcolor="rgba(255,255,255,0.8)")
    highest = int(max(top, reserved.max() if counters else 0))
    levels = [] if budget is None else [(budget, "budget")]
    peak = report.peak
    if peak is not None and peak.reserved is not None and Category.NON_PYTORCH.value in peak.bytes:
        levels.append((peak.reserved + peak.bytes[Category.NON_PYTORCH.value], "in use on the device at the peak"))
    _levels(fig, levels, highest)
    shown = max([highest, *(y for y, _ in levels if y <= _OFF_CHART * highest)])
    firsts = tl.index[tl["step"] != tl["step"].shift()]
    firsts = firsts[:: -(-len(firsts) // _STEP_TICKS)]  # at most that many step labels
    fig.update_layout(
        template="plotly_white", height=460, margin={"t": 50, "r": 20, "b": 50, "l": 70}, hovermode="x unified",
        # Headroom above the highest line: the bands' labels go there.
        legend={"orientation": "h", "y": -0.15}, yaxis={"title": "bytes", "range": [0, 1.15 * shown], **_byte_axis(shown)},
        xaxis={"title": "samples (each closes an interval of the step)", "tickvals": list(firsts),
               "ticktext": [f"step {tl['step'].iat[i]}" for i in firsts], "showgrid": True},
    )
    return fig


def _top_modules(df: pd.DataFrame, totals: pd.Series, top: int) -> list[str]:
    """The root's children and the biggest other modules, ``top`` in all, in the table's (tree) order."""
    root = df.index[0]
    if len(df) == 1:
        return [root]
    children = totals[module_children(df)[root]].sort_values(ascending=False, kind="stable")
    picked = set(children.index[:top])
    rest = totals.drop([root, *picked]).sort_values(ascending=False, kind="stable")
    picked |= set(rest.index[: top - len(picked)])
    return [n for n in df.index if n in picked and totals[n] > 0]


def module_figure(report: "Report", top: int = TOP_MODULES) -> "go.Figure | None":
    """Horizontal stacked bars: what each module held at the peak, its
    submodules included (the root's children and the biggest others, ``top``
    in all). None without modules."""
    go = require_plotly()
    df = report.modules
    cols = [c.value for c in MODULE_CATEGORIES if c.value in df]
    if df.empty or not cols:
        return None
    totals = df[cols].astype("int64").sum(axis=1)
    names = _top_modules(df, totals, top)
    if not names:
        return None
    labels = [html.escape(str(n)) for n in names]
    fig = go.Figure()
    for cat in cols:
        values = df.loc[names, cat].astype("int64")
        if values.any():
            fig.add_trace(go.Bar(
                y=labels, x=values.tolist(), name=cat, orientation="h", marker_color=_COLOURS[cat],
                customdata=[fmt_bytes(v) for v in values], hovertemplate=f"{cat} %{{customdata}}<extra></extra>",
            ))
    fig.update_layout(
        template="plotly_white", barmode="stack", hovermode="y unified", height=140 + 24 * len(names),
        margin={"t": 30, "r": 20, "b": 40, "l": 10},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "traceorder": "normal"},
        yaxis={"autorange": "reversed", "automargin": True}, xaxis=_byte_axis(int(totals[names].max())),
    )
    return fig


def _cell(b: int | float | None) -> str:
    """A size cell: readable, with the exact bytes in ``data-bytes``."""
    if b is None or pd.isna(b):
        return "<td></td>"
    return f'<td data-bytes="{int(b)}">{fmt_bytes(int(b))}</td>'


def _swatch(name: str) -> str:
    colour = _COLOURS.get(name)
    return f'<span class="swatch" style="background:{colour}"></span>' if colour else ""


def _category_table(report: "Report") -> str:
    """The peak's bytes by category, with the optimizer's state by name, as an HTML table."""
    peak = report.peak
    if peak is None:
        return "<p>No profiled step yet.</p>"
    total = peak.allocated
    rows = []
    for cat in ALLOCATED:
        b = peak.bytes.get(cat.value, 0)
        share = f"{100 * b / total:.1f} %" if total else "-"
        rows.append(f'<tr data-category="{cat.value}"><td>{_swatch(cat.value)}{cat.value}</td>{_cell(b)}'
                    f'<td>{share}</td></tr>')
        if cat in (Category.OPTIMIZER_STATE, Category.OTHER_MODELS):
            # The state at the end of the step by name, the other models by the script's names
            # for them: no share of the peak's moment.
            rows += [f'<tr class="sub"><td>{cat.value}.{html.escape(name)}</td>{_cell(sb)}<td></td></tr>'
                     for name, sb in sorted(getattr(report, cat.value).items())]
    rows.append(f'<tr class="total"><td>allocated</td>{_cell(total)}<td>100.0 %</td></tr>')
    rows += [f'<tr class="outside" data-category="{c.value}"><td>{_swatch(c.value)}{c.value}</td>'
             f'{_cell(peak.bytes[c.value])}<td></td></tr>' for c in OUTSIDE_ALLOCATED if c.value in peak.bytes]
    return ('<table id="category-table"><thead><tr><th>category</th><th>size</th><th>share of allocated</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>')


def _module_table(report: "Report", max_depth: int = 3, min_share: float = 0.01) -> str:
    """The module tree as an indented HTML table, folded as the terminal's
    tree is: modules deeper than ``max_depth`` or holding less than
    ``min_share`` of the root's total are left out."""
    df = report.modules
    if df.empty:
        return "<p>No modules.</p>"
    cols = [c.value for c in MODULE_CATEGORIES if c.value in df and df[c.value].any()]
    totals = df[cols].astype("int64").sum(axis=1)
    grand = totals.iat[0]
    shown: set[str] = set()
    rows = []
    for i, name in enumerate(df.index):
        parent, depth = name.rpartition(".")[0], name.count(".")
        if i and (parent not in shown or depth > max_depth or totals[name] < min_share * grand):
            continue
        shown.add(name)
        cells = "".join(_cell(df.at[name, c]) for c in cols)
        rows.append(f'<tr data-module="{html.escape(name)}"><td style="padding-left:{0.8 + 1.5 * depth}em" '
                    f'title="{html.escape(name)}">{html.escape(name.rsplit(".", 1)[-1])}</td>'
                    f'<td>{html.escape(str(df.at[name, "type"]))}</td>{cells}{_cell(totals[name])}</tr>')
    head = "".join(f"<th>{_swatch(c)}{c}</th>" for c in cols)
    folded = len(df) - len(shown)
    note = (f'<p class="note">{folded} module(s) deeper than {max_depth} levels or under {100 * min_share:g} % '
            "of the total are left out.</p>") if folded else ""
    return (f'<table id="module-table"><thead><tr><th>module</th><th>type</th>{head}<th>total</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>{note}')


def _report_sections(report: "Report", budget: int | None = None) -> tuple[str, dict[str, "go.Figure"]]:
    """The report's sections (categories, timeline, modules) and their figures by div id."""
    figures = {}
    timeline = timeline_figure(report, budget)
    if timeline is not None:
        figures["timeline-plot"] = timeline
        steps = ", ".join(str(s) for s in report.timeline["step"].unique())
        chart = (f'<p class="note">Allocated memory by category at each sample of step(s) {steps}, the '
                 "forward, backward and optimizer phases shaded; hover for the module, phase and sizes, drag to "
                 'zoom, double-click to zoom out.</p><div id="timeline-plot" class="plot"></div>')
    else:
        chart = "<p>No profiled step: no timeline.</p>"
    modules = module_figure(report)
    bars = ""
    if modules is not None:
        figures["module-plot"] = modules
        bars = '<div id="module-plot" class="plot"></div>'
    peak = report.peak
    where = f": peak of step {peak.step} in {html.escape(peak.phase)}" if peak is not None else ""
    notes = report.meta.get("simulation_notes") or {}
    simulated = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in notes.items())
    simulated = f'<p class="note">What the simulated GPU ran differently:</p><ul>{simulated}</ul>' if notes else ""
    if report.meta.get("batch_shapes"):
        simulated += f'<p class="note">{html.escape(batch_shapes_note(report.meta))}</p>'
    body = f"""
<section id="categories"><h2>Where the memory went{where}</h2>{_category_table(report)}{simulated}</section>
<section id="timeline"><h2>Timeline</h2>{chart}</section>
<section id="modules"><h2>Modules at the peak</h2><p class="note">What each module held at the moment of the peak,
its submodules included, so the root's figures are the category table's (the chart shows the root's children and the
biggest other modules, {TOP_MODULES} at most). Bytes saved over the whole step are in
<code>report.modules["activations_saved_over_step"]</code>.</p>{bars}{_module_table(report)}</section>"""
    return body, figures


def _page(title: str, body: str, figures: dict[str, "go.Figure"]) -> str:
    """One HTML page: plotly.js once, each figure as JSON drawn into its div."""
    from plotly.offline import get_plotlyjs

    # plotly's JSON escapes "<", ">" and "/", so no string in it can close the script element.
    specs = "".join(f'<script type="application/json" class="figure" data-div="{div}">{fig.to_json()}</script>'
                    for div, fig in figures.items())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_CSS}</style>
<script>{get_plotlyjs()}</script></head><body>
<h1>{html.escape(title)}</h1>{body}
{specs}<script>
for (const spec of document.querySelectorAll("script.figure")) {{
  const fig = JSON.parse(spec.textContent);
  Plotly.newPlot(spec.dataset.div, fig.data, fig.layout, {json.dumps(_CONFIG)});
}}
</script></body></html>
"""
    log.debug("HTML page %r: %d figure(s), %d bytes", title, len(figures), len(page))
    return page


def report_html(report: "Report", title: str | None = None) -> str:
    """One self-contained page: the category table, the timeline, the modules at the peak."""
    title = title or f"memprof report ({report.source}) on {report.device}"
    body, figures = _report_sections(report)
    return _page(title, body, figures)


# -- advice ---------------------------------------------------------------------------
# The columns of a verification (advisor.verify, script_advice.verify_script) shown next to the prediction.
_MEASURED = ["measured_peak_reserved", "measured_peak_allocated", "measured_seconds", "fits_budget", "error"]


def _plans(advice: "Advice", verified: pd.DataFrame | None) -> pd.DataFrame:
    """The ranked table with the measured columns of ``verified`` (per plan; NaN where not run)."""
    table = advice.table
    if verified is None or verified.empty:
        return table
    return table.join(verified[[c for c in _MEASURED if c in verified]])


def advice_figure(advice: "Advice", verified: pd.DataFrame | None = None) -> "go.Figure":
    """Grouped bars per plan: peak reserved and allocated (predicted, and measured where
    verified) against the budget, and the step time. Plans that do not fit are faded."""
    go = require_plotly()
    from plotly.subplots import make_subplots

    t = _plans(advice, verified)
    names = [html.escape(str(n)) for n in t.index]
    opacity = [1.0 if f else 0.4 for f in t["fits"]]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.62, 0.38], horizontal_spacing=0.03)
    bars = [("peak_reserved", "peak reserved", "#4e79a7", 1), ("peak_allocated", "peak allocated", "#a0cbe8", 1),
            ("measured_peak_reserved", "measured peak reserved", "#f28e2b", 1),
            ("measured_peak_allocated", "measured peak allocated", "#ffbe7d", 1),
            ("seconds", "step time", "#59a14f", 2), ("measured_seconds", "measured step time", "#edc948", 2)]
    for col, label, colour, where in bars:
        if col not in t:
            continue
        if where == 1:
            values = [None if pd.isna(v) else int(v) for v in t[col]]
            text = [fmt_bytes(v) for v in values]
        else:
            values = [None if pd.isna(v) else 1e3 * float(v) for v in t[col]]
            text = ["-" if v is None else f"{v:.1f} ms" for v in values]
        fig.add_trace(go.Bar(y=names, x=values, name=label, orientation="h", customdata=text,
                             marker={"color": colour, "opacity": opacity},
                             hovertemplate=f"{label} %{{customdata}}<extra></extra>"), row=1, col=where)
    memory = [c for c, *_, where in bars if where == 1 and c in t]
    top = float(t[memory].max().max())
    _levels(fig, [(advice.budget, "budget")], top, vertical=True)
    shown = top if advice.budget > _OFF_CHART * top else max(top, advice.budget)
    fig.update_layout(
        template="plotly_white", barmode="group", hovermode="y unified",
        height=190 + 28 * len(t) * (2 if "measured_seconds" in t else 1), margin={"t": 40, "r": 20, "b": 90, "l": 10},
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom"},
        yaxis={"autorange": "reversed", "automargin": True},
        xaxis={"title": "peak memory per rank", **_byte_axis(shown)},
        xaxis2={"title": "step time", "ticksuffix": " ms"},
    )
    return fig


def _plan_table(advice: "Advice", verified: pd.DataFrame | None) -> str:
    from .advisor import CHANGES_MARK, HOST_BOUND, HOST_BOUND_NOTE, step_time

    t = _plans(advice, verified)
    base = t.loc["baseline"] if "baseline" in t.index else None
    measured = "measured_peak_reserved" in t or "error" in t
    head = ["plan", "peak reserved", "peak allocated", "saves vs now", "fits", "step time", "vs now"]
    if measured:
        head += ["measured reserved", "measured allocated", "measured step time", "fits, measured"]
    rows = []
    for name, r in t.iterrows():
        saved = None if base is None or name == "baseline" else base["peak_reserved"] - r["peak_reserved"]
        saves = "" if saved is None else f"{fmt_bytes(saved)} ({100 * saved / base['peak_reserved']:.0f} %)"
        cls = "best" if name == advice.best else ("" if r["fits"] else "nofit")
        changes = r.get("changes") if isinstance(r.get("changes"), str) else ""
        mark = f" {CHANGES_MARK}" if changes else ""
        cells = (f'<td>{html.escape(str(name))}{mark}</td>{_cell(r["peak_reserved"])}{_cell(r["peak_allocated"])}'
                 f'<td>{saves}</td><td>{"yes" if r["fits"] else "no"}</td><td>{step_time(r)}</td>'
                 f'<td>{100 * (r["slowdown"] - 1):+.0f} %</td>')
        if measured:
            error = r.get("error")
            if isinstance(error, str):
                cells += f'<td colspan="4" class="why">{html.escape(error)}</td>'
            elif pd.isna(r.get("measured_peak_reserved")):
                cells += "<td></td>" * 4
            else:
                cells += (f'{_cell(r["measured_peak_reserved"])}{_cell(r["measured_peak_allocated"])}'
                          f'<td>{1e3 * r["measured_seconds"]:.1f} ms</td>'
                          f'<td>{"yes" if r["fits_budget"] else "no"}</td>')
        rows.append(f'<tr class="{cls}" data-plan="{html.escape(str(name))}">{cells}'
                    f'<td class="why">{html.escape(str(r["why"]))}'
                    f'{html.escape(f"; {CHANGES_MARK} changes what training computes: {changes}") if changes else ""}'
                    '</td></tr>')
    head_html = "".join(f"<th>{h}</th>" for h in head) + '<th class="why">why</th>'
    note = (f'<p class="note">* {html.escape(HOST_BOUND_NOTE)}</p>'
            if "device_share" in t and (t["device_share"] < HOST_BOUND).any() else "")
    return (f'<div class="wide"><table id="plan-table"><thead><tr>{head_html}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>{note}</div>')


def advice_html(advice: "Advice", verified: pd.DataFrame | None = None, title: str | None = None) -> str:
    """One self-contained page: the ranked plans (chart and table, measured
    next to predicted where ``verified``, default ``advice.verified``, has
    them), the recommendation, then the baseline's report. ``advice``: an
    :class:`~memprof.advisor.Advice` or a :class:`~memprof.script_advice.ScriptAdvice`."""
    from .advisor import recommendation_notes

    if verified is None:
        verified = getattr(advice, "verified", None)
    script = getattr(advice, "script", "")
    title = title or (f"memprof advice for {script}" if script else "memprof advice")
    where = f"{'simulated ' if getattr(advice, 'simulated', True) else ''}{advice.gpu.name}"
    best = advice.best
    if best is None:
        verdict = f"No plan fits {fmt_bytes(advice.budget)} per rank; more ranks or a larger GPU would."
    else:
        changes = "".join(f"<li>{html.escape(c)}</li>" for c in getattr(advice, "code_change", lambda: [])())
        verdict = f"Recommended: <b>{html.escape(best)}</b>, the fastest plan that fits."
        verdict += f"<ul>{changes}</ul>" if changes else ""
        verdict += "".join(f"</p><p>{html.escape(note)}" for note in recommendation_notes(advice.table))
    left_out = {**getattr(advice, "skipped", {}), **getattr(advice, "failed", {})}
    missing = "".join(f"<li><code>{html.escape(n)}</code>: {html.escape(w)}</li>" for n, w in left_out.items())
    figures = {"plan-plot": advice_figure(advice, verified)}
    report, report_figures = _report_sections(advice.baseline, budget=advice.budget)
    figures.update(report_figures)
    body = f"""
<section id="plans"><h2>Plans for {fmt_bytes(advice.budget)} per rank on {html.escape(where)}, {advice.world_size}
rank(s)</h2><p>{verdict}</p><p class="note">Fastest that fits first. A plan fits when its predicted peak reserved
memory, with a margin for the prediction's error, is within the budget; plans that do not fit are faded.</p>
<div id="plan-plot" class="plot"></div>{_plan_table(advice, verified)}
{f'<details><summary>{len(left_out)} plan(s) left out</summary><ul>{missing}</ul></details>' if missing else ''}</section>
<h2>The baseline: the step as it is</h2>{report}"""
    return _page(title, body, figures)


def save_advice_html(advice: "Advice", path: str | os.PathLike, verified: pd.DataFrame | None = None) -> Path:
    """Write :func:`advice_html` to ``path`` (atomically)."""
    page = advice_html(advice, verified)
    return _atomic_write(path, lambda f: f.write(page))
