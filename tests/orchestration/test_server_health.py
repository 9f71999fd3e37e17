"""The private Prefect server's output and health (issue 57, failure 6): its database's disk filled
while it wrote 1 MiB to stderr, and a server that stops answering; each run ends with one error
naming the server, its log and what to do, instead of stalling for minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect_server]

#: In the private server's process only (its command line names Prefect's app): once the trigger
#: file exists, 1 MiB goes to stderr (a pipe nobody read blocked there, with stderr's lock held)
NOISY_SERVER = '''
import os, sys, threading, time
_trigger = os.environ.get("E3F_TEST_NOISE_TRIGGER")
if _trigger and "prefect.server.api.server:create_app" in sys.argv:
    def _noise():
        while not os.path.exists(_trigger):
            time.sleep(0.05)
        sys.stderr.write("noise " * ((1 << 20) // 6 + 1) + "\\n")
        sys.stderr.flush()
        open(_trigger + ".written", "w").close()
    threading.Thread(target=_noise, daemon=True).start()
'''


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 24 MiB tmpfs (the disk of a private server's database); unmounted afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24M", "tmpfs", str(home)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def _private_api(monkeypatch: pytest.MonkeyPatch, home: Path):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(home))
    return temporary_settings(restore_defaults={PREFECT_API_URL}, updates={PREFECT_HOME: str(home)})


def test_a_full_database_disk_and_1_mib_of_stderr_end_the_run_naming_both(monkeypatch, tmp_path, small_disk):
    """Before: the server's stderr was a pipe read only at start-up; 1 MiB written to it blocked the
    server at its next log line (the disk-full traceback), and every call waited out its timeout."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from espnet3_flows.orchestration.local_server import PrivateServerLost, prefect_api

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOISY_SERVER)
    trigger = tmp_path / "noise"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("E3F_TEST_NOISE_TRIGGER", str(trigger))
    # bounded either way: a stalled server fails a call in 20 s instead of 6 tries of 60 s
    bounds = {PREFECT_API_REQUEST_TIMEOUT: 20.0, PREFECT_CLIENT_MAX_RETRIES: 1}
    message = "x" * 200_000
    with (
            _private_api(monkeypatch, small_disk), temporary_settings(updates=bounds),
            pytest.raises(PrivateServerLost) as lost,
            prefect_api(needs_server=True),
            get_client(sync_client=True) as client,
    ):
        client.hello()
        trigger.touch()
        deadline = time.monotonic() + 30
        while not Path(f"{trigger}.written").exists():  # (a blocked pipe never gets there)
            assert time.monotonic() < deadline, "the server's 1 MiB of stderr is still not written"
            time.sleep(0.1)
        _fill(small_disk)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # log records, as a run ships them, until one fails
            client.create_logs([LogCreate(name="test", level=20, message=message,
                                          timestamp=time.time())])  # type: ignore[arg-type]
    text = str(lost.value)
    assert "private Prefect server" in text and f"PREFECT_HOME={small_disk}" in text and "full" in text, text
    log = Path(text.split("log ", 1)[1].split(")", 1)[0])
    assert log.parent == small_disk and log.stat().st_size >= 1 << 20  # kept, with what the server wrote
    assert "free space there" in text and "rerun" in text


def test_a_server_that_stops_answering_is_ended_and_named(monkeypatch, tmp_path):
    """A server that hangs (here: stopped by SIGSTOP) is ended once it has not answered for
    ``LOST_AFTER`` seconds; the run's calls then fail at once (no minute of retries each)."""
    from prefect.client.orchestration import get_client

    from espnet3_flows.orchestration import server_health
    from espnet3_flows.orchestration.local_server import PrivateServerLost, prefect_api

    monkeypatch.setattr(server_health, "LOST_AFTER", 3.0)
    monkeypatch.setattr(server_health, "PROBE_EVERY", 0.5)
    home = tmp_path / "home"
    with (
            _private_api(monkeypatch, home), pytest.raises(PrivateServerLost) as lost,
            prefect_api(needs_server=True) as url,
            get_client(sync_client=True) as client,
    ):
        client.hello()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        server = _server_on(port)
        os.kill(server, signal.SIGSTOP)
        guard = threading.Timer(120, os.kill, (server, signal.SIGKILL))  # never left hanging
        guard.start()
        try:
            while True:
                client.hello()
        finally:
            guard.cancel()
    text = str(lost.value)
    assert "stopped answering" in text and "see its log" in text and "rerun" in text, text
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


def _server_on(port: int) -> int:
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise AssertionError(f"no server listens on port {port}")
