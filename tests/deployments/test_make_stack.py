"""The README's deployment sequence, run literally: `make serve`, export the URL it prints,
`make deploy`, `make worker`, `prefect deployment run ... --watch`, `make stop` — real server,
real worker, real flow runs. A failed run's `--watch` output carries the one-line cause, an 8 kHz
run's warning reaches the run's logs, and three runs triggered at once against the SQLite server
(more than the worker's limit) are all created and all complete."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.support.servers import cli_env, free_port

ROOT = Path(__file__).resolve().parents[2]
# ~2 min on 2 cores: 6 deployment runs, three of them two at a time through one process worker
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow, pytest.mark.timeout(600)]


def test_make_serve_deploy_worker_run_stop(tmp_path):
    venv = Path(sys.executable).parent.parent
    port = free_port()
    # the worker asks for runs every 2 s, not Prefect's 10: 6 runs, each picked up ~4 s sooner
    env = cli_env(tmp_path / "prefect-home", ESPNET3_STACK_DIR=str(tmp_path / "stack"), HF_HUB_OFFLINE="1",
                  PREFECT_WORKER_QUERY_SECONDS="2", PREFECT_WORKER_PREFETCH_SECONDS="2")
    # this suite's venv, taken as installed (never rebuilt or removed by make from here)
    make = ["make", "-s", f"VENV={venv}", f"--assume-old={venv}/.installed", f"PREFECT_PORT={port}"]

    def sh(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    pids: list[int] = []
    try:
        served = sh(*make, "serve")
        assert served.returncode == 0, served.stdout + served.stderr
        export = served.stdout.strip().splitlines()[-1]
        assert export == f"export PREFECT_API_URL=http://127.0.0.1:{port}/api", served.stdout
        env["PREFECT_API_URL"] = export.split("=", 1)[1]  # what `eval "$(make -s serve)"` does
        pids += [int((tmp_path / "stack" / "server.pid").read_text())]
        for target in ("deploy", "worker"):
            done = sh(*make, target)
            assert done.returncode == 0, f"make {target}:\n{done.stdout}{done.stderr}"
        pids += [int((tmp_path / "stack" / "worker.pid").read_text())]

        prefect = str(venv / "bin" / "prefect")
        # 8 kHz input under the 16 kHz default: the merge's warning, logged by espnet3_flows.frontend_job
        # (not the flow's logger), reaches the run's logs in the API (extra_loggers in prefect.yaml)
        from espnet3_flows.inputs.demo import make_demo_corpus

        low = make_demo_corpus(tmp_path / "demo8k", n_utts=8, sampling_rate=8000, splits={"valid": 1.0})
        out = tmp_path / "out"
        params = {"manifests": {"valid": str(low["valid"])}, "output_dir": str(out), "parallel": {"env": "serial"}}
        ran = sh(prefect, "deployment", "run", "collect-stats/collect-stats", "--watch", "--params", json.dumps(params))
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert (out / "valid" / "feats_stats.npz").is_file()
        logs = _all_logs(env["PREFECT_API_URL"])
        assert any(r["name"] == "espnet3_flows.frontend_job" and "frontend.sampling_rate=8000" in r["message"]
                   for r in logs), sorted({(r["name"], r["message"][:100]) for r in logs if r["level"] >= 30 or "espnet3" in r["name"]})
        assert not any("shard/s]" in r["message"] for r in logs), "a progress bar in the run's logs"

        missing = tmp_path / "no-such.tsv"
        bad = params | {"manifests": {"valid": str(missing)}, "output_dir": str(tmp_path / "bad")}
        failed = sh(prefect, "deployment", "run", "collect-stats/collect-stats", "--watch", "--params", json.dumps(bad))
        text = failed.stdout + failed.stderr
        assert failed.returncode != 0, text
        # the reason is in what --watch prints, not only in the worker's log
        assert str(missing) in text and "not found" in text, text

        _runs_at_once(prefect, env, params, tmp_path, reference=out / "valid" / "feats_stats.npz")

        status = sh(*make, "status")
        assert "server: running" in status.stdout and "worker: running" in status.stdout, status.stdout

        # `make stop` during a run: the run's processes (a session of their own, outside the
        # worker's process group) go with the worker, none is left behind
        queued = sh(prefect, "deployment", "run", "collect-stats/collect-stats", "--params",
                    json.dumps(params | {"output_dir": str(tmp_path / "stopped")}))
        assert queued.returncode == 0, queued.stdout + queued.stderr
        worker = psutil.Process(pids[-1])
        for _ in range(600):
            running = worker.children(recursive=True)
            if running:
                break
            time.sleep(0.1)
        assert running, "the worker started no flow-run process"
        pids += [p.pid for p in running]
    finally:
        stopped = sh(*make, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert "does not answer" in sh(*make, "status").stdout


#: triggers at once: more than `make worker`'s limit (2), so a run queues behind the limit while
#: their creations race on SQLite. Ten, as first written (issue 57), cost ~1.5 min more; the hang
#: they were written for did not reproduce here with ten either (four took a flow-run process more)
AT_ONCE = 3


def _runs_at_once(prefect: str, env: dict[str, str], params: dict, tmp_path: Path, reference: Path) -> None:
    """AT_ONCE `prefect deployment run` at once, as people or a script would: each creates its run
    (SQLite answers some writes "database is locked"; the client retries them), the worker runs
    them `make worker`'s limit at a time, and each completes with the outputs of the first run."""
    triggers = [subprocess.Popen([prefect, "deployment", "run", "collect-stats/collect-stats", "--params",
                                  json.dumps(params | {"output_dir": str(tmp_path / f"at-once{i}")})],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(AT_ONCE)]
    ids = []
    try:
        for trigger in triggers:
            text = trigger.communicate(timeout=300)[0]
            created = re.search(r"UUID: ([0-9a-f-]{36})", text)
            assert trigger.returncode == 0 and created, text[-3000:]
            ids.append(created.group(1))
    finally:
        for trigger in triggers:
            if trigger.poll() is None:
                trigger.kill()
    states = _final_states(env["PREFECT_API_URL"], ids, timeout=900)
    assert states == ["COMPLETED"] * AT_ONCE, states
    with np.load(reference) as first:
        for i in range(AT_ONCE):
            with np.load(tmp_path / f"at-once{i}" / "valid" / "feats_stats.npz") as again:
                assert int(again["count"]) == int(first["count"])
                np.testing.assert_allclose(again["sum"], first["sum"], rtol=1e-12)
                np.testing.assert_allclose(again["sum_square"], first["sum_square"], rtol=1e-12)


def _final_states(api_url: str, ids: list[str], timeout: float) -> list[str]:
    """The runs' state types once every one is final, or as they are after ``timeout`` seconds."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            states = [json.loads(urllib.request.urlopen(f"{api_url}/flow_runs/{i}", timeout=30).read())["state_type"]
                      for i in ids]
        except OSError:  # SQLite busy with the runs' own writes may answer a read late: ask again
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
            continue
        if all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(2)


def _all_logs(api_url: str) -> list[dict]:
    """Every log record on the server (this test's own), read back through the REST API, once a
    record of this project's loggers is there or after 60 s. The shards run in a subflow with a
    flow run id of its own, so the records are not filtered by the deployment's run."""
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        logs: list[dict] = []
        while True:
            body = json.dumps({"limit": 200, "offset": len(logs)}).encode()
            request = urllib.request.Request(f"{api_url}/logs/filter", data=body,
                                             headers={"Content-Type": "application/json"})
            page = json.loads(urllib.request.urlopen(request, timeout=30).read())
            logs += page
            if len(page) < 200:
                break
        if any(r["name"].startswith("espnet3_flows") for r in logs) or time.monotonic() > deadline:
            return logs
        time.sleep(1)
