"""Rich rendering of a Report: a category table and a module tree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from rich.console import Console, RenderableType
from rich.table import Table
from rich.tree import Tree

from .categories import ALLOCATED, OUTSIDE_ALLOCATED
from .units import fmt_bytes

if TYPE_CHECKING:
    from .report import Report

__all__ = ["render_report", "report_text", "category_table", "module_tree"]

_TREE_COLUMNS = ("parameters", "gradients", "optimizer_state", "activations")


def category_table(report: "Report") -> Table:
    peak = report.peak
    title = f"memprof ({report.source}) on {report.device}"
    if peak is None:
        table = Table(title=title)
        table.add_column("no profiled step yet")
        return table
    table = Table(title=f"{title}: peak of step {peak.step} in {peak.phase}", title_justify="left")
    table.add_column("category")
    table.add_column("size", justify="right")
    table.add_column("share", justify="right")
    total = peak.allocated
    for cat in ALLOCATED:
        b = peak.bytes.get(cat.value, 0)
        table.add_row(cat.value, fmt_bytes(b), f"{100 * b / total:.1f} %" if total else "-")
    table.add_row("allocated", fmt_bytes(total), "100.0 %", style="bold")
    for cat in OUTSIDE_ALLOCATED:
        if cat.value in peak.bytes:
            table.add_row(cat.value, fmt_bytes(peak.bytes[cat.value]), "", style="dim")
    for name, b in sorted(report.optimizer_state.items()):
        table.add_row(f"  optimizer_state.{name}", fmt_bytes(b), "", style="dim")
    return table


def module_tree(report: "Report", max_depth: int = 3, min_share: float = 0.01) -> Tree:
    """Modules with their subtree totals; small or deep ones are folded away."""
    df = report.modules
    names = list(df.index)
    own = df[list(_TREE_COLUMNS)].to_dict(orient="index")
    subtotal = {n: dict.fromkeys(_TREE_COLUMNS, 0) for n in names}
    for n in names:  # each module adds itself to its ancestors
        parts = n.split(".")
        for i in range(1, len(parts) + 1):
            anc = ".".join(parts[:i])
            if anc in subtotal:
                for c in _TREE_COLUMNS:
                    subtotal[anc][c] += int(own[n][c])
    grand = sum(subtotal[names[0]].values()) if names else 0

    def label(n: str) -> str:
        s = subtotal[n]
        cells = "  ".join(f"{c[:5]} {fmt_bytes(s[c])}" for c in _TREE_COLUMNS if s[c])
        return f"[bold]{n.rsplit('.', 1)[-1]}[/] ({df.at[n, 'type']})  {cells}"

    root = Tree(label(names[0]) if names else "no modules")
    nodes = {names[0]: root} if names else {}
    for n in names[1:]:
        parent = n.rpartition(".")[0]
        depth = n.count(".")
        if parent not in nodes or depth > max_depth or sum(subtotal[n].values()) < min_share * grand:
            continue
        nodes[n] = nodes[parent].add(label(n))
    return root


def render_report(report: "Report") -> Iterator[RenderableType]:
    yield category_table(report)
    if len(report.modules):
        yield module_tree(report)


def report_text(report: "Report", width: int = 110) -> str:
    console = Console(width=width, record=True, file=None, force_terminal=False, color_system=None)
    with console.capture() as capture:
        for r in render_report(report):
            console.print(r)
    return capture.get()
