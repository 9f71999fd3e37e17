"""SIGKILL of a Dask worker mid-shard: finished shards stay published, the rerun redoes only the rest."""

from __future__ import annotations

import re

import dask
import pytest
from distributed import Client, LocalCluster

from espnet3_flows.parallel import ShardFailure
from espnet3_flows.parallel.base_runner import DONE
from espnet3_flows.storage import Storage
from tests.parallel.jobs_for_tests import ArrayProvider, GreedyRunner, ScaleSumRunner

pytestmark = pytest.mark.dask
N = 53
KILL_AT = 23


def test_killed_worker_then_rerun_recomputes_only_unfinished(tmp_path):
    marker = tmp_path / "killed"
    crashing = ScaleSumRunner(ArrayProvider({"n": N, "kill_marker": str(marker), "kill_at": KILL_AT}),
                              output_dir=str(tmp_path / "out"), shard_size=10)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client, pytest.raises(ShardFailure) as err:
        crashing.run(range(N), client=client, progress=False)
    assert marker.exists(), "the worker was not killed"
    store = Storage(str(tmp_path / "out"))
    plan = crashing.plan(range(N))  # content-defined shards: the plan says which one holds item KILL_AT
    killed = next(s for s in plan.shards if s.start <= KILL_AT < s.stop)
    assert len(plan.shards) >= 4
    assert re.search(rf"\b{re.escape(killed.name)}\b(?!\.)", str(err.value)), str(err.value)
    done_before = {s.index for s in plan.shards if store.exists(s.name, DONE)}
    assert killed.index not in done_before and len(done_before) >= len(plan.shards) // 2

    rerun = crashing.run(range(N), progress=False)
    assert {s.index for s in rerun.shards if s.cached} == done_before
    assert rerun.computed == len(plan.shards) - len(done_before)

    clean = ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path / "clean"), shard_size=10)
    reference = clean.run(range(N), progress=False)
    assert rerun.merged == reference.merged
    for shard in plan.shards:
        assert store.read_bytes(shard.name, "values.txt") == Storage(str(tmp_path / "clean")).read_bytes(
            shard.name, "values.txt")
    assert not [p for p in (tmp_path / "out").rglob("*") if ".tmp-" in p.name]


def test_workers_over_their_memory_limit_fail_the_shard_naming_the_limit(tmp_path):
    """Issue 57, weak 8: a shard whose item holds 1 GiB on workers limited to 300 MiB. Dask's nannies
    restart each worker that goes over 95 % of it, and after 4 deaths the shard fails; the error
    named no memory limit ("4 different workers ... died"), only ``--verbose`` logs did."""
    greedy = GreedyRunner(ArrayProvider({"n": 20, "kill_at": 3}), output_dir=str(tmp_path / "out"), shard_size=5)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      memory_limit="300MiB") as cluster, Client(cluster) as client, pytest.raises(ShardFailure) as err:
        greedy.run(range(20), client=client, progress=False)
    text = str(err.value)
    assert "memory limit is 300 MiB (parallel.options.memory_limit)" in text, text
    assert "worker(s) were restarted by their nanny" in text and "a rerun resumes" in text, text
