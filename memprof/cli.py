"""The ``memprof`` command line.

::

    memprof track train.py --steps 3 --json report.json -- --batch-size 8
    memprof report report.json
    memprof gpus
    memprof estimate --params 7B --precision mixed_bf16 --zero-stage 3 --world-size 8 --gpu H100

Bad input ends with one line ``memprof: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import os
import re
import sys
import tempfile
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Sequence

import pandas as pd
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .devices import get_gpu, list_gpus
from .estimate import OFFLOADS, OPTIMIZERS, PRECISIONS, estimate_model_states
from .report import Report, _json_default
from .runner import ScriptError, observe_script
from .units import GiB, fmt_bytes

__all__ = ["main", "parse_count"]

log = logging.getLogger(__name__)

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_CPU_NOTE = (
    "On the CPU memprof attributes the storages it sees, without allocator counters: "
    "temporaries and fragmentation need CUDA."
)


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``7B``, ``124M``, ``1.5b``, ``350k``, ``7_000_000_000`` (decimal suffixes)."""
    match = re.fullmatch(r"\s*([0-9][0-9_,.]*(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    value = None
    if match:
        try:
            value = Decimal(match[1].replace("_", "").replace(",", "")) * _SUFFIXES[match[2].upper()]
        except InvalidOperation:
            value = None
    if value is None or value != value.to_integral_value() or value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of parameters >= 1; use e.g. 7e9, 7B, 1.5B, 124M or 7000000000"
        )
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _gib(n: int | float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _line(console: Console, text: str) -> None:
    """One line of plain text, never wrapped or read as markup."""
    console.print(escape(text), soft_wrap=True, highlight=False)


# -- commands -------------------------------------------------------------------
def _show(console: Console, report: Report) -> None:
    gpu = report.meta.get("gpu") or report.meta.get("target")
    where = "simulated" if report.source == "simulate" else report.device
    _line(console, f"device: {where}" + (f" ({gpu})" if gpu else ""))
    console.print(report)
    if report.device.startswith("cpu"):
        _line(console, _CPU_NOTE)


def _cmd_track(args: argparse.Namespace, console: Console) -> int:
    if args.target is not None:
        _line(console, f"memprof: simulating {get_gpu(args.target).name}: the script runs on shapes alone, no kernel "
              "runs, and values it prints are placeholders")
    try:
        report = observe_script(
            args.script, args.script_args, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
            target=args.target,
        )
    except ScriptError as exc:
        if exc.report is not None:  # what was measured before the failure
            _show(console, exc.report)
            _save(console, exc.report, args.json)
        if args.target is not None and isinstance(exc.__cause__, torch.OutOfMemoryError):
            _advise_after_oom(args, console)
        raise
    done = report.meta.get("observed_steps", len(report.steps))
    _line(console, f"memprof: observed {done} training step(s) of {args.script} after {args.warmup} warmup step(s)")
    _show(console, report)
    _save(console, report, args.json)
    _save(console, report, args.html, html=True)
    return 0


def _advise_after_oom(args: argparse.Namespace, console: Console) -> None:
    """The script ran out of the simulated GPU's memory: say what the advisor would change to fit it."""
    from .advisor import recommendation_notes
    from .script_advice import advise_script

    gpu = get_gpu(args.target).name
    _line(console, f"memprof: asking the advisor what fits the {gpu} (the script runs once more, simulated)")
    try:
        with _script_output(False, console) as (terminal, _):
            advice = advise_script(args.script, args.script_args, budget=args.target, target=args.target,
                                   timeout=args.timeout, progress=terminal)
    except (ScriptError, ValueError) as exc:
        log.warning("the advisor could not run the script: %s", exc)
        return
    if advice.best is None:
        _line(console, f"memprof: no plan of the advisor fits the {gpu}; more ranks (memprof advise --world-size) "
              "or a larger GPU would")
        return
    row = advice.table.loc[advice.best]
    _line(console, f"memprof: the advisor's top plan for the {gpu}: {advice.best}: peak "
          f"{fmt_bytes(row['peak_reserved'])} reserved (simulated); `memprof advise` shows the others")
    for change in advice.code_change():
        _line(console, f"  - {change}")
    for note in recommendation_notes(advice.table):
        _line(console, f"memprof: {note}")


def _cmd_advise(args: argparse.Namespace, console: Console) -> int:
    from .advisor import parse_budget, recommendation_notes
    from .script_advice import advise_script, verify_script

    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    simulate = args.target is not None or not torch.cuda.is_available()
    if simulate:
        named = parse_budget(args.budget)[1]
        gpu = get_gpu(args.target) if args.target is not None else (named or get_gpu("RTX4090-24GB"))
        why = "" if args.target is not None else "no GPU here: "
        _line(console, f"memprof: {why}every plan is simulated on the {gpu.name} (shapes only, no kernel runs)")
    with _script_output(args.verbose, console) as (terminal, log_path):
        try:
            advice = advise_script(
                args.script, args.script_args, budget=args.budget, target=args.target, world_size=args.world_size,
                steps=args.steps, timeout=args.timeout, progress=terminal,
            )
        except BaseException:
            _tail(console, log_path)
            raise
    if log_path:
        _line(console, f"memprof: the script's own output is in {log_path} (--verbose shows it)")
    _show(console, advice.baseline)
    if advice.facts is not None:
        _line(console, f"what {args.script} does already:")
        for fact in advice.facts.lines():
            _line(console, f"  {fact}")
    for name, why in advice.skipped.items():
        log.debug("plan %s left out: %s", name, why)
    if advice.skipped:
        reasons = sorted(set(advice.skipped.values()))
        _line(console, f"memprof: {len(advice.skipped)} plan(s) left out: {'; '.join(reasons)}")
    by_reason: dict[str, list[str]] = {}
    for name, why in advice.failed.items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        _line(console, f"memprof: {shown} could not run: {why}")
    shown = advice.table.head(args.top) if args.top else advice.table
    console.print(advice.rich_table(shown))
    for note in advice.notes():
        _line(console, f"memprof: {note}")
    best = advice.best
    if best is None:
        _line(console, f"memprof: no plan fits {_gib(advice.budget)} per rank; more ranks (--world-size) or a larger GPU would")
    else:
        row = advice.table.loc[best]
        _line(console, f"memprof: recommended: {best}: peak {fmt_bytes(row['peak_reserved'])} reserved, "
              f"step time {100 * (row['slowdown'] - 1):+.0f} % vs now" + (" (simulated)" if simulate else ""))
        for change in advice.code_change():
            _line(console, f"  - {change}")
    for note in recommendation_notes(advice.table):
        _line(console, f"memprof: {note}")
    if args.verify:
        if not torch.cuda.is_available():
            raise ValueError("--verify measures the plans on a GPU, and this machine has none")
        with _script_output(args.verbose, console) as (_, log_path):
            try:
                verified = verify_script(advice, args.script_args)
            except BaseException:
                _tail(console, log_path)
                raise
        console.print(_verified_table(verified))
    if args.json:
        import json

        def write() -> None:
            with open(args.json, "w") as f:
                json.dump(advice.to_dict(), f, indent=1, default=_json_default)

        _write("advice", args.json, write)
        _line(console, f"advice saved to {args.json}")
    if args.html:
        from .html import save_advice_html

        _write("HTML page", args.html, lambda: save_advice_html(advice, args.html))
        _line(console, f"HTML page saved to {args.html}: the plans and the baseline's report")
    return 0


def _verified_table(df: pd.DataFrame) -> Table:
    """Predicted next to measured, per plan run for real; a host-bound prediction marked ``*``."""
    from rich import box

    from .advisor import HOST_BOUND, HOST_BOUND_NOTE, step_time

    shares = df.get("predicted_device_share", pd.Series(dtype=float))
    t = Table(title="measured on this GPU", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0),
              show_edge=False, caption=f"* {HOST_BOUND_NOTE}" if (shares < HOST_BOUND).any() else None,
              caption_justify="left")
    # The measured steps' own spread (slowest less fastest, over their median) next to the
    # error: a host-bound step moves by itself from run to run, and an error within it is noise.
    for col in ("plan", "reserved\npredicted", "reserved\nmeasured", "step\npredicted", "step\nmeasured",
                "step time\nerror", "steps'\nspread", "fits"):
        t.add_column(col, justify="left" if col == "plan" else "right", no_wrap=True)
    for name, r in df.iterrows():
        if isinstance(r.get("error"), str):
            t.add_row(str(name), r["error"], "", "", "", "", "", "no")
            continue
        spread = r.get("measured_spread")
        t.add_row(str(name), fmt_bytes(r["predicted_peak_reserved"]), fmt_bytes(r["measured_peak_reserved"]),
                  step_time({"seconds": r["predicted_seconds"], "device_share": r.get("predicted_device_share", 1.0)}),
                  f"{1e3 * r['measured_seconds']:.1f} ms",
                  f"{100 * (r['predicted_seconds'] / r['measured_seconds'] - 1):+.0f} %",
                  "" if spread is None or pd.isna(spread) else f"{100 * spread:.0f} %",
                  "yes" if r["fits_budget"] else "no")
    return t


