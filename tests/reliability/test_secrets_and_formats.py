"""Credentials never reach outputs, logs, artifacts or flow parameters; shared results are JSON, never pickle."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, UTC

import pytest
import s3fs

from espnet3_flows.orchestration.flows import run_job

pytestmark = [pytest.mark.prefect, pytest.mark.s3]
SECRET = "sEcReT-4f1c9e-do-not-leak"


def test_secret_appears_nowhere_the_run_wrote(prefect_harness, demo_corpus, moto_server, s3_output, caplog,
                                              capsys):
    url, _ = s3_output
    options = moto_server.storage_options(key="AKIAEXAMPLE", secret=SECRET)
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": url, "storage_options": options,
           "shard_size": 4, "on_error": "skip", "parallel": {"env": "serial"}}
    caplog.set_level(logging.DEBUG)
    started = datetime.now(UTC)
    summary = run_job("collect_stats", cfg, progress=True)["valid"]
    assert summary["shards"] > 1 and summary["utterances"] == 12

    fs = s3fs.S3FileSystem(**options)
    root = url[len("s3://"):]
    written = fs.find(root)
    assert any(p.endswith("summary.json") for p in written) and any(p.endswith("/done") for p in written)
    for path in written:
        assert SECRET.encode() not in fs.cat(path), path
    out, err = capsys.readouterr()
    assert SECRET not in out + err + caplog.text

    from prefect.client.orchestration import get_client

    from tests.support.prefect_readback import artifacts_of, read_all, runs_writing

    async def stored():
        async with get_client() as client:
            return await read_all(client.read_artifacts), await read_all(client.read_flow_runs)

    artifacts, runs = asyncio.run(stored())
    # every record of the session's server (one page would hold any 200), this run's among them
    (run,) = runs_writing("collect-stats-shards", url)
    assert started <= artifacts_of(run, "collect-stats-valid-report")["collect-stats-valid-report"].created
    assert SECRET not in json.dumps([a.data for a in artifacts], default=str)
    assert SECRET not in json.dumps([r.parameters for r in runs], default=str)


def test_shard_records_are_json_and_nothing_is_pickled(prefect_harness, demo_corpus, tmp_path):
    out = tmp_path / "out"
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(out), "shard_size": 4,
           "parallel": {"env": "serial"}}
    summary = run_job("collect_stats", cfg, progress=False)["valid"]
    done = list(out.glob("valid/shards/split.*/done"))
    assert len(done) == summary["shards"] > 1
    for path in [*done, out / "valid/shards/manifest.json", out / "valid/summary.json"]:
        json.loads(path.read_text())
    # the done records are the only cache: Prefect persists no (cloudpickle) result anywhere
    assert not (out / ".prefect-results").exists()
    assert not [p for p in out.rglob("*") if p.is_file() and p.read_bytes()[:1] == b"\x80"]  # no pickle stream
