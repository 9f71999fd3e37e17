"""A private local Prefect API server for runs with no server configured (Dask workers need one)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Iterator

import httpx

_PR_SET_PDEATHSIG = 1


#: Server loop services a private one-run API has no use for (deployment schedules, late-run
#: marking, automations, worker heartbeats, lease and cancellation cleanup, vacuuming). Off, the
#: idle server takes 1.4 % of a core instead of 2.6 %, CPU the Dask workers get back. Task-run
#: recording stays on: the run's flow and task runs, their states, logs and artifacts are in its
#: database. The event persister (the raw event feed, read by the UI's event pages and by
#: automations, neither of which this server has) is off: it took 4.4 s of the server's CPU in a
#: 1,000-shard run beside the workers on this 2-core machine.
_UNUSED_SERVICES = ("scheduler", "late_runs", "triggers", "foreman", "repossessor", "cancellation_cleanup",
                    "cleanup_reconciler", "pause_expirations", "db_vacuum", "event_persister")


#: The server's event consumers write in batches. Prefect 3.8 records each task-run state event on
#: its own (the task-run recorder's batch size is 1: a bulk INSERT compiled and committed per
#: event, three per task run) and persists events 20 at a time: 33 s of the server's CPU in a
#: 62 s run of 1,000 shard tasks on this 2-core machine, CPU the Dask workers beside it lose;
#: batched, 13 s (``benchmarks/README.md``, scale). A task run's state then reaches the API up to
#: a second later. The same settings are in ``deployments/local-stack.sh`` (``make serve``) and
#: ``docker-compose.yml``; a test keeps them equal.
SERVER_BATCHING = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}


def server_environment() -> dict[str, str]:
    """Environment of the private server: this process's settings, no UI or analytics, the
    unused services off and the event consumers batched (:data:`SERVER_BATCHING`; unless the user
    set them), and no ``PREFECT_API_URL`` of its own."""
    from prefect.settings import get_current_settings

    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for service in _UNUSED_SERVICES:
        env.setdefault(f"PREFECT_SERVER_SERVICES_{service.upper()}_ENABLED", "false")
    for key, value in SERVER_BATCHING.items():
        env.setdefault(key, value)
    env.pop("PREFECT_API_URL", None)
    return env


def _die_with_parent() -> None:  # runs in the child before exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPrefectServer:
    """Prefect's API (uvicorn, SQLite under ``PREFECT_HOME``) on a free loopback port.

    Prefect's own ephemeral mode starts a server per process, so every Dask worker process
    would start (and fail to reach) its own. This server is started once by the driver, its
    URL is exported as ``PREFECT_API_URL`` for the workers, and it dies with the driver: it
    is stopped on exit or Ctrl-C, and the kernel sends it SIGTERM if the driver is killed.
    """

    def __init__(self, startup_timeout: float = 120.0):
        self.port = _free_port()
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        """The ``PREFECT_API_URL`` of this server."""
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        """Start the server and wait until ``/api/health`` answers."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the server process; returns at once (see :meth:`wait_ready`)."""
        import prefect

        env = server_environment()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)

    def wait_ready(self) -> None:
        """Wait until the launched server's ``/api/health`` answers (stops it on failure)."""
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace")[-2000:] if self.process.stderr else ""
                raise RuntimeError(f"the local Prefect server exited with code {self.process.returncode}: {err}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the local Prefect server did not become healthy in {self.startup_timeout:.0f} s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def drain_prefect_clients(timeout: float = 15.0) -> None:
    """Send this process's queued Prefect logs and events now (before its API server stops, or
    before a worker process exits); waits at most ``timeout`` seconds per kind."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            service.drain_all(timeout=timeout)


@contextlib.contextmanager
def prefect_api(needs_server: bool,
                while_starting: Callable[[], bool | None] | None = None) -> Iterator[str | bool | None]:
    """Make sure a Prefect API is reachable by this process and its future worker processes.

    Uses ``PREFECT_API_URL`` when it is set (a real server). Otherwise, when
    ``needs_server`` (Dask workers in other processes), starts a :class:`LocalPrefectServer`
    for the duration of the block; else Prefect's in-process ephemeral mode is used.

    Args:
        needs_server: Whether work will run in other processes.
        while_starting: Called once ``PREFECT_API_URL`` is in the environment, while a private
            server is still starting (else right away): work to overlap with the server start.
            When it returns ``False`` the API is not needed after all: a private server is
            stopped at once instead of waited for.

    Yields:
        The API URL in use, ``None`` for ephemeral mode, or ``False`` when ``while_starting``
        said no API is needed.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()
    if url or not needs_server:
        if while_starting is not None and while_starting() is False:
            yield False
            return
        yield url or None
        return
    server = LocalPrefectServer()
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    try:
        server.launch()
        os.environ["PREFECT_API_URL"] = server.api_url
        if while_starting is not None and while_starting() is False:
            server.stop()
            yield False
            return
        server.wait_ready()
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        if server.process is not None:
            drain_prefect_clients()
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
