"""The ``espnet2`` benchmark's busy machine: ``benchmarks.machine.cpu_hogs`` starts its hogs each in
a session of its own and leaves none behind, and the benchmark's row and hog options parse as
documented (in a child process: ``benchmarks.common`` sets Prefect variables in its process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.machine import cpu_hogs

REPO = Path(__file__).resolve().parents[2]


def test_hogs_spin_in_sessions_of_their_own_and_are_gone_afterwards():
    with cpu_hogs(2) as cpu_seconds:
        hogs = [p for p in psutil.Process().children() if "while True: pass" in " ".join(p.cmdline())]
        assert len(hogs) == 2
        assert all(os.getsid(p.pid) == p.pid != os.getsid(0) for p in hogs)
        deadline = time.monotonic() + 60
        while cpu_seconds() < 0.2 and time.monotonic() < deadline:  # (a wait for the hogs to spin, not a timing)
            time.sleep(0.05)
        assert cpu_seconds() >= 0.2
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in hogs)
    with cpu_hogs(0) as none:
        assert none() == 0.0


OPTIONS = """
import json, os
from benchmarks import bench_espnet2 as b
out = {}
for rows, hogs in (("", ""), ("jobs", "cores"), ("cold_small, one", "3")):
    os.environ["ESPNET3_BENCH_ESPNET2_ROWS"], os.environ["ESPNET3_BENCH_ESPNET2_HOGS"] = rows, hogs
    out[rows] = [b.chosen_rows(), b.hog_count(2)]
os.environ["ESPNET3_BENCH_ESPNET2_ROWS"] = "jobs,nope"
try:
    b.chosen_rows()
except ValueError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def test_row_and_hog_options():
    got = json.loads(subprocess.run([sys.executable, "-c", OPTIONS], cwd=REPO, check=True, capture_output=True,
                                    text=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout)
    every = ["one", "jobs", "cold", "cold_served", "cold_class", "cold_small"]
    assert got[""] == [every, 0]
    assert got["jobs"] == [["jobs", "cold", "cold_served"], 2]  # the rows the targets compare are always there
    assert got["cold_small, one"] == [["one", "jobs", "cold", "cold_served", "cold_small"], 3]
    assert "unknown rows ['nope']" in got["error"]
