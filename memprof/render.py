"""Rich rendering of a Report: a category table and a module tree."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterator

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from .categories import ALLOCATED, OUTSIDE_ALLOCATED
from .units import fmt_bytes

if TYPE_CHECKING:
    from .report import Report

__all__ = ["batch_shapes_note", "render_report", "report_text", "category_table", "module_tree"]

# The at-peak columns the tree shows, and their short labels.
_AT_PEAK = {
    "parameters": "params",
    "buffers": "buffers",
    "gradients": "grads",
    "optimizer_state": "optim",
    "activations": "activ",
    "activation_gradients": "act.grads",
    "inputs": "inputs",
}
_OVER_STEP = {"activations_saved_over_step": "activ saved over step"}


def category_table(report: "Report") -> Table:
    peak = report.peak
    title = f"memprof ({report.source}) on {report.device}"
    if peak is None:
        table = Table(title=title)
        table.add_column("no profiled step yet")
        return table
    title = f"{title}: peak of step {peak.step} in {peak.phase}"
    # As wide as its title, so that a phase ("optimizer step") is not split over two lines.
    table = Table(title=title, title_justify="left", min_width=len(title))
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
    for field in ("optimizer_state", "other_models"):
        for name, b in sorted(getattr(report, field).items()):
            table.add_row(f"  {field}.{name}", fmt_bytes(b), "", style="dim")
    return table


def module_tree(report: "Report", max_depth: int = 3, min_share: float = 0.01, over_step: bool = False) -> Tree:
    """The module table as a tree: what each module held at the peak, its
    submodules included, so the root's cells are the category table's.
    ``over_step``: the bytes saved for backward over the whole step instead.
    Modules deeper than ``max_depth`` or holding less than ``min_share`` of
    the root's total are folded away."""
    df = report.modules
    columns = _OVER_STEP if over_step else _AT_PEAK
    columns = {c: label for c, label in columns.items() if c in df.columns}
    peak = report.peak
    if over_step:
        title = "modules: bytes saved for backward over the step, submodules included"
    else:
        where = f" (step {peak.step}, {peak.phase})" if peak is not None else ""
        title = f"modules at the peak{where}, submodules included"
    tree = Tree(f"[bold]{title}[/]")
    names = list(df.index)
    if not names:
        tree.add("no modules")
        return tree
    rows = df[list(columns)].astype("int64").to_dict(orient="index")
    grand = sum(rows[names[0]].values())

    children: dict[str, list[str]] = {n: [] for n in names}
    shown = {names[0]}
    for n in names[1:]:
        parent = n.rpartition(".")[0]
        if parent in shown and n.count(".") <= max_depth and sum(rows[n].values()) >= min_share * grand:
            shown.add(n)
            children[parent].append(n)

    def cells(n: str) -> str:
        return "  ".join(f"{columns[c]} {fmt_bytes(b)}" for c, b in rows[n].items() if b)

    @functools.cache
    def shape(n: str) -> tuple:
        """What a module shows: its class, cells and submodules' (their names relative)."""
        return (df.at[n, "type"], tuple(rows[n].values()),
                tuple((c.rsplit(".", 1)[-1], shape(c)) for c in children[n]))

    def add(node: Tree, n: str, name: str | None = None) -> None:
        branch = node.add(name or f"[bold]{n.rsplit('.', 1)[-1]}[/] ({df.at[n, 'type']})  {cells(n)}")
        for first, run in _runs(children[n], shape):
            if len(run) == 1:
                add(branch, first)
                continue
            # A stack of identical blocks (a transformer's layers at the end of the forward): one line for all.
            span = f"{first.rsplit('.', 1)[-1]}-{run[-1].rsplit('.', 1)[-1]}"
            add(branch, first, f"[bold]{span}[/] ({df.at[first, 'type']} x{len(run)}, each)  {cells(first)}")

    add(tree, names[0])
    return tree


def _runs(names: list[str], shape) -> Iterator[tuple[str, list[str]]]:
    """``names`` in order, consecutive numbered siblings that show the same grouped together."""
    run: list[str] = []
    for n in names:
        last = run[-1].rsplit(".", 1)[-1] if run else None
        index = n.rsplit(".", 1)[-1]
        if run and last.isdigit() and index.isdigit() and int(index) == int(last) + 1 and shape(n) == shape(run[0]):
            run.append(n)
            continue
        if run:
            yield run[0], run
        run = [n]
    if run:
        yield run[0], run


def batch_shapes_note(meta: dict) -> str:
    """What a report whose steps ran on batches of several shapes says about its peak."""
    def text(shape: list) -> str:  # the input tensors' shapes: "(8, 64)", "[(8, 64), (8, 64)]" for ids and a mask
        one = ", ".join(str(tuple(t)) for t in shape)
        return one if len(shape) == 1 else f"[{one}]"

    shapes, seen = meta["batch_shapes"], meta.get("batch_shapes_seen", len(meta["batch_shapes"]))
    shown = "; ".join(map(text, shapes))
    peak = meta.get("peak_batch_shape")
    at = f" The peak is that of a step on {text(peak)}." if peak is not None else ""
    more = "; ..." if seen > len(shapes) else ""
    return (f"The model's inputs changed shape between steps ({seen} shapes: {shown}{more}), and each step's peak "
            f"follows its batch.{at} A larger batch later in the run (a longer sequence "
            "under dynamic padding) needs more: pad to the longest length, or track a step on the largest batch, "
            "to size the GPU.")


def growth_note(steps: Any) -> str | None:
    """A note where memory left allocated at each step's end grows from step to step: the script keeps
    tensors of earlier steps (a loss, an output or a validation loss kept with its graph), and then the
    peak depends on how long the run goes, not on the step."""
    if steps is None or "allocated" not in steps or len(steps) < 3:
        return None
    ends = [int(x) for x in steps["allocated"].dropna()]
    if len(ends) < 3:
        return None
    rises = [b - a for a, b in zip(ends, ends[1:])]
    if min(rises) < max(1 << 20, ends[0] // 100):  # every step keeps at least 1 MiB (1 % of what is held)
        return None
    per_step = (ends[-1] - ends[0]) // (len(ends) - 1)
    return (f"memory grows across steps: {fmt_bytes(per_step)} more is allocated at the end of each step "
            f"({fmt_bytes(ends[0])} after the first observed step, {fmt_bytes(ends[-1])} after the last). "
            "The script keeps tensors from earlier steps, most often a loss or an output kept with its autograd "
            "graph (running_loss += loss, history.append(loss), a validation loss computed without "
            "torch.no_grad()): keep loss.item() or a detached tensor. The peak above grows with the run's length; "
            "kept saved tensors of earlier steps count as temporaries.")


def render_report(report: "Report") -> Iterator[RenderableType]:
    yield category_table(report)
    growth = growth_note(report.steps)
    if growth:
        yield Text(growth)
    for what, why in (report.meta.get("simulation_notes") or {}).items():
        yield Text(f"simulated differently: {what}: {why}")  # not markup: "x[mask]"
    if report.meta.get("batch_shapes"):
        yield Text(batch_shapes_note(report.meta))
    if len(report.modules):
        yield module_tree(report)


def report_text(report: "Report", width: int = 110) -> str:
    console = Console(width=width, record=True, file=None, force_terminal=False, color_system=None)
    with console.capture() as capture:
        for r in render_report(report):
            console.print(r)
    return capture.get()
