"""A deployment's flow run whose Prefect API server is killed mid-run, on a real process worker:
the flow-run process ends within the bound (30 s after the loss, with Prefect's default client
retries), its output holds one ``error:`` line naming the lost API, and shards that were done
are merged and published (the merge is storage work: it needs no API)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.reliability.test_deployment_workdir import PREFECT, _worker_environ
from tests.support.servers import PrefectServer, PrefectWorker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]
#: The bound (espnet3_flows.orchestration.api_watch) plus slack for a loaded machine: a deadline
#: on the action, not a measurement
ENDED_WITHIN = 30 + 60
# The slow model is in the deployment's own parameters (an operator's, not a form's): one shard
# (~2 s) still runs when the server goes and ends before the loss is declared
DEPLOYMENT = """\
name: api-lost
prefect-version: 3.8.8
pull:
  - espnet3_flows.orchestration.deploy_steps.working_directory: {}
deployments:
  - name: slow
    entrypoint: espnet3_flows.flows.collect_stats
    work_pool: {name: espnet3, work_queue_name: default}
    parameters:
      shard_size: 3
      batch_size: 1
      frontend: {type: model, model: {_target_: tests.orchestration.slow_model.SlowFramer, delay: 0.6}}
      parallel: {env: serial}
"""


def _prefect(server: PrefectServer, *args: str, cwd: Path) -> str:
    done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=cwd, env=server.env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _done(out: Path) -> list[Path]:
    return list(out.glob("valid/shards/split.*/done"))


def _shards(out: Path) -> int:
    """Shards in the run's plan (its ``manifest.json``; a large number until it is written)."""
    try:
        return len(json.loads((out / "valid" / "shards" / "manifest.json").read_text())["shards"])
    except (OSError, ValueError):
        return 1 << 30


def _flow_run_process(worker: PrefectWorker, timeout: float) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(worker.pid).children(recursive=True):
            try:
                if "prefect.engine" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"the worker started no flow-run process:\n{worker.log_tail()}")


def test_a_killed_api_server_ends_a_deployment_run_in_one_line_after_its_merge(demo_corpus, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "prefect.yaml").write_text(DEPLOYMENT)
    server = PrefectServer(tmp_path / "home", log_dir=tmp_path / "logs").start()
    worker = None
    try:
        _prefect(server, "work-pool", "create", "espnet3", "--type", "process", cwd=tmp_path)
        _prefect(server, "deploy", "--all", cwd=tmp_path)
        # the slow model is importable from the checkout; Prefect's client keeps its default retries
        worker = PrefectWorker("espnet3", _worker_environ(server, PYTHONPATH=str(ROOT)), tmp_path,
                               log_dir=tmp_path / "logs").start()
        params = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(out)}
        started = _prefect(server, "deployment", "run", "collect-stats/slow", "--params", json.dumps(params),
                           cwd=tmp_path)
        assert re.search(r"UUID: [0-9a-f-]{36}", started), started
        engine = _flow_run_process(worker, 300)
        deadline = time.monotonic() + 300
        while len(_done(out)) < _shards(out) - 1:
            assert engine.is_running(), worker.log_tail(200)
            assert time.monotonic() < deadline, f"no shards done:\n{worker.log_tail(200)}"
            time.sleep(0.05)
        server.process.stop(((signal.SIGKILL, 10.0),))  # the whole server, at once
        gone, _ = psutil.wait_procs([engine], timeout=ENDED_WITHIN)
        assert gone, f"the flow-run process still runs {ENDED_WITHIN} s after its API server was killed"
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
    text = worker.process.log_path.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-5000:]
    assert errors[0].startswith(f"error: the Prefect API at {server.api_url} stopped answering"), errors
    assert "finished shards are kept" in errors[0], errors
    if len(_done(out)) == _shards(out):  # every shard done: merged and published
        assert (out / "valid" / "feats_stats.npz").is_file(), text[-5000:]
        assert json.loads((out / "valid" / "summary.json").read_text())["utterances"] == 12
