"""``benchmarks.process_tree`` and ``benchmarks.cpu_time``: the CPU a run's process tree used is
counted whole, orphans included, and the benchmark adopts orphans only while a run lasts.

``process_tree`` imports ``benchmarks.common``, which sets the benchmarks' own Prefect variables in
its process's environment: its runs are measured in a child process here, as
``test_benchmarks_quick`` does, so that this test process keeps its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import cpu_time

REPO = Path(__file__).resolve().parents[2]

#: A parent that starts a child burning a fixed CPU time and exits at once: the child is orphaned.
ORPHANING = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time\\nwhile time.process_time() < 0.6: pass"])
"""
#: Measures ORPHANING with process_tree, and a run naming this process as its server; prints JSON.
MEASURING = """
import ctypes, json, os, sys
from pathlib import Path
from benchmarks import process_tree

def subreaper():
    flag = ctypes.c_int(0)
    assert ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)

logs = Path(sys.argv[1])
orphaning = process_tree.run_monitored([sys.executable, "-c", sys.argv[2]], logs / "orphaning.log")
served = process_tree.run_monitored([sys.executable, "-c", "pass"], logs / "served.log", server_pid=os.getpid())
keys = ("rc", "orphans_killed", "cpu_s", "driver_cpu_s", "server_cpu_s")
print(json.dumps({"orphaning": {k: orphaning[k] for k in keys}, "served": {k: served[k] for k in keys},
                  "subreaper_after": subreaper(), "children_left": len(__import__("psutil").Process().children())}))
"""


def _measured(tmp_path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEASURING, str(tmp_path), ORPHANING], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_cpu_of_a_child_left_behind_by_its_parent_is_counted_and_nothing_stays_adopted(tmp_path):
    """The grandchild is re-parented to the benchmark (its subreaper during the run) and waited for
    there, so its 0.6 s of CPU is in the run's figure, however fast the machine is; after the runs
    the benchmark is no subreaper and has no child left (zombie or not)."""
    res = _measured(tmp_path)
    orphaning, served = res["orphaning"], res["served"]
    assert orphaning["rc"] == 0 and orphaning["orphans_killed"] == 0
    assert orphaning["cpu_s"] is not None and orphaning["cpu_s"] >= 0.6, orphaning
    assert 0 <= orphaning["driver_cpu_s"] < 0.6  # the parent's own time only (sampled), not its child's
    assert orphaning["server_cpu_s"] is None  # no server named
    assert served["server_cpu_s"] is not None and served["server_cpu_s"] >= 0
    assert not res["subreaper_after"] and res["children_left"] == 0


def test_cpu_per_task_run_is_the_cold_flow_less_the_cold_engine_over_the_shards():
    def row(run: str, cpu: float, server: float | None = 1.0, **extra) -> dict:
        return {"shards": 10, "run": run, "ok": True, "cpu_s": cpu, "server_cpu_s": server, **extra}

    rows = [row("engine cold", 9.0), row("engine cold", 11.0), row("engine cold", 10.0),
            row("flow cold", 10.5, shards_computed=10), row("flow cold", 10.3, shards_computed=10),
            row("flow cold", 30.0, shards_computed=10), row("flow no-op rerun", 99.0)]
    assert cpu_time.cpu_per_task_ms(rows, 10) == 50.0  # (11.5 - 11.0) s over 10 shards
    assert "not measured" in cpu_time.cpu_per_task_ms([*rows, row("flow cold", 1.0, None)], 10)
    assert cpu_time.cpu_per_task_ms(rows[:3], 10) == "a cold run failed"