@contextlib.contextmanager
def _script_output(verbose: bool, console: Console):
    """The script's output (file descriptors 1 and 2, so its workers' too) in a log file, unless ``verbose``.

    Yields the console for the progress bar (None when there is no terminal)
    and the log's path (None when the output is shown)."""
    terminal = console if console.is_terminal else None
    try:
        fds = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not real files (e.g. captured in-process)
        fds = None
    if verbose or fds is None:
        yield terminal, None
        return
    fd, path = tempfile.mkstemp(prefix="memprof-advise-", suffix=".log")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(f) for f in fds]
    shown = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    progress = Console(file=shown, force_terminal=True) if terminal is not None else None
    try:
        for f in fds:
            os.dup2(fd, f)
        yield progress, path
    finally:
        # What the stopped script left (a progress bar prints as it is finalised) still writes to the log.
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        for f, old in zip(fds, saved):
            os.dup2(old, f)
            os.close(old)
        os.close(fd)
        shown.close()


def _tail(console: Console, path: str | None, lines: int = 20) -> None:
    """The end of the script's log, after a failure."""
    if not path:
        return
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()[-lines:]
    except OSError:
        return
    if text:
        _line(console, f"memprof: the last lines of the script's output ({path}):")
        for t in text:
            _line(console, f"  | {t}")


