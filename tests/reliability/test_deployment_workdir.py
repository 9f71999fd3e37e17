"""Where a deployment's run reads and writes, against a real Prefect server and real
`prefect worker start` process workers started from a directory that is not the checkout.

Prefect's process worker runs each flow run in a temporary directory it deletes afterwards.
Relative paths in a run's parameters must resolve in $ESPNET3_FLOWS_WORKDIR, else in the
directory the worker was started in, and the run's logs (read through the API) must name that
directory; a run that still works in the temporary directory (a deployment whose pull steps
choose none) refuses relative paths, naming the fix, and completes with absolute ones.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.servers import PrefectServer, PrefectWorker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]
PREFECT = str(Path(sys.executable).with_name("prefect"))

# The shipped flow with a pull step that chooses no directory (as a deployment made without
# deployments/prefect.yaml's): Prefect then runs it in the worker's temporary directory.
NO_WORKDIR_STEP = """\
name: no-workdir-step
prefect-version: 3.8.8
pull:
  - prefect.deployments.steps.run_shell_script:
      script: "true"
deployments:
  - name: temporary
    entrypoint: espnet3_flows.flows.collect_stats
    work_pool: {name: espnet3, work_queue_name: default}
    parameters: {output_dir: exp/collect_stats}
"""


def _prefect(server: PrefectServer, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=cwd, env=server.env(), capture_output=True,
                          text=True, timeout=600)
    assert not check or done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory):
    """A server with the work pool, every deployment of deployments/prefect.yaml (deployed from a
    directory that is neither the checkout nor any worker's) and `collect-stats/temporary`."""
    base = tmp_path_factory.mktemp("deployments")
    deployer = base / "deployer"
    deployer.mkdir()
    (deployer / "prefect.yaml").write_text(NO_WORKDIR_STEP)
    # as `make serve` starts it: `--watch` prints the runs' log lines, the cause of a failure too
    streaming = {"PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true"}
    with PrefectServer(base / "home", log_dir=base / "logs", extra_env=streaming) as server:
        _prefect(server, "work-pool", "create", "espnet3", "--type", "process", cwd=deployer)
        _prefect(server, "deploy", "--all", "--prefect-file", str(ROOT / "deployments" / "prefect.yaml"), cwd=deployer)
        _prefect(server, "deploy", "--all", cwd=deployer)
        yield server


def _worker_environ(server: PrefectServer, **extra: str) -> dict[str, str]:
    """A worker's environment as a user's shell gives it, without PYTHONPATH (the installed
    package is all it needs), and with a PWD that is not its directory: a worker started by a
    program (systemd, a supervisor, Popen(cwd=...)) inherits a stale one, so the run must not
    trust it."""
    env = {k: v for k, v in server.env().items() if k not in ("PYTHONPATH", "ESPNET3_FLOWS_WORKDIR")}
    return env | {"HF_HUB_OFFLINE": "1", "PWD": str(ROOT), **extra}


def _manifest_at(directory: Path, source: str) -> None:
    """``data/train.tsv`` below ``directory``, as the README's example names it."""
    (directory / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(source, directory / "data" / "train.tsv")


def _run(server: PrefectServer, deployment: str, params: dict, cwd: Path) -> tuple[dict, str]:
    """`prefect deployment run DEPLOYMENT --watch --params JSON`, as the README writes it: the
    flow run (read back through the API) and what the command printed."""
    done = _prefect(server, "deployment", "run", deployment, "--watch", "--params", json.dumps(params),
                    cwd=cwd, check=False)
    text = done.stdout + done.stderr
    found = re.search(r"UUID: ([0-9a-f-]{36})", text)
    assert found, text[-3000:]
    return _api(server, f"flow_runs/{found.group(1)}"), text


def _api(server: PrefectServer, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.api_url}/{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _run_logs(server: PrefectServer, run: dict, expected: str) -> list[str]:
    """The run's log messages through the API, oldest first, once one holds ``expected`` (logs are
    written in batches) or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        logs = _api(server, "logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200,
                                            "sort": "TIMESTAMP_ASC"})
        messages = [r["message"] for r in logs]
        if any(expected in m for m in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1)


README_PARAMS = {"manifests": {"train": "data/train.tsv"}, "output_dir": "exp/collect_stats"}
FAST = {"parallel": {"env": "serial"}}  # the tests' choice: one process is enough here


def test_relative_paths_resolve_in_the_worker_start_directory(deployed, demo_corpus, tmp_path):
    start = (tmp_path / "start").resolve()
    _manifest_at(start, demo_corpus["valid"])
    (start / "data" / "broken.tsv").write_text(  # a missing file: the run stops on it (on_error: fail)
        (start / "data" / "train.tsv").read_text() + f"gone\t{start / 'gone.wav'}\n")
    with PrefectWorker("espnet3", _worker_environ(deployed), start, log_dir=tmp_path / "logs"):
        run, text = _run(deployed, "collect-stats/collect-stats", README_PARAMS | FAST, tmp_path)
        again, again_text = _run(deployed, "collect-stats/collect-stats", README_PARAMS | FAST, tmp_path)
        failed, failed_text = _run(deployed, "collect-stats/collect-stats",
                                   README_PARAMS | FAST | {"manifests": {"train": "data/broken.tsv"},
                                                           "output_dir": "exp/broken"}, tmp_path)
    assert run["state_type"] == "COMPLETED", text[-3000:]
    # after the run, where the README says: the worker's start directory, not a deleted one
    assert (start / "exp" / "collect_stats" / "train" / "feats_stats.npz").is_file()
    expected = f"working directory {start} (the directory the worker was started in)"
    assert any(expected in m for m in _run_logs(deployed, run, expected)), expected

    # the run's log is the job's log: through the API and in --watch, around few artifact events
    summary = "collect_stats train: 12 utterances"
    logs = _run_logs(deployed, run, summary)
    shown = " ".join(text.split())  # as --watch wrapped it to its terminal's width
    for line in ("collect_stats: 1 split(s), ", "0 done earlier (cached)", summary):
        assert any(line in m for m in logs), (line, logs)
        assert line in shown, (line, text[-3000:])
    assert len([line for line in text.splitlines() if "prefect.artifact." in line]) <= 6, text[-3000:]
    assert again["state_type"] == "COMPLETED", again_text[-3000:]
    done = "all done earlier (cached)"
    assert any(done in m for m in _run_logs(deployed, again, done)), done

    # a failure: the error line first, then Prefect's record of it, and a short log in all
    assert failed["state_type"] == "FAILED", failed_text[-3000:]
    logs = _run_logs(deployed, failed, "Finished in state Failed")
    errors = [i for i, m in enumerate(logs) if m.startswith("error: ")]
    assert errors and "gone.wav" in logs[errors[0]], logs
    assert errors[0] < min(i for i, m in enumerate(logs) if "Traceback" in m or "Finished in state" in m), logs
    assert sum(len(m.splitlines()) for m in logs) <= 20, "\n".join(logs)
    assert failed["state"]["message"] == logs[errors[0]], failed["state"]["message"]  # the final state says it too
    # (--watch wraps at its terminal's width, inside a long path too: compare without the wrapping)
    assert "error: " in failed_text and "gone.wav" in "".join(failed_text.split()), failed_text[-3000:]


def test_workdir_setting_wins_and_a_temporary_directory_is_refused(deployed, demo_corpus, tmp_path):
    start, workdir = (tmp_path / "start").resolve(), (tmp_path / "work").resolve()
    start.mkdir()
    _manifest_at(workdir, demo_corpus["valid"])
    env = _worker_environ(deployed, ESPNET3_FLOWS_WORKDIR=str(workdir))
    with PrefectWorker("espnet3", env, start, log_dir=tmp_path / "logs"):
        run, text = _run(deployed, "collect-stats/collect-stats", README_PARAMS | FAST, tmp_path)
        refused, refused_text = _run(deployed, "collect-stats/temporary", README_PARAMS | FAST, tmp_path)
        absolute = {"manifests": {"train": str(workdir / "data" / "train.tsv")}, "output_dir": str(tmp_path / "abs")}
        kept, kept_text = _run(deployed, "collect-stats/temporary", absolute | FAST, tmp_path)

    assert run["state_type"] == "COMPLETED", text[-3000:]
    assert (workdir / "exp" / "collect_stats" / "train" / "feats_stats.npz").is_file()
    assert not (start / "exp").exists()
    expected = f"working directory {workdir} ($ESPNET3_FLOWS_WORKDIR)"
    assert any(expected in m for m in _run_logs(deployed, run, expected)), expected

    # still in the worker's temporary directory: refused before anything is written, naming the fix
    assert refused["state_type"] == "FAILED", refused_text[-3000:]
    message = refused["state"]["message"]
    assert "output_dir=exp/collect_stats" in message and "temporary directory" in message, message
    assert "ESPNET3_FLOWS_WORKDIR" in message and "absolute paths" in message, message
    assert "temporary directory" in refused_text, refused_text[-3000:]  # --watch shows the cause
    # absolute paths need no working directory
    assert kept["state_type"] == "COMPLETED", kept_text[-3000:]
    assert (tmp_path / "abs" / "train" / "feats_stats.npz").is_file()
