"""One Prefect server for every pytest process of a run: the session's ``prefect_harness``.

Under pytest-xdist (``make test`` runs three processes) the controller starts it in a thread while
the workers start and collect, and names a JSON file in :data:`ENV`; the workers inherit the
variable and their ``prefect_harness`` waits for the file (``{"api_url": ..., "pid": ...}`` once
the server answers, ``{"error": ...}`` if it never did). The patches-off pass, a pytest of its own
started by a test with the suite's environment, finds the same server the same way. One server
instead of one a process: over ``pytest -n 3 tests/orchestration`` (~3.5 minutes) the three
per-process harness servers took 38.6 CPU-s, the shared one 17.4 (each process's own server
migrates a new database, then runs for the whole run).

A pytest without xdist and without the variable starts its own (``conftest.prefect_harness``).
The tests that read runs back from it find their own by name and output directory
(:mod:`tests.support.prefect_readback`): other processes' runs are on the same server.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: the JSON file that says where the run's shared Prefect server listens
ENV = "ESPNET3_TEST_PREFECT_SERVER"


def server_settings() -> dict[str, str]:
    """The session server's settings: those of the CLI's private server and ``make serve`` (task-run
    states recorded in batches, no block registration at start, the loop services no test uses
    off), but the event persister stays on: the secrets tests read every event back."""
    from espnet3_flows.orchestration.local_server import SERVER_BATCHING, SERVER_START_SETTINGS, UNUSED_SERVICES

    services_off = {f"PREFECT_SERVER_SERVICES_{name.upper()}_ENABLED": "false"
                    for name in UNUSED_SERVICES if name != "event_persister"}
    return {**SERVER_BATCHING, **SERVER_START_SETTINGS, **services_off}


class SharedServer:
    """A ``prefect server start`` on a migrated copy of the database in a temporary home, started
    in a thread by :meth:`start_in_background` (the caller goes on), stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="espnet3-flows-test-server-"))
        self.info_file = self.root / "server.json"
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start_in_background(self) -> None:
        self._thread = threading.Thread(target=self._start, name="shared-prefect-server", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        from tests.support.servers import PrefectServer

        try:
            self._server = PrefectServer(self.root / "home", log_dir=self.root / "logs", extra_env=server_settings())
            self._server.start()
            info = {"api_url": self._server.api_url, "pid": self._server.pid}
        except BaseException as exc:  # noqa: BLE001 - every worker is told, not left waiting
            log = self._server.log_tail() if self._server is not None else ""
            info = {"error": f"{type(exc).__name__}: {exc}\n{log}"}
        partial = self.info_file.with_suffix(".partial")
        partial.write_text(json.dumps(info))
        os.replace(partial, self.info_file)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=180)
        if self._server is not None:
            self._server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def wait_for(info_file: str | os.PathLike, timeout: float = 240.0) -> dict[str, Any]:
    """The shared server's ``{"api_url", "pid"}`` once the file says it answers; raises with the
    server's own error (or after ``timeout`` seconds, the server's start included)."""
    path = Path(info_file)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared Prefect server named in ${ENV} ({path}) did not start in {timeout:.0f} s")
        time.sleep(0.1)
    info = json.loads(path.read_text())
    if "error" in info:
        raise RuntimeError(f"the shared Prefect server did not start: {info['error']}")
    return info
