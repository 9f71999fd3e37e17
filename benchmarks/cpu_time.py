"""The CPU a benchmark's run used, exactly: its whole process tree's and a long-running server's.

A run's **tree CPU** is ``getrusage(RUSAGE_CHILDREN)`` across the run: the user + system time of
every process it started, once each has been waited for. A process whose parent exits without
waiting for it (the forkserver and the workers it forked, after the CLI's ``os._exit``) would go
to init and its time would be lost, so for the run this process is its descendants' subreaper
(Linux ``prctl(PR_SET_CHILD_SUBREAPER)``, :func:`adopting_orphans`): such a process is adopted
here, and waited for here when it ends (:func:`reap`). Outside the run this process is no
subreaper: an orphan of anything else still goes to init. A long-running **server's CPU** is the
growth of its own user + system time (:func:`process_cpu_s`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import statistics
from typing import Any
from collections.abc import Iterable, Iterator

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _set_subreaper(on: bool) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def adopting_orphans() -> Iterator[bool]:
    """The block in which this process adopts its descendants' orphans; yields whether it does
    (``False`` where ``prctl`` is missing: their CPU is then not counted)."""
    adopted = _set_subreaper(True)
    try:
        yield adopted
    finally:
        if adopted:
            _set_subreaper(False)


def reap(pids: Iterable[int]) -> int:
    """Wait for those of ``pids`` that are exited children of this process (adopted orphans of a
    run); returns how many of them are still running children."""
    running = 0
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not a child of this process, or waited for already
            continue
        running += done == 0
    return running


def children_cpu_s() -> float:
    """User + system seconds of this process's waited-for children (and theirs), so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int | None) -> float | None:
    """A live process's own user + system seconds (``None`` without one)."""
    import psutil

    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def run_cpu_s(row: dict[str, Any]) -> float | None:
    """A measured run's CPU seconds: its process tree's and the Prefect server's meanwhile
    (``None`` unless both were measured)."""
    tree, server = row.get("cpu_s"), row.get("server_cpu_s")
    return None if tree is None or server is None else tree + server


def cpu_per_task_ms(rows: list[dict[str, Any]], shards: int) -> float | str:
    """CPU per Prefect task run (ms): the median CPU (tree + server) of the cold flow runs at
    ``shards`` less that of the cold engine runs, over the shards the flow computed; or why not
    (``scale``'s rows)."""
    cpu: dict[str, list[float]] = {"engine cold": [], "flow cold": []}
    computed = []
    for r in rows:
        if r.get("shards") == shards and r.get("run") in cpu and r.get("ok"):
            if (value := run_cpu_s(r)) is None:
                return "not measured (no private server, or no prctl)"
            cpu[r["run"]].append(value)
            if r["run"] == "flow cold":
                computed.append(r.get("shards_computed") or 0)
    if not cpu["engine cold"] or not cpu["flow cold"] or not min(computed, default=0):
        return "a cold run failed"
    extra = statistics.median(cpu["flow cold"]) - statistics.median(cpu["engine cold"])
    return round(1000 * extra / statistics.median(computed), 2)
