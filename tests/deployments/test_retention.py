"""A standing server's database stays bounded with the retention docs/deployments.md gives
("Keeping the database small"): Prefect's own vacuum service, with flow runs on, deletes finished
runs older than the retention period with their subflow runs, task runs, states, logs and
artifacts (SQLite reuses their pages). A real server runs real flows night after night; each
night's runs are made old by moving their end time back in its database (the service's period is
an hour at least). Events have their own retention (Prefect's default: 7 days), not tested here.
"""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support.servers import PrefectServer

pytestmark = [pytest.mark.prefect_server]

#: the settings of docs/deployments.md, with a period of two hours and the service every second
RETENTION = {"PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "events,flow_runs",
             "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": str(2 * 3600),
             "PREFECT_SERVER_SERVICES_DB_VACUUM_LOOP_SECONDS": "1"}
TABLES = ("flow_run", "flow_run_state", "task_run", "task_run_state", "log", "artifact")
RUNS_A_NIGHT = 2


def _night(k: int) -> None:
    """A night's flows: each with a task, log lines, an artifact and a subflow, as a job's run has."""
    from prefect import flow, get_run_logger, task
    from prefect.artifacts import create_markdown_artifact

    @task
    def shard(i: int) -> int:
        get_run_logger().info("shard %d", i)
        return i

    @flow
    def shards(n: int) -> int:
        return sum(shard(i) for i in range(n))

    @flow(name="nightly")
    def nightly(night: int) -> int:
        get_run_logger().info("night %d: %s", night, "x" * 200)
        create_markdown_artifact(f"# night {night}\n" + "row\n" * 50, key=f"night-{night}")
        return shards(3)

    for _ in range(RUNS_A_NIGHT):
        nightly(k)


def _counts(db: Path) -> dict[str, int]:
    with sqlite3.connect(db, timeout=60) as con:
        return {t: con.execute(f"select count(*) from {t}").fetchone()[0] for t in TABLES}


def _wait_for_last_logs(db: Path, runs: int, timeout: float = 60) -> None:
    """Until every run's last log line ("Finished in state ...", sent in the client's next batch)
    is in: a line that came after its run was deleted would wait for the daily orphan cleanup."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sqlite3.connect(db, timeout=60) as con:
            if con.execute("select count(*) from log where name = 'prefect.flow_runs' "
                           "and message like 'Finished in state%'").fetchone()[0] >= runs:
                return
        time.sleep(0.5)


def _age_every_finished_run(db: Path) -> int:
    """Move every finished flow run's end time back two days (as if they ran then)."""
    old = (datetime.now(UTC) - timedelta(days=2)).strftime("%Y-%m-%d %H:%M:%S.%f")
    with sqlite3.connect(db, timeout=60) as con:
        return con.execute("update flow_run set end_time = ? where end_time is not null", (old,)).rowcount


def _wait_for_vacuum(db: Path, timeout: float = 30) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = _counts(db)
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(1)


def test_each_nights_old_runs_go_with_everything_that_hangs_on_them(tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "home"
    db = home / "prefect.db"
    nights = []
    with PrefectServer(home, log_dir=tmp_path / "logs", extra_env=RETENTION) as server, \
            temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        for k in range(3):
            _night(k)
            _wait_for_last_logs(db, 2 * RUNS_A_NIGHT)
            ran = _counts(db)
            assert ran["flow_run"] == 2 * RUNS_A_NIGHT and all(ran.values()), ran
            assert _age_every_finished_run(db) == 2 * RUNS_A_NIGHT
            nights.append(_wait_for_vacuum(db))
    # each night's runs, subflow runs included, are gone with all that hangs on them
    assert all(n == dict.fromkeys(TABLES, 0) for n in nights), nights
