"""What the trainer callbacks share: leaving a tracker, and publishing its report."""

from __future__ import annotations

import logging
import os
from typing import Callable

from memprof.report import Report
from memprof.tracker import Tracker

__all__ = ["close_tracker", "publish"]

log = logging.getLogger("memprof.callbacks")


def close_tracker(tracker: Tracker, exception: BaseException | None) -> Report:
    """Leave ``tracker``'s ``track`` block (every hook removed, even if this raises); its report."""
    if exception is None:
        tracker.__exit__(None, None, None)
    else:  # a step cut short by an exception is not counted
        tracker.__exit__(type(exception), exception, exception.__traceback__)
    return tracker.report()


def publish(report: Report, path: str | os.PathLike | None, print_report: bool, step_name: Callable[[int], str]) -> None:
    """Save ``report`` to ``path`` (if any) and print it with rich, or log one line;
    ``step_name(k)`` names the report's step ``k`` in the trainer's numbering."""
    if path is not None:
        log.info("memprof: report saved to %s", report.save(path))
    if print_report:
        from rich.console import Console

        Console().print(report)
    elif report.peak is None:
        log.info("memprof: %d steps, none profiled", len(report.steps))
    else:
        log.info("memprof: %s", report.peak.summary(step_name(report.peak.step)))
