"""Every benchmark runs in ``--quick`` mode and writes its JSON with the expected keys (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.prefect_db import seed_home

REPO = Path(__file__).resolve().parents[2]
NAMES = ("collect_stats", "overhead", "memory", "xvector", "batching", "espnet2", "frontend_espnet2", "spk_embed",
         "s3", "startup", "runners")
KEYS = {"name", "machine", "command", "quick", "rows", "targets", "notes"}

pytestmark = [pytest.mark.slow, pytest.mark.dask, pytest.mark.prefect]


# one fixture runs eleven benchmarks: ~4 minutes on 2 cores, past the suite's 120 s per test
@pytest.fixture(scope="module")
def quick_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``python -m benchmarks --quick --only NAMES`` into a temporary results directory (the
    repository's results stay untouched), with its own Prefect server and (migrated) database."""
    tmp = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(seed_home(tmp / "prefect-home")),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", *NAMES, "--results-dir",
                           str(tmp / "results")], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return tmp / "results", proc


@pytest.mark.timeout(600)
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


# ``scale`` and ``corpus`` run the CLI a dozen times even with ``--quick`` (~1 min on 2 cores), so
# they are not part of the quick run above; this checks their bookkeeping without running a flow.
_BOOKKEEPING = r"""
import json, sys
from benchmarks import bench_corpus, bench_scale, process_tree, run

assert {"scale", "corpus"} <= set(run.BENCHMARKS)
classify = process_tree.classify_process
assert classify(["python", "flows/collect_stats.py"], None, True) == "driver"
fork = ["python", "-B", "-c", "from multiprocessing.forkserver import main; main(3, 6, ['prefect.task_engine'])"]
assert classify(fork, ["python", "flows/collect_stats.py"], False) == "forkserver"
assert classify(fork, fork, False) == "worker"
assert classify(["python", "-c", "from multiprocessing.spawn import spawn_main"], None, False) == "worker"
assert classify(["python", "-m", "uvicorn", "prefect.server.api.server:create_app"], None, False) == "server"
assert classify(["python", "-c", "from multiprocessing.resource_tracker import main"], None, False) == "other"

failed = {"ok": False, "rc": -9, "killed": "memory", "wall_s": 12.0, "driver_peak_mb": 9000.0,
          "driver_peak_bytes": 9000 * 2 ** 20, "worker_peak_mb": 800.0}
rows = [{"shards": 1000, "utterances": 30000, "section": "engine", "run": "engine cold", **failed, "ok": True, "rc": 0,
         "killed": None}]
rows += [{"shards": 1000, "utterances": 30000, "section": "flow", "run": r, **failed} for r in bench_scale.FLOW_RUNS]
targets = bench_scale.make_targets(rows, [1000], 1.0)
assert targets and not any(t["met"] for t in targets), targets
print(bench_scale.table({"rows": rows}))
rows = [{"utterances": n, "section": "run", "run": r, **failed} for n in (10, 1000) for r in ("cold", "no-op rerun")]
rows.append({"utterances": 5000, "section": "plan", "run": "planning (--dry-run)", "ok": False, "skipped": "no --dry-run"})
targets = bench_corpus.make_targets(rows, 10, 1000, 5000)
assert targets and not any(t["met"] for t in targets), targets
print(bench_corpus.table({"rows": rows}))

import tempfile, pathlib
from espnet3_flows.sharding import Shard, ShardPlan
plan = pathlib.Path(tempfile.mkdtemp()) / "manifest.json"
ids = ["a", "a_ins", "b", "c", "c_ins", "d"]
shards = tuple(Shard(k, 2 * k, 2 * k + 2, f"h{k}") for k in range(3))
plan.write_text(json.dumps(ShardPlan(shards, 2, "config", "salt").to_dict()))
assert bench_scale.receiving_shards(plan, ids, ["a_ins", "c_ins"])[:2] == (2, 3)
assert bench_scale.receiving_shards(plan, ids[:4], ["a_ins"])[0] is None  # the plan does not cover the manifest
plan.write_text(json.dumps({"shards": [{"boundary": 1}]}))
assert bench_scale.receiving_shards(plan, ids, ["a_ins"])[0] is None
"""


def test_scale_and_corpus_bookkeeping(tmp_path: Path) -> None:
    """Failed runs become rows and missed targets, not crashes; worker processes are told apart."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "ESPNET3_BENCH_DATA": str(tmp_path / "data"),
           "ESPNET3_BENCH_RESULTS": str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, "-c", _BOOKKEEPING], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
