"""A storage endpoint that stalls mid-run (a real moto server, SIGSTOPped: it accepts connections
and never answers) ends a real CLI run in bounded time with one line naming the endpoint; after
SIGCONT a rerun finishes from what was published and its statistics equal a clean run's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import numpy as np
import pytest

from espnet3_flows.config import load_config
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from tests.support.servers import MotoServer, cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect, pytest.mark.s3, pytest.mark.slow]
SLOW = "tests.orchestration.slow_model.SlowFramer"
#: deadlines set small through storage_options (docs/failure-behaviour.md)
DEADLINES = ["storage_options.config_kwargs.connect_timeout=1", "storage_options.config_kwargs.read_timeout=2",
             "storage_options.config_kwargs.retries.total_max_attempts=1"]


def _args(manifest: str, out: str, endpoint: str | None) -> list[str]:
    args = [f"manifests.train={manifest}", f"output_dir={out}", "shard_size=4", "retries=1",
            "retry_delay_seconds=0.1", "parallel.env=serial", "frontend.type=model",
            f"frontend.model._target_={SLOW}", "frontend.model.delay=0.1"]
    return args + ([f"storage_options.client_kwargs.endpoint_url={endpoint}", *DEADLINES] if endpoint else [])


def _env(tmp_path: Path, api_url: str) -> dict[str, str]:
    # credentials from the environment, as a user gives them (never as flow parameters); the
    # session's Prefect server at api_url
    return cli_env(tmp_path / "prefect-home", drop=("AWS_",), api_url=api_url, AWS_ACCESS_KEY_ID="testing",
                   AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1", HF_HUB_OFFLINE="1")


def _cli(tmp_path: Path, args: list[str], api_url: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "flows/collect_stats.py", *args], cwd=ROOT, env=_env(tmp_path, api_url),
                          capture_output=True, text=True, timeout=timeout)


def test_stalled_endpoint_ends_the_run_naming_it_then_rerun_loses_nothing(demo_corpus, tmp_path, session_api_url):
    with MotoServer(log_dir=tmp_path / "moto") as moto:
        moto.make_bucket("stall")
        s3 = boto3.client("s3", endpoint_url=moto.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")

        def done_records() -> int:
            listed = s3.list_objects_v2(Bucket="stall", Prefix="out/train/shards/")
            return sum(o["Key"].endswith("/done") for o in listed.get("Contents", []))

        args = _args(demo_corpus["train"], "s3://stall/out", moto.endpoint_url)
        proc = subprocess.Popen([sys.executable, "flows/collect_stats.py", *args], cwd=ROOT,
                                env=_env(tmp_path, session_api_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stopped = False
        try:
            deadline = time.monotonic() + 240
            while done_records() < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before the endpoint could be stalled"
            os.kill(moto.pid, signal.SIGSTOP)  # the server accepts connections (kernel) and never answers
            stopped, stalled_at = True, time.monotonic()
            out, err = proc.communicate(timeout=180)  # the bounded-time guard
            took = time.monotonic() - stalled_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            if stopped:
                os.kill(moto.pid, signal.SIGCONT)
        print(f"stalled run ended {took:.1f} s after SIGSTOP; stderr {len(err.encode())} bytes")
        assert proc.returncode == 1, out + err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, err
        assert f"storage endpoint {moto.endpoint_url} did not answer" in errors[0], errors[0]
        assert "Traceback" not in err and len(err.encode()) < 4000, err

        listed = s3.list_objects_v2(Bucket="stall", Prefix="out/train/")
        assert not any(o["Key"].endswith("summary.json") for o in listed.get("Contents", []))
        done_before = done_records()

        rerun = _cli(tmp_path, args, session_api_url)  # the endpoint answers again
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        counts = re.search(r"shards computed (\d+) / cached (\d+)", rerun.stdout)
        assert counts and int(counts.group(2)) >= done_before >= 2, rerun.stdout
        remote = s3.get_object(Bucket="stall", Key="out/train/feats_stats.npz")["Body"].read()
        (tmp_path / "remote.npz").write_bytes(remote)

    # the engine alone, here (the delay only paced the stall)
    CollectStatsRunner(load_config(CollectStatsConfig, overrides=[
        *_args(demo_corpus["train"], str(tmp_path / "clean"), None), "frontend.model.delay=0.0"]),
        "train").run(progress=False)
    with np.load(tmp_path / "remote.npz") as got, np.load(tmp_path / "clean" / "train" / "feats_stats.npz") as want:
        assert sorted(got.files) == sorted(want.files)
        for key in want.files:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12)
