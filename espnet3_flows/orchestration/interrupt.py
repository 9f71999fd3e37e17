"""Ctrl-C at the command line: one line saying what was interrupted, exit status 130 within 2 s.

Python's own answer to SIGINT is a ``KeyboardInterrupt`` traceback from wherever the driver was
(40-123 lines through Prefect's engine and the scheduler), then a teardown of several seconds
(the flow's crash reported, the cluster closed, queued events drained, the server stopped). The
handler here prints one line, lets the run unwind (its ``finally`` blocks stop the server and the
cluster; what the unwinding prints goes nowhere unless ``--verbose``) for at most
:data:`UNWIND_SECONDS`, then ends the process with status 130: the private server and the local
Dask workers die with it (they are signalled when their parent ends), and finished shards keep
their ``done`` records, so a rerun resumes. Installed by the command line's entry points only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any
from collections.abc import Sequence

from espnet3_flows.timeline import LAST

#: How long an interrupted run may unwind before the process ends anyway (the bound is 2 s)
UNWIND_SECONDS = 1.5
#: Exit status of a command line ended by SIGINT (128 + 2, as a shell reports it)
INTERRUPTED = 130

#: What the command line runs (the job, then its output once known), named by the line
_RUN: dict[str, str] = {}
_pressed = threading.Event()

#: What a run was doing, by the last timeline event it reached (``espnet3_flows.timeline``)
_PHASES = {"": "starting", "server_launched": "starting", "planned": "starting", "main": "starting",
           "server_ready": "starting its workers",
           "flow_started": "computing shards", "workers_ready": "computing shards",
           "first_shard": "computing shards", "shards_merged": "finishing", "flow_returned": "finishing",
           "server_stopped": "finishing", "summary_printed": "finishing"}


def exit_on_ctrl_c(job: str, argv: Sequence[str], output: str = "") -> None:
    """Make Ctrl-C end this command line with one ``interrupted:`` line and status 130 (from the
    main thread only; called again, it updates what the line names).

    Args:
        job: The job's name.
        argv: The command line's arguments (``--verbose`` keeps what the unwinding prints).
        output: The run's output directory, once known.
    """
    verbose = any(a in ("-v", "--verbose") for a in argv)
    _RUN.update(job=job, output=output or _RUN.get("output", ""), verbose="1" if verbose else "")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def interrupted_line() -> str:
    """The one line a Ctrl-C prints: what was running, and that a rerun resumes."""
    where = f", output {_RUN['output']}" if _RUN.get("output") else ""
    doing = _PHASES.get(LAST[0], "computing shards")
    return (f"interrupted: {_RUN.get('job', 'the run')} while {doing}{where}; finished shards are kept, "
            f"a rerun computes only the rest")


def was_interrupted() -> bool:
    """Whether this process's Ctrl-C handler ran (its line is printed)."""
    return _pressed.is_set()


def _on_sigint(signum: int, frame: Any) -> None:
    if _pressed.is_set():  # pressed again: the exit is on its way
        return
    _pressed.set()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(OSError):  # (not print: inside a flow, Prefect turns prints into log records)
        os.write(2, ("\n" + interrupted_line() + "\n").encode("utf-8", "replace"))
    if not _RUN.get("verbose"):  # what the unwinding prints (tracebacks of cancelled work) is noise now
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.dup2(devnull, 1)
    threading.Thread(target=_end_after, args=(UNWIND_SECONDS,), name="end-after-ctrl-c", daemon=True).start()
    sys.excepthook = _exit_interrupted  # the interrupt reaching the top ends the process with 130
    raise KeyboardInterrupt


def _exit_interrupted(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
    _end_after(0.0)


def _end_after(seconds: float) -> None:
    time.sleep(seconds)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(INTERRUPTED)
