"""The README's deployment sequence, run literally: `make serve`, export the URL it prints,
`make deploy`, `make worker`, `prefect deployment run ... --watch`, `make stop` — real server,
real worker, real flow runs. A failed run's `--watch` output carries the one-line cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]


def test_make_serve_deploy_worker_run_stop(tmp_path, demo_corpus):
    venv = Path(sys.executable).parent.parent
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), ESPNET3_STACK_DIR=str(tmp_path / "stack"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1")
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
        out = tmp_path / "out"
        params = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(out), "parallel_env": "serial"}
        ran = sh(prefect, "deployment", "run", "collect-stats/collect-stats", "--watch", "--params", json.dumps(params))
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert (out / "valid" / "feats_stats.npz").is_file()

        missing = tmp_path / "no-such.tsv"
        bad = params | {"manifests": {"valid": str(missing)}, "output_dir": str(tmp_path / "bad")}
        failed = sh(prefect, "deployment", "run", "collect-stats/collect-stats", "--watch", "--params", json.dumps(bad))
        text = failed.stdout + failed.stderr
        assert failed.returncode != 0, text
        # the reason is in what --watch prints, not only in the worker's log
        assert str(missing) in text and "not found" in text, text

        status = sh(*make, "status")
        assert "server: running" in status.stdout and "worker: running" in status.stdout, status.stdout
    finally:
        stopped = sh(*make, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert "does not answer" in sh(*make, "status").stdout
