"""How a command-line run starts and ends (issue "Everyday runs start fast"): the private server
launched before the imports and shared by nothing, a single shard run in the driver, two runs at
once on one Prefect database, the driver killed while starting, the run's timeline."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.support.floats import assert_same_floats
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect, pytest.mark.dask, pytest.mark.slow]
SERVER = "prefect.server.api.server:create_app"


def _servers_of(home: Path) -> list[psutil.Process]:
    """Prefect API servers running with ``PREFECT_HOME=home``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if SERVER in " ".join(p.info["cmdline"] or []) and p.environ().get("PREFECT_HOME") == str(home):
                found.append(p)
    return found


def _wait_no_servers(home: Path, timeout: float = 15.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := _servers_of(home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _cli(home: Path, *args: str, timeline: Path | None = None, timeout: float = 300,
         api_url: str | None = None) -> subprocess.CompletedProcess:
    """``flows/collect_stats.py ARGS``: with no API configured (the run's private server), else
    against ``api_url``."""
    env = cli_env(home, HF_HUB_OFFLINE="1", api_url=api_url,
                  **({"ESPNET3_FLOWS_TIMELINE": str(timeline)} if timeline else {}))
    return subprocess.run([sys.executable, "flows/collect_stats.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def four_utterances(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from espnet3_flows.inputs.demo import make_demo_corpus

    root = tmp_path_factory.mktemp("four")
    return make_demo_corpus(root, n_utts=4, n_speakers=2, min_seconds=0.5, max_seconds=1.0,
                            splits={"train": 1.0})["train"]


def _events(path: Path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


def test_one_shard_runs_in_the_driver_with_the_same_outputs_as_on_a_cluster(tmp_path, four_utterances,
                                                                           session_api_url):
    home = tmp_path / "prefect-home"
    inline = _cli(home, f"manifests.train={four_utterances}", f"output_dir={tmp_path / 'inline'}", "--verbose",
                  timeline=tmp_path / "inline.jsonl")
    assert inline.returncode == 0, inline.stderr[-3000:]
    assert "Creating a new Dask cluster" not in inline.stderr  # one shard: no cluster started
    assert "Starting temporary server" not in inline.stderr  # the private server, not Prefect's own
    # the config read first, then the private server launched, before the plan and the imports
    assert _events(tmp_path / "inline.jsonl") == ["server_launched", "planned", "main", "server_ready", "flow_started",
                                                  "workers_ready", "first_shard", "shards_merged", "flow_returned",
                                                  "server_stopped", "summary_printed"]
    cluster = _cli(home, f"manifests.train={four_utterances}", f"output_dir={tmp_path / 'cluster'}", "--verbose",
                   "parallel.options.inline_shards=0", "parallel.n_workers=1", api_url=session_api_url)  # the reference
    assert cluster.returncode == 0, cluster.stderr[-3000:]
    assert "Creating a new Dask cluster" in cluster.stderr
    a, b = np.load(tmp_path / "inline/train/feats_stats.npz"), np.load(tmp_path / "cluster/train/feats_stats.npz")
    assert int(a["count"]) == int(b["count"]) > 0
    assert_same_floats(a["sum"], b["sum"])  # two processes: last bits may differ
    assert (tmp_path / "inline/train/feats_shape").read_text() == (tmp_path / "cluster/train/feats_shape").read_text()
    assert not _wait_no_servers(home), "the private server outlived its run"


def test_serial_uses_the_private_server_and_a_rerun_starts_none(tmp_path, four_utterances):
    home = tmp_path / "prefect-home"
    args = [f"manifests.train={four_utterances}", f"output_dir={tmp_path / 'out'}", "parallel.env=serial"]
    first = _cli(home, *args, "--verbose")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Starting temporary server" not in first.stderr and "train: 4 utterances" in first.stdout
    again = _cli(home, *args, timeline=tmp_path / "again.jsonl")  # nothing to compute: the early server is stopped
    assert again.returncode == 0 and "nothing to compute" in again.stdout, again.stderr[-3000:]
    assert "train: 4 utterances" in again.stdout and "cached 1" in again.stdout and not again.stderr
    # finished right after planning: main() (and Prefect, Dask, torch with it) never imported
    assert _events(tmp_path / "again.jsonl") == ["server_launched", "planned", "summary_printed"]
    bad = _cli(home, *args, "shard_sise=3")  # a config error: the early server is stopped too
    assert bad.returncode == 2 and "shard_sise" in bad.stderr
    assert not _wait_no_servers(home)


def test_two_runs_at_once_on_one_prefect_database_both_succeed(tmp_path, four_utterances):
    """Each run's private server writes the same SQLite database (one writer at a time), a new
    one: its migrations are the longest write."""
    home = tmp_path / "prefect-home"
    env = cli_env(home, fresh_database=True, HF_HUB_OFFLINE="1")
    procs = [subprocess.Popen([sys.executable, "flows/collect_stats.py", f"manifests.train={four_utterances}",
                               f"output_dir={tmp_path / f'out{k}'}", "shard_size=2", "parallel.n_workers=1"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "train: 4 utterances" in out and "cached 0" in out
        assert "database is locked" not in err
    a, b = (np.load(tmp_path / f"out{k}/train/feats_stats.npz") for k in range(2))
    assert_same_floats(a["sum"], b["sum"])  # two processes: last bits may differ
    assert not _wait_no_servers(home)


def test_driver_killed_while_starting_leaves_no_server(tmp_path, four_utterances):
    home = tmp_path / "prefect-home"
    proc = subprocess.Popen([sys.executable, "flows/collect_stats.py", f"manifests.train={four_utterances}",
                             f"output_dir={tmp_path / 'out'}"], cwd=ROOT, env=cli_env(home, HF_HUB_OFFLINE="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _servers_of(home) and time.monotonic() < deadline:  # launched before the CLI's imports
            assert proc.poll() is None
            time.sleep(0.05)
        assert _servers_of(home), "no early server seen"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not _wait_no_servers(home), "the early server outlived the killed driver"
    finally:
        with contextlib.suppress(psutil.Error):
            proc.kill()
        for p in _servers_of(home):
            with contextlib.suppress(psutil.Error):
                p.kill()



def _group_alive(pgid: int) -> list[int]:
    alive = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if p.status() != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                alive.append(p.pid)
    return alive


def test_ctrl_c_ends_the_run_in_one_line_with_status_130_and_no_process_left(tmp_path, four_utterances):
    """Ctrl-C at a terminal: SIGINT to the command line's whole process group (driver, forkserver,
    workers) while shards are computed. Before: 40-137 lines of KeyboardInterrupt tracebacks (the
    driver's and each worker's), exit by signal after ~6 s."""
    home, out = tmp_path / "prefect-home", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "flows/collect_stats.py", f"manifests.train={four_utterances}",
                             f"output_dir={out}", "shard_size=1", "parallel.n_workers=1", "frontend.type=model",
                             "frontend.model._target_=tests.orchestration.slow_model.SlowFramer",
                             "frontend.model.delay=2"], cwd=ROOT, env=cli_env(home, HF_HUB_OFFLINE="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("train/shards/split.*/done")):  # work started: one shard is done
            assert proc.poll() is None and time.monotonic() < deadline, "no shard finished"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _group_alive(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in _servers_of(home):
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("interrupted:")]
    assert len(lines) == 1 and "collect_stats" in lines[0] and str(out) in lines[0] and "rerun" in lines[0], stderr
    assert len(stderr.splitlines()) < 15, stderr
    assert not left, f"processes of the interrupted run left: {left}"
    assert not _wait_no_servers(home), "the private server outlived the interrupted run"
    assert list(out.glob("train/shards/split.*/done"))  # finished shards are kept for the rerun


def test_dry_run_says_when_the_shards_run_in_the_driver(tmp_path, four_utterances):
    home = tmp_path / "prefect-home"
    args = [f"manifests.train={four_utterances}", f"output_dir={tmp_path / 'out'}", "--dry-run"]
    one = _cli(home, *args)
    assert one.returncode == 0
    assert "shard(s) to compute run in this process, parallel.options.inline_shards=1" in one.stdout
    four = _cli(home, *args, "shard_size=2")  # 4 shards: a cluster
    assert four.returncode == 0 and "run in this process" not in four.stdout, four.stdout
    assert not _servers_of(home)  # a dry run starts no server, not even early


def test_every_instant_of_a_run_names_what_ctrl_c_interrupted():
    """The one ``interrupted:`` line says what the run was doing by the last timeline event it
    reached: every event the driver marks has its phase there (the forkserver's is another process's)."""
    import re

    from espnet3_flows.orchestration.interrupt import _PHASES

    root = Path(__file__).resolve().parents[2] / "espnet3_flows"
    marked = {name for path in root.rglob("*.py")
              for name in re.findall(r"\bmark\(\"([a-z_]+)\"\)", path.read_text(encoding="utf-8"))}
    assert "server_launched" in marked and "planned" in marked
    assert marked - {"forkserver_ready"} <= set(_PHASES), marked - set(_PHASES)
