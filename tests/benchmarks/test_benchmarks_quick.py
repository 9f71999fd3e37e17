"""Every benchmark runs in ``--quick`` mode and writes its JSON with the expected keys (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NAMES = ("collect_stats", "overhead", "memory", "xvector", "batching")
KEYS = {"name", "machine", "command", "quick", "rows", "targets", "notes"}

pytestmark = [pytest.mark.slow, pytest.mark.dask, pytest.mark.prefect]


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``benchmarks/run.py --quick`` into a temporary results directory (the repository's
    results stay untouched), with its own Prefect server and database."""
    tmp = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--results-dir",
                           str(tmp / "results")], cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    return tmp / "results", proc


def test_quick_run_succeeds(quick_results) -> None:
    _, proc = quick_results
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in NAMES:
        assert f"[bench] === {name} (quick) ===" in proc.stdout


@pytest.mark.parametrize("name", NAMES)
def test_result_json_has_expected_keys(quick_results, name: str) -> None:
    results, _ = quick_results
    data = json.loads((results / f"{name}.json").read_text())
    assert KEYS <= set(data), KEYS - set(data)
    assert data["name"] == name and data["quick"] is True
    assert f"--only {name}" in data["command"] and "--quick" in data["command"]
    assert data["rows"] and isinstance(data["rows"], list)
    assert data["targets"], "every benchmark states at least one target"
    for t in data["targets"]:
        assert {"name", "target", "measured", "met"} <= set(t) and isinstance(t["met"], bool)
    assert {"cpu", "usable_cores", "versions"} <= set(data["machine"])
    assert isinstance(data["notes"], list) and data["notes"]
    assert (results / f"{name}.png").stat().st_size > 0


def test_quick_run_leaves_the_readme_alone(quick_results) -> None:
    _, proc = quick_results
    assert "[bench] updated" not in proc.stdout
