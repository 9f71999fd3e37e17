"""The private Prefect server's log file, a watch on its health during a run, what went wrong with
it, and the logs and events sent to it before it stops.

A child's pipe that nobody reads blocks the child once ~64 KiB are queued: the private server's
stderr was such a pipe, and when its database's disk filled, its tracebacks filled the pipe, its
main thread blocked writing, and the run sat for 15.6 minutes before a bare ``ReadTimeout``. Its
output now goes to a file (:func:`open_server_log`), and :class:`HealthWatch` ends a server that
stops answering, so that every call to it fails at once instead of waiting out the client's
timeouts and retries; :func:`watched` then raises :class:`PrivateServerLost`, which says which
server, where its log is, whether its disk is full, and what to do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO
from collections.abc import Callable, Iterator

from espnet3_flows.errors import Espnet3FlowsError

#: Seconds the private server may go without answering ``/api/health`` during a run before it is
#: ended as lost (its calls then fail at once; the run ends within a minute, naming it)
LOST_AFTER = 30.0
#: Seconds between two health probes (each waits at most this long for its answer, too)
PROBE_EVERY = 5.0
#: Free bytes below which the disk of the server's database counts as full
FULL_BELOW = 1 << 20
#: What SQLite and the OS write when a disk is full
_DISK_FULL_WORDS = ("database or disk is full", "No space left on device", "[Errno 28]")


class PrivateServerLost(Espnet3FlowsError, RuntimeError):
    """The private Prefect server of a run failed or stopped answering; the message names it,
    its log file, a full disk where that is the cause, and what to do."""


def open_server_log(home: Path, port: int) -> tuple[Path, BinaryIO]:
    """The server's log file, opened for appending: ``<home>/espnet3-flows-server-<port>.log``,
    else (a home that cannot be written) the same name in the temporary directory."""
    name = f"espnet3-flows-server-{port}.log"
    for folder in (home, Path(tempfile.gettempdir())):
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            return path, open(path, "ab")  # the server's process writes it until it ends
    raise OSError(f"no log file can be made for the Prefect server in {home} or {tempfile.gettempdir()}")


def log_tail(path: Path | None, size: int = 2000) -> str:
    """The last ``size`` characters of the log at ``path`` ("" when there is none)."""
    if path is None:
        return ""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - size))
        return f.read().decode("utf-8", "replace")
    return ""


def full_disk(home: Path, log: Path | None) -> str:
    """Why the disk of the server's database (``home``) counts as full, or "" when it does not:
    less than :data:`FULL_BELOW` bytes free there, or the log says so."""
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(home).free
        if free < FULL_BELOW:
            return f"the disk of its database (PREFECT_HOME={home}) is full ({free} bytes free)"
    tail = log_tail(log, 64 * 1024)
    if any(word in tail for word in _DISK_FULL_WORDS):
        return f"the disk of its database (PREFECT_HOME={home}) was full (its log says so)"
    return ""


def server_trouble(api_url: str, home: Path, log: Path | None, what: str) -> str:
    """One line naming the private server at ``api_url``, ``what`` happened to it, its log, a full
    disk where that is the cause, and what to do."""
    disk = full_disk(home, log)
    rerun = "rerun (finished shards are kept; only the rest is computed)"
    if disk:
        return (f"this run's private Prefect server ({api_url}, log {log}) {what}: {disk}; free space there "
                f"or set PREFECT_HOME to a disk with room, then {rerun}")
    return (f"this run's private Prefect server ({api_url}) {what}; see its log {log}, then {rerun}, or set "
            f"PREFECT_API_URL to a server of your own")


class HealthWatch:
    """Probes a private server's ``/api/health`` while a run uses it; one that has not answered for
    :data:`LOST_AFTER` seconds (or has exited) is ended (its whole process group), ``on_lost`` is
    called, and :attr:`trouble` says what happened.

    Args:
        url: The server's API URL.
        process: The server's process (its own process group).
        describe: Makes the line of :attr:`trouble` from what happened (``"stopped answering ..."``).
        on_lost: Called once the server is found lost (from the watching thread).
    """

    def __init__(self, url: str, process: subprocess.Popen, describe: Callable[[str], str],
                 on_lost: Callable[[], None] = lambda: None):
        self.url = url
        self.process = process
        self.describe = describe
        self.on_lost = on_lost
        self.trouble: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefect-server-health", daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_EVERY + 1)

    def _watch(self) -> None:
        import httpx

        last_answer = time.monotonic()
        while not self._stop.wait(PROBE_EVERY):
            if self.process.poll() is not None:
                self.trouble = self.describe(f"exited with code {self.process.returncode} during the run")
                self.on_lost()
                return
            # (trust_env off: loopback goes through no proxy)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=PROBE_EVERY, trust_env=False).status_code == 200:
                    last_answer = time.monotonic()
                    continue
            silent = time.monotonic() - last_answer
            if silent >= LOST_AFTER and not self._stop.is_set():
                self.trouble = self.describe(f"stopped answering for {silent:.0f} s and was stopped")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.on_lost()
                return


@contextlib.contextmanager
def watched(url: str, process: subprocess.Popen, home: Path, log: Path | None) -> Iterator[HealthWatch]:
    """A run's block under a :class:`HealthWatch` of its private server: an error raised in it
    while the server is lost, has exited or has a full disk becomes :class:`PrivateServerLost`.
    Entered where the run's Prefect settings are current: once the server is lost, the run's client
    calls are not retried (Prefect's 5 retries of a refused connection take ~1 min per call) and
    what is queued for the server is dropped, so the run ends within seconds."""
    from prefect.settings import get_current_settings

    from espnet3_flows.orchestration.api_watch import stop_client_retries
    from espnet3_flows.orchestration.prefect_private.lifecycle import drop_undeliverable_api_work, quiet_shipper_failures

    settings = get_current_settings()  # the run's (the watching thread has its own context)
    undo: list[Callable[[], None]] = []

    def give_up() -> None:
        undo.append(stop_client_retries(settings))  # each call in progress fails at its next try
        undo.append(quiet_shipper_failures())
        drop_undeliverable_api_work()

    describe = functools.partial(server_trouble, url, home, log)
    try:
        with HealthWatch(url, process, describe, give_up) as watch:
            try:
                yield watch
            except Exception as exc:
                trouble = watch.trouble
                if trouble is None and process.poll() is not None:
                    trouble = describe(f"exited with code {process.returncode} during the run")
                if trouble is None and full_disk(home, log):
                    trouble = describe("failed")
                if trouble is None:
                    raise
                raise PrivateServerLost(trouble) from exc
    finally:  # (after the watch's thread ended) a process that goes on gets its client back as it was
        for each in undo:
            each()


def drain_prefect_clients(timeout: float = 15.0) -> None:
    """Send this process's queued Prefect logs and events now (before its API server stops, or
    before a worker process exits); waits at most ``timeout`` seconds per kind."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            service.drain_all(timeout=timeout)
