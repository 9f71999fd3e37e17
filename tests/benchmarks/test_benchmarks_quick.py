"""The benchmarks' bookkeeping: every benchmark is in one quick group, and ``scale``, ``corpus`` and
``soak`` (too long to run here even with ``--quick``) turn failed runs into rows and missed targets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import quick_benchmarks

REPO = Path(__file__).resolve().parents[2]


def test_every_benchmark_runs_in_one_quick_group() -> None:
    """A new benchmark must join a quick group (or say why not), and each group has its module."""
    from benchmarks.run import BENCHMARKS

    grouped = [name for names in quick_benchmarks.GROUPS.values() for name in names]
    assert len(grouped) == len(set(grouped)), grouped
    assert set(grouped) | quick_benchmarks.NOT_QUICK == set(BENCHMARKS)
    assert not set(grouped) & quick_benchmarks.NOT_QUICK
    modules = {path.stem.removeprefix("test_quick_") for path in Path(__file__).parent.glob("test_quick_*.py")}
    assert modules == set(quick_benchmarks.GROUPS)


# ``scale`` and ``corpus`` run the CLI a dozen times even with ``--quick`` (~1 min on 2 cores), so
# they are in no quick group; this checks their bookkeeping without running a flow.
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
dry = {"utterances": 1000, "section": "dry-run", "run": bench_corpus.DRY_RUN, "ok": True, "rc": 0, "killed": None,
       "wall_s": 3.0, "left_behind": ["/x/out"], "left_behind_count": 1}
met = {t["name"].split(" ")[0]: t for t in bench_corpus.make_targets(rows + [dry], 10, 1000, 5000) if "dry-run" in t["name"]}
assert met["1,000"]["met"] and not met["--dry-run"]["met"] and "/x/out" in met["--dry-run"]["measured"], met
dry.update(left_behind=[], left_behind_count=0)
assert all(t["met"] for t in bench_corpus.make_targets(rows + [dry], 10, 1000, 5000) if "dry-run" in t["name"]
           and "planning" not in t["name"])
print(bench_corpus.table({"rows": rows}))

from benchmarks import bench_soak

assert bench_soak.night_sizes(100, 4) == [100, 103, 107, 111] and bench_soak.night_sizes(10, 3) == [10, 11, 12]
night = {"section": "night", "scheduler_rss_mb": 100.0, "worker_rss_mb": 300.0, "server_rss_mb": 400.0, "workers_seen": 2}
rows = [{**night, "night": k, "utterances": 10 + k, "db_mb": 1.0 + 0.3 * k,
         "scheduler_rss_mb": 100.0 + (20 if k == 4 else 0)} for k in (1, 2, 3, 4)]
rows += [{"section": "run", "night": k, "job": job, "utterances": 10 + k, "wall_s": 5.0, "state": "COMPLETED",
          "message": "", "equals_fresh": (k, job) != (2, "extract_features"),
          "difference": "3 of 12 values differ (e.g. u1)" if (k, job) == (2, "extract_features") else ""}
         for k in (1, 2, 3, 4) for job in bench_soak.JOBS]
targets = {t["name"]: t for t in bench_soak.make_targets(rows)}
same = targets["every run completes with a fresh run's outputs"]
assert not same["met"] and "night 2 extract_features: 3 of 12 values differ" in same["measured"], same
assert not targets["scheduler RSS after night 4 / after night 3"]["met"]  # 120 MB after 100: 1.2
assert targets["largest worker RSS after night 4 / after night 3"]["met"]
assert abs(bench_soak.db_growth_per_run(rows) - 0.1) < 1e-9  # 0.3 MB a night, three runs a night
assert "| 4 | 14 |" in bench_soak.table({"rows": rows}) and "**no**" in bench_soak.table({"rows": rows})
assert not bench_soak.make_targets([r for r in rows if r["night"] < 3])[1]["met"]  # too few nights: not met

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
