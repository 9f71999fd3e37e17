"""The S3 endpoint going away mid-run (a real one: moto's server behind a proxy the test stops):
s3fs/botocore's own retries and errors run, the run fails naming the shards and the cause,
nothing half-written is trusted, and when the endpoint is back a rerun resumes from what was
published and ends with the outputs of a run that never saw the outage."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import s3fs

from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.parallel import ShardFailure
from tests.support.tcp_proxy import TcpProxy
from tests.support.floats import assert_same_floats

pytestmark = [pytest.mark.prefect, pytest.mark.s3, pytest.mark.slow]
SLOW = "tests.orchestration.slow_model.SlowFramer"
#: shards of the plan left when the endpoint stops: each takes ≥ 0.3 s (two batches at 0.15 s), far
#: more than the 50 ms the watcher needs; each then fails through botocore's, s3fs's and the task's
#: retries against a refused port (~3 s), so the fewer the faster
LEFT_AT_OUTAGE = 3


def _options(endpoint: str) -> dict:
    # botocore: 2 attempts, short timeouts (a real site keeps its defaults; the test needs the
    # failure within seconds, through the same retry and error code)
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint},
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"},
                              "connect_timeout": 2, "read_timeout": 5}}


def _cfg(manifest: str, url: str, endpoint: str) -> dict:
    return {"manifests": {"train": manifest}, "output_dir": url, "storage_options": _options(endpoint),
            "shard_size": 4, "batch_size": 2, "retries": 1, "retry_delay_seconds": 0.1,
            "frontend": {"type": "model", "model": {"_target_": SLOW, "delay": 0.15}},
            "parallel": {"env": "serial"}}


def _done_records(fs: s3fs.S3FileSystem, root: str) -> list[str]:
    fs.invalidate_cache()
    return [p for p in fs.find(f"{root}/train/shards") if p.endswith("/done")]


def test_endpoint_outage_mid_run_fails_clearly_then_rerun_resumes(prefect_harness, demo_corpus, moto_server,
                                                                   s3_output, tmp_path):
    url, direct = s3_output
    root = url[len("s3://"):]
    fs = s3fs.S3FileSystem(**direct)  # straight to moto: sees the store while the proxy is down
    proxy = TcpProxy(moto_server.port).start()
    try:
        # stop the endpoint when all but LEFT_AT_OUTAGE shards are published (watched on moto directly)
        stopped = threading.Event()

        def outage() -> None:
            deadline = time.monotonic() + 300
            plan = f"{root}/train/shards/manifest.json"
            while time.monotonic() < deadline and not fs.exists(plan):
                time.sleep(0.05)
                fs.invalidate_cache()
            wanted = len(json.loads(fs.cat(plan))["shards"]) - LEFT_AT_OUTAGE
            while time.monotonic() < deadline and len(_done_records(fs, root)) < wanted:
                time.sleep(0.05)
            proxy.stop()
            stopped.set()

        watcher = threading.Thread(target=outage, daemon=True)
        watcher.start()
        with pytest.raises(ShardFailure) as err:
            run_job("collect_stats", _cfg(demo_corpus["train"], url, proxy.url), progress=False)
        watcher.join(10)
        assert stopped.is_set()
        message = str(err.value)
        assert "shard(s) failed" in message and "train/shards/split." in message, message
        # botocore's own error for a refused connection reaches the message, endpoint named
        assert "Could not connect to the endpoint URL" in message and proxy.url in message, message

        plan = json.loads(fs.cat(f"{root}/train/shards/manifest.json"))
        n = len(plan["shards"])
        done = _done_records(fs, root)
        assert n - LEFT_AT_OUTAGE <= len(done) < n, (len(done), n)
        assert not fs.exists(f"{root}/train/summary.json") and not fs.exists(f"{root}/train/feats_stats.npz")
        for path in done:  # a done record is written last: everything it lists was published
            for rel in json.loads(fs.cat(path))["files"]:
                assert fs.exists(f"{root}/{rel}"), f"{path} lists {rel}, which was never published"

        proxy.start()  # the endpoint is back, same address
        summary = run_job("collect_stats", _cfg(demo_corpus["train"], url, proxy.url), progress=False)["train"]
    finally:
        proxy.stop()
    assert summary["shards"] == n
    assert summary["shards_cached"] == len(done) and summary["shards_computed"] == n - len(done)

    local = _cfg(demo_corpus["train"], str(tmp_path / "clean"), "") | {"storage_options": {}}
    local["frontend"]["model"]["delay"] = 0.0  # the delay only paces the outage; no outage here
    clean = run_job("collect_stats", local, progress=False)["train"]
    assert clean["frames"] == summary["frames"]
    with fs.open(f"{root}/train/feats_stats.npz", "rb") as f, np.load(f) as got, \
            np.load(tmp_path / "clean" / "train" / "feats_stats.npz") as want:
        for key in want.files:
            assert_same_floats(got[key], want[key])  # two runs, two processes
    assert fs.cat(f"{root}/train/feats_shape") == (tmp_path / "clean" / "train" / "feats_shape").read_bytes()
