"""Independent simulations in forked processes.

The advisor's plans each run one simulated step on the same build, brought
back to the build's state before each (``advisor._restart``): they share
nothing but that starting point, which ``fork`` copies for free. So the
build is made once, in this process, and the plans are handed out one at a
time to ``jobs`` forked copies of it; each answers with its plan's result,
pickled. Results equal those of one process plan by plan
(tests/test_advisor.py), since each plan starts from the same state either
way.

Forking is used only where it is safe and worth it: on Linux (macOS's
system frameworks do not survive ``fork``), where autograd's per-device
threads have not started in this process (they do not survive it either:
:func:`can_fork`), and where there is more than one job.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["can_fork", "default_jobs", "run_forked"]

log = logging.getLogger(__name__)


#: cgroup v2's CPU limit of this process's container ("max 100000", or "200000 100000": two CPUs).
CPU_MAX = "/sys/fs/cgroup/cpu.max"


def default_jobs() -> int:
    """The CPUs this process may use, at most 8: its affinity (not the machine's
    count), or fewer where its container's CPU quota says so (a Kubernetes pod's
    limit leaves the affinity at every CPU of the node)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = open(CPU_MAX).read().split()
        if quota != "max":
            cpus = min(cpus, -(-int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 limit here
        pass
    return max(1, min(cpus, 8))


def can_fork() -> bool:
    """Whether this process may fork simulations: on Linux, with CUDA not
    initialised (a forked child could not use it), and with autograd able to
    run backward in a forked child.

    A process's first backward starts one autograd thread per device of its
    accelerator, and a child forked after that cannot run backward at all
    (PyTorch's "Autograd and Fork" note). Where an accelerator is visible,
    a forked child tries a backward on a meta tensor to find out; the caller
    then keeps backward out of this process (every step in a child)."""
    if not sys.platform.startswith("linux") or torch.cuda.is_initialized():
        return False
    if torch.accelerator.device_count() == 0:
        return True  # no per-device threads to lose
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads alive: see run_forked
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            x = torch.ones((), device="meta", requires_grad=True)
            x.backward()
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1] == 0


def run_forked(run: Callable[[Any], tuple[str, Any]], names: Iterable[Any], jobs: int,
               start: Callable[[Any], None] | None = None) -> Iterator[tuple[Any, str, Any]]:
    """``run(name)`` for every name (any picklable value) in ``jobs`` forked processes, handing each
    process the next name when it answers: yields ``(name, status, value)`` as
    the answers come (``status`` as ``run`` returns it). ``start(name)`` is
    called in this process when a name is handed out.

    A process stops after a ``"broken"`` answer (its build is left midway
    through a step); names it did not take go to the others, and those no
    process took are not yielded. A process that dies without answering
    yields its name as ``"failed"`` with a ``RuntimeError``."""
    from multiprocessing import Pipe
    from multiprocessing.connection import wait

    todo = list(names)
    sys.stdout.flush()  # what this process has buffered must not be written again by the children
    sys.stderr.flush()
    workers: dict[Any, tuple[int, Any]] = {}  # connection -> (pid, the name it runs, or None)
    try:
        for _ in range(min(jobs, len(todo))):
            ours, theirs = Pipe()
            with warnings.catch_warnings():  # Python 3.12 warns of fork with threads alive (a progress bar's)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # the child: never returns
                ours.close()
                _serve(theirs, run)
            theirs.close()
            workers[ours] = (pid, None)
            _hand_out(ours, workers, todo, start)
        while workers:
            for conn in wait(list(workers)):
                pid, name = workers[conn]
                try:
                    got, status, value = conn.recv()
                except (EOFError, OSError):
                    got, status, value = None, "died", None
                if status == "died":
                    code = os.waitstatus_to_exitcode(_close(conn, workers))
                    if name is not None:
                        yield name, "failed", RuntimeError(
                            f"its process ended without an answer (exit code {code}; out of host memory?)")
                    continue
                workers[conn] = (pid, None)
                yield got, status, value
                if status == "broken":
                    _close(conn, workers)
                else:
                    _hand_out(conn, workers, todo, start)
    finally:  # left early (an exception here, the caller stopped): the children's work is lost
        for conn in list(workers):
            _close(conn, workers, kill=True)


def _hand_out(conn, workers: dict, todo: list, start) -> None:
    pid, _ = workers[conn]
    if not todo:
        _close(conn, workers)
        return
    name = todo.pop(0)
    workers[conn] = (pid, name)
    if start is not None:
        start(name)
    conn.send(name)


def _close(conn, workers: dict, kill: bool = False) -> int:
    """Tell the process at ``conn`` to stop (or kill it) and wait for it: its wait status."""
    pid, _ = workers.pop(conn)
    if kill:
        os.kill(pid, signal.SIGKILL)
    else:
        try:
            conn.send(None)
        except OSError:
            pass
    conn.close()
    return os.waitpid(pid, 0)[1]


def _serve(conn, run) -> None:
    """A child's loop: run each name received until None or a broken build; then exit
    without running this process's exit handlers (they are the parent's)."""
    code = 0
    try:
        torch.set_num_threads(1)  # as DataLoader's workers do: the parent's thread pool is not ours
        while (name := conn.recv()) is not None:
            status, value = run(name)
            if isinstance(value, BaseException):
                value = _picklable(value)
            conn.send((name, status, value))
            if status == "broken":
                break
    except BaseException:  # noqa: BLE001 - the parent reads the missing answer as a failure
        log.exception("a forked simulation failed")
        code = 1
    finally:
        conn.close()
        os._exit(code)


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` where it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception class may refuse
        return RuntimeError(f"{type(exc).__name__}: {exc}")
