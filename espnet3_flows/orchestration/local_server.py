"""A private local Prefect API server for runs with no server configured (Dask workers need one)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from collections.abc import Callable, Iterator

from espnet3_flows.orchestration.server_health import (PrivateServerLost, drain_prefect_clients, log_tail,
                                                       open_server_log, watched)
from espnet3_flows.timeline import mark

_PR_SET_PDEATHSIG = 1


#: Server loop services a private one-run API has no use for (deployment schedules, late-run
#: marking, automations, worker heartbeats, lease and cancellation cleanup, vacuuming), off: their
#: CPU goes to the Dask workers. Task-run recording stays on: the run's flow and task runs, their
#: states, logs and artifacts are in its database. The event persister (the raw event feed, read
#: by the UI's event pages and by automations, neither of which this server has) is off too.
#: What each buys: ``benchmarks/README.md``, "Figures behind settings in the code".
UNUSED_SERVICES = ("scheduler", "late_runs", "triggers", "foreman", "repossessor", "cancellation_cleanup",
                    "cleanup_reconciler", "pause_expirations", "db_vacuum", "event_persister")


#: The server's event consumers write in batches. Prefect 3.8 records each task-run state event on
#: its own (the task-run recorder's batch size is 1: a bulk INSERT compiled and committed per
#: event, three per task run) and persists events 20 at a time, CPU the Dask workers beside it
#: lose (figures: ``benchmarks/README.md``, "Figures behind settings in the code"). A task run's
#: state then reaches the API up to a second later. The same settings are in
#: ``deployments/local-stack.sh`` (``make serve``) and ``docker-compose.yml``; a test keeps them equal.
SERVER_BATCHING = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}


#: Block-type registration at start, off for the private server: to hash what it would register,
#: Prefect imports every installed Prefect collection (prefect-dask, hence Dask's distributed) in
#: the server's start-up, and its first request then builds more (``benchmarks/README.md``,
#: "Figures behind settings in the code"). This project saves no blocks; block types are
#: registered by a server that runs for people (``make serve``, ``prefect server start``).
SERVER_START_SETTINGS = {
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
    "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",
}


def server_environment() -> dict[str, str]:
    """Environment of the private server: this process's settings, no UI or analytics, the
    unused services off, the event consumers batched (:data:`SERVER_BATCHING`) and no block
    registration (:data:`SERVER_START_SETTINGS`), unless the user set them; and no
    ``PREFECT_API_URL`` of its own.

    Settings changed inside this process (``temporary_settings``) are passed on when Prefect is
    imported already; before that (a server launched at the CLI's start) the server reads the
    same environment and profile as this process would."""
    environ = dict(os.environ)
    if "prefect.settings" in sys.modules:
        from prefect.settings import get_current_settings

        environ.update(get_current_settings().to_environment_variables(exclude_unset=True))
    environ |= {"PREFECT_UI_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for service in UNUSED_SERVICES:
        environ.setdefault(f"PREFECT_SERVER_SERVICES_{service.upper()}_ENABLED", "false")
    for key, value in (SERVER_BATCHING | SERVER_START_SETTINGS).items():
        environ.setdefault(key, value)
    environ.pop("PREFECT_API_URL", None)
    return environ


def _die_with_parent() -> None:  # runs in the child before exec
    os.setsid()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
        self.log_path: Path | None = None  # its output (never a pipe: one unread blocks the server)
        self.home = _prefect_home()  # its PREFECT_HOME (its database's folder), read at launch
        self._lock: int | None = None
        self._launcher: threading.Thread | None = None
        self._launch_error: BaseException | None = None
        self._environ: dict[str, str] = {}  # the server's environment, read at launch
        self._cancelled = threading.Event()

    @property
    def api_url(self) -> str:
        """The ``PREFECT_API_URL`` of this server."""
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def launched(self) -> bool:
        """Whether :meth:`launch` was called (the process may still wait for its turn)."""
        return self.process is not None or self._launcher is not None

    def start(self) -> None:
        """Start the server and wait until ``/api/health`` answers."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the server process; returns at once (see :meth:`wait_ready`). Prefect is not
        imported here: the server can start while this process is still importing it.

        Servers on one ``PREFECT_HOME`` start one at a time (a lock file there, held from launch
        until the server answers, by a thread of this process): they share its SQLite database,
        which has one writer, and a new database's migrations take ~10 s, longer than another
        server would wait for it. When another run's server is starting, this one is started by
        that thread once the other answers.
        """
        # the environment is read here, in the caller's thread: the launcher thread must not read
        # os.environ while this thread may change it (a cluster's start drops Dask's trim threshold)
        self._environ = server_environment()
        self.home = Path(self._environ.get("PREFECT_HOME") or self.home).expanduser()
        self._lock = _open_start_lock()
        now = self._lock is None or _try_lock(self._lock)
        if now:
            self._popen()
            if self._lock is None:  # no lock to release when it answers
                return
        self._launcher = threading.Thread(target=self._start_in_turn, args=(not now,), daemon=True,
                                          name="prefect-server-start")
        self._launcher.start()

    def _start_in_turn(self, wait_turn: bool) -> None:
        """(Wait for the lock and start the server, then) release the lock once it answers or dies."""
        import httpx

        try:
            while wait_turn and not _try_lock(self._lock):  # type: ignore[arg-type]
                if self._cancelled.wait(0.1):
                    return
            if wait_turn and not self._cancelled.is_set():
                self._popen()
            deadline = time.monotonic() + self.startup_timeout
            while not self._cancelled.is_set() and time.monotonic() < deadline:
                proc = self.process
                if proc is None or proc.poll() is not None:
                    return
                # (trust_env off: loopback goes through no proxy, and no os.environ is read here)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.api_url}/health", timeout=2, trust_env=False).status_code == 200:
                        return
                self._cancelled.wait(0.2)
        except BaseException as exc:  # noqa: BLE001 - raised by wait_ready, in the caller's thread
            self._launch_error = exc
        finally:
            self._release()
            if wait_turn and self.process is not None:
                # the kernel signals a child whose parent *thread* ends (PR_SET_PDEATHSIG): the
                # thread that started the server lives as long as it is meant to run
                self._cancelled.wait()

    def _popen(self) -> None:
        spec = importlib.util.find_spec("prefect")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("prefect is not installed")
        app_dir = Path(list(spec.submodule_search_locations)[0]).parent
        environ = self._environ
        self.log_path, log = open_server_log(self.home, self.port)
        with log:  # the child holds its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"],
                env=environ, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent)

    def wait_ready(self) -> None:
        """Wait until the launched server's ``/api/health`` answers (stops it on failure)."""
        import httpx

        assert self.launched, "launch() first"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._launch_error is not None:
                raise self._launch_error
            if self.process is None:  # another server's start goes first
                if self._launcher is None or not self._launcher.is_alive():
                    break
                time.sleep(0.1)
                continue
            if self.process.poll() is not None:
                raise RuntimeError(f"the local Prefect server exited with code {self.process.returncode} "
                                   f"(log {self.log_path}): {log_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.api_url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop(keep_log=True)
        raise RuntimeError(f"the local Prefect server did not become healthy in {self.startup_timeout:.0f} s "
                           f"(log {self.log_path})")

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)  # releases the flock

    def stop(self, keep_log: bool = False) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); one still waiting for its turn is
        not started. Its log file is removed unless ``keep_log`` (a run's error names it)."""
        self._cancelled.set()
        if self._launcher is not None:
            self._launcher.join()
        self._release()
        proc, self.process = self.process, None
        if self.log_path is not None and not keep_log and (proc is None or proc.poll() is None):  # (died: kept)
            with contextlib.suppress(OSError):
                self.log_path.unlink()
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


def _prefect_home() -> Path:
    """``PREFECT_HOME`` as Prefect reads it from the environment (``~/.prefect`` by default)."""
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def _open_start_lock() -> int | None:
    """A descriptor of ``$PREFECT_HOME/espnet3-flows-server-start.lock`` (``None`` where it cannot
    be made: the server then starts without waiting its turn)."""
    try:
        home = _prefect_home()
        home.mkdir(parents=True, exist_ok=True)
        return os.open(home / "espnet3-flows-server-start.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def configured_api_url() -> str:
    """The API URL this process is configured with, read without importing Prefect: the
    ``PREFECT_API_URL`` variable, else the active profile's (``PREFECT_PROFILE``, else the
    profiles file's ``active``; the file is ``PREFECT_PROFILES_PATH``, else
    ``$PREFECT_HOME/profiles.toml``). Prefect's other sources (``prefect.toml``, ``.env``) are
    read by :func:`prefect_api`, which stops an early server that is not needed."""
    url = os.environ.get("PREFECT_API_URL", "")
    if url:
        return url
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or _prefect_home() / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return ""
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active") or ""
    profile = (profiles.get("profiles") or {}).get(active) or {}
    return str(profile.get("PREFECT_API_URL") or "") if isinstance(profile, dict) else ""


def launch_private_server() -> LocalPrefectServer | None:
    """Launch the private API server now, at the command line's start (once its config is read),
    so that it starts while the CLI imports its libraries and plans (its own start is seconds of
    importing Prefect's server); :func:`prefect_api` is handed it and takes it over, or stops it
    when the run needs none. Nothing is launched when an API is configured. A server nobody takes
    is stopped when this process exits (and dies with it if killed).

    Returns:
        The launched server, or ``None`` (an API is configured, or it could not be launched: it is
        started again, with its error, where it is needed).
    """
    if configured_api_url():
        return None
    server = LocalPrefectServer()
    try:
        server.launch()
    except (OSError, RuntimeError):
        return None
    mark("server_launched")
    atexit.register(server.stop)  # (a no-op once the run stopped it)
    return server


@contextlib.contextmanager
def prefect_api(needs_server: bool, while_starting: Callable[[], bool | None] | None = None,
                server: LocalPrefectServer | None = None) -> Iterator[str | bool | None]:
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
        if server is not None:
            server.stop()
        if while_starting is not None and while_starting() is False:
            yield False
            return
        yield url or None
        return
    server = server or LocalPrefectServer()
    failed = False
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    try:
        if not server.launched:
            server.launch()
        os.environ["PREFECT_API_URL"] = server.api_url
        if while_starting is not None and while_starting() is False:
            server.stop()
            yield False
            return
        server.wait_ready()
        mark("server_ready")
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}), \
                watched(server.api_url, server.process, server.home, server.log_path):
            yield server.api_url
    except PrivateServerLost:
        failed = True  # nothing more reaches it; its log is named in the error
        raise
    finally:
        if server.process is not None and not failed:
            drain_prefect_clients()
        os.environ.pop("PREFECT_API_URL", None)
        server.stop(keep_log=failed)
        mark("server_stopped")
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
