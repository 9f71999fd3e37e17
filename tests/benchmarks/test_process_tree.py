"""``benchmarks.process_tree``: the CPU a run's process tree used is counted whole, orphans included."""

from __future__ import annotations

import sys

from benchmarks import bench_scale, process_tree

#: A parent that starts a child burning a fixed CPU time and exits at once: the child is orphaned.
ORPHANING = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time\\nwhile time.process_time() < 0.6: pass"])
"""


def test_the_cpu_of_a_child_left_behind_by_its_parent_is_counted(tmp_path):
    """The grandchild is re-parented to the benchmark (its subreaper) and waited for there, so its
    0.6 s of CPU is in the run's figure, however fast the machine is."""
    res = process_tree.run_monitored([sys.executable, "-c", ORPHANING], tmp_path / "run.log")
    assert res["rc"] == 0 and res["orphans_killed"] == 0
    assert res["cpu_s"] is not None and res["cpu_s"] >= 0.6, res["cpu_s"]
    assert 0 <= res["driver_cpu_s"] < 0.6  # the parent's own time only (sampled), not its child's
    assert res["server_cpu_s"] is None  # no server named


def test_a_named_server_process_is_counted_apart(tmp_path):
    res = process_tree.run_monitored([sys.executable, "-c", "pass"], tmp_path / "run.log",
                                     server_pid=process_tree.os.getpid())
    assert res["server_cpu_s"] is not None and res["server_cpu_s"] >= 0


def test_cpu_per_task_run_is_the_cold_flow_less_the_cold_engine_over_the_shards():
    def row(run: str, cpu: float, server: float | None = 1.0, **extra) -> dict:
        return {"shards": 10, "run": run, "ok": True, "cpu_s": cpu, "server_cpu_s": server, **extra}

    rows = [row("engine cold", 9.0), row("engine cold", 11.0), row("engine cold", 10.0),
            row("flow cold", 10.5, shards_computed=10), row("flow cold", 10.3, shards_computed=10),
            row("flow cold", 30.0, shards_computed=10), row("flow no-op rerun", 99.0)]
    assert bench_scale.cpu_per_task_ms(rows, 10) == 50.0  # (11.5 - 11.0) s over 10 shards
    assert "not measured" in bench_scale.cpu_per_task_ms([*rows, row("flow cold", 1.0, None)], 10)
    assert bench_scale.cpu_per_task_ms(rows[:3], 10) == "a cold run failed"