def _write(label: str, path: str, write: Callable[[], Any]) -> None:
    """Run ``write``; a path that cannot be written is bad input, said in one line."""
    try:
        write()
    except OSError as exc:
        raise OSError(f"cannot write the {label} to {path!r}: {exc.strerror or exc}; pick a writable path") from None


def _save(console: Console, report: Report, path: str | None, html: bool = False) -> None:
    if path is None:
        return
    label = "HTML report" if html else "report"
    _write(label, path, lambda: report.save_html(path) if html else report.save(path))
    again = "" if html else f"; show it again with: memprof report {path}"
    _line(console, f"{label} saved to {path}{again}")


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    if _is_pickle(args.file):  # an allocator snapshot, recorded without memprof
        from . import snapshot

        report = snapshot.to_report(snapshot.load(args.file))
        _line(console, f"snapshot {args.file}: the peak of allocated memory over its trace "
              f"({report.meta['trace_events']} events), each live block named by the frames that allocated it")
        _show(console, report)
        _line(console, "not told apart in a snapshot: " + "; ".join(report.meta["unknowable"]))
        _save(console, report, args.html, html=True)
        return 0
    try:
        report = Report.load(args.file)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{args.file!r} is not a memprof report (missing {exc}); give a file that memprof track --json wrote"
        ) from None
    script = report.meta.get("script")
    if script:
        _line(console, f"report of {script}: {len(report.steps)} step(s)")
    _show(console, report)
    _save(console, report, args.html, html=True)
    if args.snapshot:
        _write("snapshot", args.snapshot, lambda: report.save_snapshot(args.snapshot))
        _line(console, f"snapshot saved to {args.snapshot}; open it at pytorch.org/memory_viz (each block is named "
              "by its category and module)")
    return 0


