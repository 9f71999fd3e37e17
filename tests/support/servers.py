"""Real server processes for tests (moto S3, Prefect server and worker), torn down without orphans.

Every helper is a context manager around a `ManagedProcess`: the child runs in its own session
(`start_new_session=True`) with a unique token in its environment, its output goes to a log file,
and `stop()` signals the whole family -- the process group, every descendant, and every process
that still carries the token (children that opened their own session and were re-parented, like
Prefect's flow-run subprocesses) -- escalating to SIGKILL, then checks that nothing is left.
Readiness is polled with a timeout; a failure raises with the tail of the process's log.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from tests.support.prefect_db import seed_home

_TOKEN_VAR = "ESPNET3_FLOWS_TEST_PROCESS_TOKEN"
_LOG_TAIL_LINES = 40


class ProcessStartError(RuntimeError):
    """A helper process exited or did not become ready in time."""


def ephemeral_ports() -> range:
    """The ports the kernel hands out for `bind(("", 0))` and outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def _quiet_ports() -> range:
    """Ports no `bind(0)` and no outgoing connection can take: below the ephemeral range (or above
    it, where it starts low), so a Dask worker or a client's socket never steals one between our
    choosing it and the server's binding it."""
    ephemeral = ephemeral_ports()
    if ephemeral.start - 10000 >= 2000:
        return range(10000, ephemeral.start)
    if 65535 - ephemeral.stop >= 2000:
        return range(ephemeral.stop + 1, 65536)
    return range(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host`, free a moment ago, picked at random outside the kernel's ephemeral
    range (where the OS's own choices live), so only another explicit choice can collide with it;
    servers started by these helpers retry on a fresh port if that happens."""
    quiet = _quiet_ports()
    for port in random.sample(quiet, min(50, len(quiet))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _cli(name: str, module: str) -> list[str]:
    """The console script next to this interpreter (this venv's), else `python -m module`."""
    candidate = Path(sys.executable).parent / name
    return [str(candidate)] if candidate.exists() else [sys.executable, "-m", module]


def _http_status(url: str, *, method: str = "GET", body: bytes | None = None,
                 timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of one request; status 0 when the server cannot be reached."""
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError):
        # not (yet) an HTTP server there: refused, reset, timed out, or another protocol answered
        return 0, b""


def _clean_env(base: Mapping[str, str] | None, drop_prefixes: Sequence[str]) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key in list(env):
        if key.startswith(tuple(drop_prefixes)):
            del env[key]
    return env


ROOT = Path(__file__).resolve().parents[2]


def cli_env(home: Path, *, drop: Sequence[str] = (), fresh_database: bool = False, api_url: str | None = None,
            **settings: str) -> dict[str, str]:
    """The environment of a command a user runs from this checkout with no Prefect server
    configured: no inherited ``PREFECT_*`` (nor other ``drop`` prefixes), its own ``PREFECT_HOME``,
    analytics off, the checkout importable, unbuffered output; ``settings`` added last.

    The home gets a copy of an already migrated database (:mod:`tests.support.prefect_db`), as
    on a user's second run; ``fresh_database=True`` leaves it empty, as on a first run. With
    ``api_url`` (the ``session_api_url`` fixture's) the command runs against that server instead
    of starting its private one."""
    if not fresh_database:
        seed_home(home)
    env = _clean_env(None, ("PREFECT_", *drop))
    # a user's own @flow with no API starts Prefect's temporary server, given 20 s by default: under
    # make test's load (and a second suite beside it) it took longer once (docs/walkthrough.md says so)
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT),
               PYTHONUNBUFFERED="1", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(settings)
    return env


class ManagedProcess:
    """One child process in its own session, with a log file and whole-family teardown."""

    def __init__(self, argv: Sequence[str], *, name: str, log_path: Path,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None):
        self.argv = list(argv)
        self.name = name
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.popen: subprocess.Popen | None = None
        self.token: str | None = None

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def start(self) -> None:
        if self.running():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.token = uuid.uuid4().hex
        env = dict(self.env, **{_TOKEN_VAR: self.token})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {self.name}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def family(self) -> list[psutil.Process]:
        """Live processes that belong to this child: group, descendants, token carriers."""
        if self.popen is None:
            return []
        found: dict[int, psutil.Process] = {}
        try:
            leader = psutil.Process(self.popen.pid)
            found[leader.pid] = leader
            for child in leader.children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        marker = f"{_TOKEN_VAR}={self.token}".encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in found:
                continue
            pid = int(entry.name)
            try:
                if os.getpgid(pid) == self.popen.pid:
                    found[pid] = psutil.Process(pid)
                    continue
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if marker in fh.read().split(b"\0"):
                        found[pid] = psutil.Process(pid)
            except (OSError, psutil.Error):
                continue
        return [p for p in found.values() if _is_live(p)]

    def wait_until(self, ready: Callable[[], bool], *, timeout: float, what: str,
                   interval: float = 0.2) -> float:
        """Poll `ready()` until true; returns seconds waited. Raises with the log tail."""
        start = time.monotonic()
        while True:
            if ready():
                return time.monotonic() - start
            if not self.running():
                code = None if self.popen is None else self.popen.returncode
                raise ProcessStartError(
                    f"{self.name} exited with code {code} before {what}; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() - start > timeout:
                tail = self.log_tail()
                raise ProcessStartError(
                    f"{self.name} did not reach '{what}' within {timeout:.0f}s; "
                    f"log {self.log_path}:\n{tail}")
            time.sleep(interval)

    def stop(self, signals: Sequence[tuple[int, float]] = ((signal.SIGTERM, 10.0),),
             kill_timeout: float = 10.0) -> None:
        """Send each (signal, grace seconds) to the whole family, then SIGKILL what is left."""
        if self.popen is None:
            return
        seen: dict[int, psutil.Process] = {}
        for sig, grace in signals:
            family = self.family()
            seen.update((p.pid, p) for p in family)
            if not family:
                break
            _signal_all(family, sig, self.popen.pid)
            _wait_gone(list(seen.values()), grace, self.popen)
        leftovers = self.family() + [p for p in seen.values() if _is_live(p)]
        if leftovers:
            _signal_all(leftovers, signal.SIGKILL, self.popen.pid)
            _wait_gone(leftovers, kill_timeout, self.popen)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=kill_timeout)
        survivors = [p for p in {*self.family(), *seen.values()} if _is_live(p)]
        if survivors:
            raise RuntimeError(f"{self.name}: processes survived SIGKILL: "
                               f"{sorted(p.pid for p in survivors)}")


def _is_live(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(procs: Sequence[psutil.Process], sig: int, pgid: int) -> None:
    """Each process gets `sig` once: the group by killpg, the others one by one."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for proc in procs:
        try:
            if os.getpgid(proc.pid) != pgid:
                proc.send_signal(sig)
        except (OSError, psutil.Error):
            pass


def _wait_gone(procs: Sequence[psutil.Process], timeout: float,
               leader: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leader.poll()  # reap the direct child so it does not linger as a zombie
        if not any(_is_live(p) for p in procs):
            return
        time.sleep(0.1)


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """True when some process holds `port` on `host` (binding it fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def _listens(procs: Sequence[psutil.Process], port: int) -> bool:
    """True when one of `procs` has a listening TCP socket on `port`."""
    for proc in procs:
        try:
            connections = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            return True
    return False


class _ServerBase:
    """Shared start/stop/context-manager plumbing; subclasses define argv and readiness."""

    name = "server"
    startup_timeout = 60.0
    stop_signals: Sequence[tuple[int, float]] = ((signal.SIGTERM, 10.0),)

    def __init__(self, log_dir: Path | None, startup_timeout: float | None):
        self._own_log_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"espnet3-{self.name}-")
                            if log_dir is None else log_dir)
        self.startup_timeout = startup_timeout or self.startup_timeout
        self.cwd: str | os.PathLike | None = None
        self.process: ManagedProcess | None = None
        self.startup_seconds: float | None = None
        self.port: int | None = None
        self._port_chosen = False  # True: free_port() picked it, so a first start may pick again

    def _use_port(self, port: int | None) -> None:
        """Listen on `port`, or on one `free_port()` picks (then a first start that finds it taken
        by another process picks a fresh one: see `start`)."""
        self._port_chosen = port is None
        self.port = free_port() if port is None else port

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _process_env(self) -> dict[str, str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.running()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        return "(not started)" if self.process is None else self.process.log_tail(lines)

    def start(self):
        """Start the process and wait until it is ready. On a first start on a port `free_port()`
        chose, a port another process took in the meantime (it can: the choice and the bind are
        two steps) is given up for a fresh one, up to three times; a restart keeps its port."""
        if self.running():
            raise RuntimeError(f"{self.name} already running (pid {self.pid})")
        attempts = 3 if self._port_chosen and self.startup_seconds is None else 1
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except ProcessStartError:
                if attempt == attempts or self.port is None or not port_taken(self.port):
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self):
        self.process = ManagedProcess(self._argv(), name=self.name, env=self._process_env(),
                                      cwd=self.cwd, log_path=self.log_dir / f"{self.name}.log")
        self.process.start()
        try:
            self.startup_seconds = self.process.wait_until(
                self._ready, timeout=self.startup_timeout, what="ready")
            if self.port is not None and not _listens(self.process.family(), self.port):
                raise ProcessStartError(f"{self.name}: port {self.port} answered, but from another "
                                        f"process; log {self.process.log_path}:\n{self.log_tail()}")
        except BaseException:
            self.process.stop(self.stop_signals)
            raise
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(self.stop_signals)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info) -> None:
        try:
            self.stop()
        finally:
            if self._own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)


class MotoServer(_ServerBase):
    """`moto_server -H 127.0.0.1 -p PORT`: an in-memory S3 on loopback.

    `stop()` then `start()` reuses the same port (simulates an outage and recovery), but moto
    keeps everything in memory: a restarted server has no buckets and no objects.
    """

    name = "moto"
    startup_timeout = 30.0

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1",
                 startup_timeout: float | None = None, log_dir: Path | None = None):
        super().__init__(log_dir, startup_timeout)
        self.host = host
        self._use_port(port)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        return [*_cli("moto_server", "moto.server"), "-H", self.host, "-p", str(self.port)]

    def _process_env(self) -> dict[str, str]:
        return _clean_env(None, ("AWS_",))

    def _ready(self) -> bool:
        return _http_status(self.endpoint_url + "/")[0] == 200

    def storage_options(self, key: str = "testing", secret: str = "testing") -> dict:
        """Keyword arguments for `s3fs.S3FileSystem` / fsspec `storage_options`."""
        return {"key": key, "secret": secret,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    def make_bucket(self, name: str, key: str = "testing", secret: str = "testing") -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                              aws_access_key_id=key, aws_secret_access_key=secret)
        client.create_bucket(Bucket=name)


class SshServer(_ServerBase):
    """OpenSSH's `sshd -D` on a loopback port, with a host key and one client key made for it
    (public-key login of the current user only): the "remote hosts" of `parallel.env=ssh` tests,
    as `127.0.0.1` and `localhost`. Needs Debian's `openssh-server`.
    """

    name = "sshd"
    startup_timeout = 30.0

    def __init__(self, root: Path, port: int | None = None, *, log_dir: Path | None = None,
                 startup_timeout: float | None = None):
        super().__init__(log_dir, startup_timeout)
        self.root = Path(root)
        self._use_port(port)
        self.client_key = self.root / "client_key"
        self.config = self.root / "sshd_config"

    def _prepare(self) -> None:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path(sshd).exists():
            raise ProcessStartError("sshd is not installed: apt-get install -y openssh-server")
        self.root.mkdir(parents=True, exist_ok=True)
        for key in (self.root / "host_key", self.client_key):
            if not key.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        shutil.copy(self.client_key.with_suffix(".pub"), self.root / "authorized_keys")
        os.chmod(self.root / "authorized_keys", 0o600)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        self.config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.root / 'host_key'}",
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}", f"PidFile {self.root / 'sshd.pid'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no", "LogLevel ERROR", ""]))

    def _argv(self) -> list[str]:
        self._prepare()
        return [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", str(self.config)]

    def _process_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
                return conn.recv(8).startswith(b"SSH-")
        except OSError:
            return False

    def connect_options(self) -> dict:
        """asyncssh's connection options for this server (`parallel.options.connect_options`)."""
        return {"port": self.port, "known_hosts": None, "client_keys": [str(self.client_key)]}


class PrefectServer(_ServerBase):
    """`prefect server start` on loopback with its own PREFECT_HOME (SQLite there by default).

    Healthy in ~10 s on a fresh database with the UI off, ~3 s on a migrated copy (the default,
    :mod:`tests.support.prefect_db`); SIGTERM stops it in ~2 s.
    """

    name = "prefect-server"
    startup_timeout = 120.0

    def __init__(self, home: Path, port: int | None = None, *, database_url: str | None = None,
                 ui: bool = False, extra_env: Mapping[str, str] | None = None,
                 startup_timeout: float | None = None, log_dir: Path | None = None):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        if database_url is None:  # a migrated copy: starts in ~3 s, not ~10
            seed_home(self.home)
        super().__init__(log_dir or self.home / "logs", startup_timeout)
        self._use_port(port)
        self.database_url = database_url or f"sqlite+aiosqlite:///{self.home / 'prefect.db'}"
        self.ui = ui
        self.extra_env = dict(extra_env or {})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def env(self, full: bool = True) -> dict[str, str]:
        """Environment for a client process (CLI, flow, worker) that talks to this server.

        full=True: os.environ without inherited PREFECT_* plus these settings, ready for
        subprocess(env=...). full=False: only the PREFECT_* settings (for monkeypatch.setenv).
        """
        settings = {
            "PREFECT_API_URL": self.api_url,
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        if not full:
            return settings
        return {**_clean_env(None, ("PREFECT_",)), **settings}

    def _argv(self) -> list[str]:
        return [*_cli("prefect", "prefect"), "server", "start", "--host", "127.0.0.1",
                "--port", str(self.port)]

    def _process_env(self) -> dict[str, str]:
        return {
            **self.env(full=True),
            "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url,
            "PREFECT_SERVER_UI_ENABLED": "true" if self.ui else "false",
            **self.extra_env,
        }

    def _ready(self) -> bool:
        return self.health_ok()

    def health_ok(self) -> bool:
        return _http_status(self.api_url + "/health")[0] == 200


class PrefectWorker(_ServerBase):
    """`prefect worker start --pool POOL --type process`, ready once registered with the server.

    Prefect's worker ignores one SIGTERM for minutes, so stop() sends SIGINT twice, then
    SIGKILL. Its flow-run subprocesses start in their own session (not the worker's process
    group); stop() finds them as descendants or by the token in their environment.
    """

    name = "prefect-worker"
    startup_timeout = 60.0
    stop_signals = ((signal.SIGINT, 3.0), (signal.SIGINT, 10.0))

    def __init__(self, pool: str, env: Mapping[str, str], cwd: str | os.PathLike, *,
                 name: str | None = None, worker_type: str = "process",
                 query_seconds: float = 2, extra_args: Sequence[str] = (),
                 startup_timeout: float | None = None, log_dir: Path | None = None):
        if "PREFECT_API_URL" not in env:
            raise ValueError("PrefectWorker needs PREFECT_API_URL in env (PrefectServer.env())")
        super().__init__(log_dir, startup_timeout)
        self.pool = pool
        self.worker_environ = dict(env)
        self.cwd = cwd
        self.worker_name = name or f"test-worker-{uuid.uuid4().hex[:8]}"
        self.worker_type = worker_type
        self.query_seconds = query_seconds
        self.extra_args = list(extra_args)

    @property
    def api_url(self) -> str:
        return self.worker_environ["PREFECT_API_URL"].rstrip("/")

    def _argv(self) -> list[str]:
        return [*_cli("prefect", "prefect"), "worker", "start", "--pool", self.pool,
                "--type", self.worker_type, "--name", self.worker_name, *self.extra_args]

    def _process_env(self) -> dict[str, str]:
        return {**self.worker_environ,
                "PREFECT_WORKER_QUERY_SECONDS": str(self.query_seconds),
                "PREFECT_WORKER_PREFETCH_SECONDS": str(max(self.query_seconds, 1))}

    def _ready(self) -> bool:
        return self.worker_name in self.registered_workers()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no flow-run process of this worker is left (a run's last logs are sent as its
        process exits); False if one still runs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            runs = [] if self.process is None else [p for p in self.process.family() if p.pid != self.pid]
            if not runs:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def registered_workers(self) -> dict[str, str]:
        """{worker name: status} of the pool's workers, as the server reports them."""
        status, body = _http_status(f"{self.api_url}/work_pools/{self.pool}/workers/filter",
                                    method="POST", body=b"{}")
        if status != 200:
            return {}
        return {w["name"]: w.get("status") or "" for w in json.loads(body)}


def slurm_available(env: Mapping[str, str] | None = None, timeout: float = 10.0) -> bool:
    """True when `sinfo` answers with at least one partition under `env` (default os.environ)."""
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P %a"],
                              env=dict(os.environ if env is None else env),
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())
