"""``python -m benchmarks.side_by_side``: two checkouts' results read into comparable rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.side_by_side import row_values

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_results_of_the_compared_benchmarks_give_rows():
    """The rows of ``startup``, ``runners`` and ``scale`` as their JSON holds them (a spread, a
    number; one row per repetition in ``scale``) are labelled and read as seconds."""
    for name, expected in (("startup", "local, no server"), ("runners", "runner_flow cold"),
                           ("scale", "1000 shards, flow cold")):
        rows = row_values(json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text()))
        assert expected in rows and all(v > 0 for v in rows.values()), (name, rows)


def test_rows_of_one_label_give_their_median():
    result = {"rows": [{"case": "a", "wall_s": {"median": 2.0}}, {"run": "b", "shards": 10, "wall_s": 1.0},
                       {"run": "b", "shards": 10, "wall_s": 3.0}, {"run": "b", "shards": 10, "wall_s": 9.0},
                       {"case": "no figure"}, {"case": "failed", "wall_s": None},
                       {"run": "c", "wall_s": 5.0, "cpu_s": 7.0, "server_cpu_s": 1.5},
                       {"run": "d", "wall_s": 5.0, "cpu_s": 7.0, "server_cpu_s": None}]}
    assert row_values(result) == {"a": 2.0, "10 shards, b": 3.0, "c": 5.0, "c, CPU": 8.5, "d": 5.0}


def test_a_base_that_is_no_checkout_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.side_by_side", "--base", str(tmp_path),
                           "--only", "startup"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a checkout with benchmarks/" in proc.stderr


def test_a_base_setting_is_name_equals_value(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.side_by_side", "--base", str(REPO), "--only", "startup",
                           "--base-env", "ESPNET3_FLOWS_PATCHES"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--base-env takes NAME=VALUE" in proc.stderr