def _is_pickle(path: str) -> bool:
    """Whether ``path`` is a pickle (``torch.cuda.memory._dump_snapshot`` writes protocol 2 or later)."""
    if str(path).endswith((".pickle", ".pkl")):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def _cmd_gpus(args: argparse.Namespace, console: Console) -> int:
    from rich import box

    from .devices import Segment

    df = list_gpus()
    table = Table(
        title="GPU catalogue: dense tensor-core TFLOPS with FP32 accumulate (FP32: CUDA cores), "
              "GB/s per direction, CC = compute capability",
        caption="BF16: bfloat16 tensor cores, at the FP16 rate; link: NVLink, Infinity Fabric on AMD (MI300X's "
                "CC is the 9.4 that ROCm reports)",
        title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), show_edge=False,
    )
    for header in ("GPU", "mem\nGiB", "mem\nGB/s", "FP16", "BF16", "TF32", "FP32", "PCIe\nGB/s", "link\nGB/s", "CC"):
        table.add_column(header, justify="left" if header == "GPU" else "right", no_wrap=True)

    def num(x, missing: str = "-") -> str:  # at most 4 characters: 2250, 989, 59.5, 8.1
        return missing if pd.isna(x) else f"{x:.0f}" if x >= 100 else f"{x:.3g}"

    for segment in Segment:
        rows = df[df.segment == segment.value]
        # Within a segment: NVIDIA first, then by generation, speed and size.
        order = sorted(rows.index, key=lambda n: (rows.at[n, "vendor"] != "nvidia", rows.at[n, "compute_capability"],
                                                  rows.at[n, "fp16_tflops"], rows.at[n, "memory_bytes"]))
        table.add_row(f"[bold]{segment.value}[/bold]")
        for i, name in enumerate(order):
            row = rows.loc[name]
            table.add_row(
                name, num(row.memory_gib), num(row.mem_gb_s), num(row.fp16_tflops), "yes" if row.bf16 else "no",
                num(row.tf32_tflops, "no"), num(row.fp32_tflops), num(row.pcie_gb_s), num(row.nvlink_gb_s),
                ".".join(map(str, row.compute_capability)), end_section=i == len(order) - 1,
            )
    console.print(table)
    return 0


