"""A Prefect API server killed in the middle of a command-line run: the run ends with one ``error:``
line naming the API and what to do (not a bare ``ConnectError``), keeps its finished shards, and
the rerun against a server started again computes only the rest."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from espnet3_flows.config import load_config
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from tests.support.servers import PrefectServer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect]


def _cli(server: PrefectServer, manifest: str, out: Path) -> subprocess.Popen:
    # no client retries: the default five take minutes against a server that is gone, and what
    # is tested is the line the run ends with, whenever the client gives up
    env = {**server.env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PREFECT_CLIENT_MAX_RETRIES": "0"}
    return subprocess.Popen([sys.executable, "flows/collect_stats.py", f"manifests.train={manifest}",
                             f"output_dir={out}", "shard_size=1", "parallel.env=serial"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.unpatched
def test_a_killed_api_server_ends_the_run_in_one_line_and_the_rerun_resumes(demo_corpus, tmp_path):
    out = tmp_path / "exp"
    server = PrefectServer(tmp_path / "home")
    server.start()
    try:
        run = _cli(server, demo_corpus["train"], out)
        deadline = time.monotonic() + 240
        while not list((out / "train" / "shards").glob("split.*/done")) and run.poll() is None:
            assert time.monotonic() < deadline, "no shard finished"
            time.sleep(0.05)
        server.process.stop(((signal.SIGKILL, 10.0),))  # the whole process group, at once
        # bounded: Prefect would drain every queued event into the dead server, ~7 s each, at exit
        # (with every patch off its drain was seen to wait forever: the exit ends it after 20 s)
        try:
            stdout, stderr = run.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            run.kill()  # not left behind by this test
            run.communicate()
            raise
    finally:
        server.stop()
    assert run.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith(f"error: the Prefect API at {server.api_url} stopped answering"), errors
    assert "finished shards are kept" in errors[0] and "rerun" in errors[0], errors
    kept = len(list((out / "train" / "shards").glob("split.*/done")))
    assert kept >= 1

    again = PrefectServer(tmp_path / "home", port=server.port)
    again.start()
    try:
        rerun = _cli(again, demo_corpus["train"], out)
        stdout, stderr = rerun.communicate(timeout=300)
    finally:
        again.stop()
    assert rerun.returncode == 0, stderr[-3000:]
    # the killed run's shards are reused ("N done earlier"; "all N shard(s) ... were done earlier"
    # when it had also merged before the lost API ended it)
    reused = re.search(r"(?:all )?(\d+)(?: shard\(s\) of \d+ split\(s\) were)? done earlier", stdout + stderr)
    assert reused and int(reused.group(1)) >= kept, stdout + stderr
    clean = tmp_path / "clean"  # the engine alone, here
    CollectStatsRunner(load_config(CollectStatsConfig, overrides=[
        f"manifests.train={demo_corpus['train']}", f"output_dir={clean}", "shard_size=1", "parallel.env=serial"]),
        "train").run(progress=False)
    with np.load(out / "train" / "feats_stats.npz") as a, np.load(clean / "train" / "feats_stats.npz") as b:
        assert int(a["count"]) == int(b["count"])
        np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)
    assert (out / "train" / "feats_shape").read_bytes() == (clean / "train" / "feats_shape").read_bytes()
