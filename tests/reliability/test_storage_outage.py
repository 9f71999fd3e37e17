"""A store failing mid-run: retries with backoff, a clear failure, nothing half-published, rerun completes."""

from __future__ import annotations

import json

import pytest

from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.parallel import ShardFailure
from espnet3_flows.storage import Storage
from tests.support.faulty_fs import FaultyFileSystem

pytestmark = pytest.mark.prefect


@pytest.fixture
def faulty():
    FaultyFileSystem.reset()
    yield FaultyFileSystem
    FaultyFileSystem.reset()


def _cfg(demo_corpus, **extra):
    return {"manifests": {"train": demo_corpus["train"]}, "output_dir": "faulty://bucket/out", "shard_size": 8,
            "retries": 2, "retry_delay_seconds": 0.05, "parallel": {"env": "serial"}} | extra


def test_outage_mid_run_fails_clearly_then_rerun_completes(prefect_harness, demo_corpus, faulty):
    store = Storage("faulty://bucket/out")
    # the plan (1 write) and the probe (1 write + 1 delete) succeed, then a few shard writes
    faulty.fail_after_writes = 9
    with pytest.raises(ShardFailure) as err:
        run_job("collect_stats", _cfg(demo_corpus), progress=False)
    msg = str(err.value)
    assert "shard(s) failed" in msg and "train/shards/split." in msg and "injected outage" in msg
    assert store.exists("train/shards/manifest.json"), "the check below would be vacuous"
    assert not store.exists("train/summary.json") and not store.exists("train/feats_stats.npz")
    n = len(json.loads(store.fs.cat(store.path("train/shards/manifest.json")))["shards"])
    done = [p for p in store.fs.find(store.path("train/shards")) if p.endswith("/done")]
    assert 0 < len(done) < n
    # each failed shard was tried 1 + retries (2) times, every attempt stopping at its first write
    assert faulty.attempts_during_outage == 3 * (n - len(done))
    for path in done:
        for rel in json.loads(store.fs.cat(path))["files"]:
            assert store.exists(rel), f"{path} lists a file that was never published"

    faulty.outage, faulty.fail_after_writes = False, None
    summary = run_job("collect_stats", _cfg(demo_corpus), progress=False)["train"]
    assert summary["utterances"] == 48 and summary["shards"] == n
    assert summary["shards_cached"] == len(done) and summary["shards_computed"] == n - len(done)
    assert store.exists("train/summary.json") and store.exists("train/feats_stats.npz")