def _cmd_estimate(args: argparse.Namespace, console: Console) -> int:
    offload = None if args.offload == "none" else args.offload
    states = estimate_model_states(
        args.params, args.precision, args.optimizer, args.zero_stage, args.world_size, offload
    )
    gpu = get_gpu(args.gpu) if args.gpu is not None else None  # fail before printing anything
    _line(console, f"{args.params:,} parameters, {args.precision}, {args.optimizer}, ZeRO stage {args.zero_stage}, "
                   f"world size {args.world_size}, offload {args.offload}")
    table = Table(title="model states per rank", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("bytes", justify="right")
    for name in ("parameters", "gradients", "master_weights", "optimizer_state"):
        b = getattr(states, name)
        table.add_row(name, f"{b / GiB:,.2f}", f"{b:,}")
    console.print(table)
    per_param = f"{states.bytes_per_param:.2f} B/param"
    _line(console, f"on the GPU: {_gib(states.total)} per rank ({states.total:,} B, {per_param})")
    if states.host_total:
        _line(console, f"offloaded to host memory: {_gib(states.host_total)} per rank ({states.host_total:,} B)")
    on_top = "activations, temporaries and the CUDA context come on top"
    if gpu is None:
        _line(console, f"model states only: {on_top}; add --gpu NAME to check a GPU (memprof gpus lists them)")
        return 0
    have = gpu.memory_bytes
    if states.total <= have:
        _line(console, f"fits {gpu.name} ({_gib(have)}): model states take {_gib(states.total)}, leaving "
                       f"{_gib(have - states.total)} for the rest (model states only: {on_top})")
    else:
        _line(console, f"does not fit {gpu.name} ({_gib(have)}): model states alone need {_gib(states.total)}, "
                       f"{_gib(states.total - have)} more than it has ({on_top}); "
                       "try a ZeRO stage, more ranks, or offload")
    return 0


# -- parser ---------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memprof", description="Where did my GPU memory go?")
    parser.add_argument("--version", action="version", version=f"memprof {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "track", help="run a training script and attribute its memory",
        description="Run SCRIPT as `python SCRIPT SCRIPT_ARGS` would, unmodified, and attribute the memory of "
        "its training steps. Arguments after -- go to the script.",
        usage="memprof track SCRIPT [--steps N] [--warmup N] [--timeout S] [--json PATH] [--html PATH] [--target GPU] "
        "[-- SCRIPT_ARGS...]",
    )
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("--steps", type=_positive_int, default=3, help="training steps to measure (default 3)")
    p.add_argument("--warmup", type=_positive_int, default=1,
                   help="optimizer steps to run before measuring (default 1, the least: it finds the model)")
    p.add_argument("--timeout", type=_positive_float, default=None, help="give up after this many seconds")
    p.add_argument("--json", metavar="PATH", default=None, help="save the report as JSON")
    p.add_argument("--target", metavar="GPU", default=None,
                   help="simulate the steps on this GPU from the catalogue (see memprof gpus) instead of measuring")
    p.add_argument("--html", metavar="PATH", default=None, help="save the report as a self-contained HTML page")
    p.set_defaults(func=_cmd_track)

    p = sub.add_parser(
        "advise", help="rank memory plans for a training script under a budget",
        description="Observe SCRIPT (run as `python SCRIPT SCRIPT_ARGS`), then simulate each plan (mixed precision, "
        "checkpointing, accumulation, offload, ZeRO) on it and rank those that fit BUDGET by predicted step time.",
        usage="memprof advise SCRIPT [--budget B] [--world-size N] [--steps N] [--target GPU] [--verify] [--json PATH] "
        "[--html PATH] [--top K] [--verbose] [-- SCRIPT_ARGS...]",
    )
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("--budget", default="RTX4090-24GB",
                   help="memory per rank: 24GiB, 80GB, or a GPU name (see memprof gpus); default rtx4090")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks for ZeRO plans (default 1)")
    p.add_argument("--steps", type=_positive_int, default=2, help="training steps to observe per plan (default 2)")
    p.add_argument("--target", metavar="GPU", default=None, help="simulate this GPU even when one is present")
    p.add_argument("--verify", action="store_true", help="run the top plans for real on this GPU and measure them")
    p.add_argument("--json", metavar="PATH", default=None, help="save the advice as JSON (schema: docs/advise-json.md)")
    p.add_argument("--html", metavar="PATH", default=None,
                   help="save the ranked plans and the baseline's report as a self-contained HTML page")
    p.add_argument("--top", type=_positive_int, default=None, metavar="K", help="show only the K best plans")
    p.add_argument("--timeout", type=_positive_float, default=None, help="give up on a run after this many seconds")
    p.add_argument("--verbose", action="store_true", help="show the script's own output (default: kept in a log file)")
    p.set_defaults(func=_cmd_advise)

    p = sub.add_parser("report", help="render a report saved with --json, or an allocator snapshot (.pickle)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--html", metavar="PATH", default=None, help="also write it as a self-contained HTML page")
    p.add_argument("--snapshot", metavar="PATH", default=None,
                   help="also write its peak as an allocator snapshot (pickle) for pytorch.org/memory_viz")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("gpus", help="list the GPU catalogue")
    p.set_defaults(func=_cmd_gpus)

    p = sub.add_parser("estimate", help="model-state memory (parameters, gradients, optimizer) per rank")
    p.add_argument("--params", type=parse_count, required=True, metavar="N",
                   help="number of parameters: 7e9, 7B, 124M, ...")
    p.add_argument("--precision", type=str.lower, choices=list(PRECISIONS), default="fp32")
    p.add_argument("--optimizer", type=str.lower, choices=list(OPTIMIZERS), default="adamw")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=0)
    p.add_argument("--world-size", type=_positive_int, default=1, metavar="W")
    p.add_argument("--offload", type=str.lower, default="none",
                   choices=["none" if o is None else o for o in OFFLOADS])
    p.add_argument("--gpu", metavar="NAME", default=None, help="check the states fit this GPU (see memprof gpus)")
    p.set_defaults(func=_cmd_estimate)
    return parser


def _fail(message: str) -> int:
    print(f"memprof: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``memprof`` command; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        extra = " ".join(unknown)
        hint = f"; pass the script's own arguments after --, e.g. -- {extra}" if args.command in ("track", "advise") else ""
        parser.error(f"unrecognized arguments: {extra}{hint}")
    if script_args and args.command not in ("track", "advise"):
        parser.error(f"arguments after -- go to a script, and only `memprof track` and `memprof advise` run one: {' '.join(script_args)}")
    args.script_args = script_args
    if getattr(args, "html", None):
        from .html import require_plotly

        try:  # before the script runs, not after
            require_plotly()
        except ImportError as exc:
            return _fail(str(exc))

    # Library code logs; show memprof's messages on stderr while the command runs.
    logger = logging.getLogger("memprof")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("memprof: %(levelname)s: %(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        return args.func(args, Console())
    except (ScriptError, ValueError, OSError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        print("memprof: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


if __name__ == "__main__":
    raise SystemExit(main())
