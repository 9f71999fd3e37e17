"""The flows with ``parallel.env: slurm`` on a real single-node SLURM cluster (ci/slurm/start.sh)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from espnet3_flows.orchestration.flows import run_job
from tests.support.servers import ROOT, cli_env, slurm_available

pytestmark = [pytest.mark.slurm, pytest.mark.prefect, pytest.mark.slow]

SLURM = {"env": "slurm", "n_workers": 2,
         "options": {"queue": "debug", "cores": 1, "memory": "2GB", "walltime": "00:20:00",
                     "log_directory": "/tmp/espnet3-flows-slurm/job-logs"}}


@pytest.fixture(autouse=True)
def _needs_slurm():
    assert slurm_available(), "SLURM is not running: start it with `eval \"$(ci/slurm/start.sh)\"`"


def test_collect_stats_on_slurm_matches_serial(prefect_harness, demo_corpus, tmp_path):
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "shard_size": 4}
    on_slurm = run_job("collect_stats", cfg | {"output_dir": str(tmp_path / "slurm"), "parallel": SLURM},
                       progress=False)["valid"]
    assert on_slurm["shards_computed"] == on_slurm["shards"] > 1
    run_job("collect_stats", cfg | {"output_dir": str(tmp_path / "serial"), "parallel": {"env": "serial"}},
            progress=False)
    a = np.load(tmp_path / "slurm/valid/feats_stats.npz")
    b = np.load(tmp_path / "serial/valid/feats_stats.npz")
    assert int(a["count"]) == int(b["count"])
    np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)


def test_extract_xvectors_on_slurm(prefect_harness, demo_corpus, tmp_path):
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    model = build_random_ecapa_dir(tmp_path / "ecapa")
    cfg = {"xvector": {"pretrained_model": str(model), "manifest_paths": {"valid": demo_corpus["valid"]},
                       "save_path": str(tmp_path / "xv"), "batch_size": 4},
           "shard_size": 6, "parallel": SLURM}
    summary = run_job("extract_xvectors", cfg, progress=False)["valid"]
    assert summary["utterances"] == 12 and summary["shards_computed"] == summary["shards"] and summary["embedding_dim"] == 192
    assert (tmp_path / "xv/xvector/valid/xvector.scp").is_file()


def test_a_site_jobqueue_yaml_sizes_the_submitted_jobs_and_a_user_option_wins(demo_corpus, tmp_path, session_api_url):
    """The command line on real SLURM with a site's ``jobqueue.yaml`` (``DASK_CONFIG``) and no
    ``parallel.options`` but one: the jobs SLURM ran carry the site's partition, size (not our
    1-core, 2 GB fallbacks), job name, directive and log directory, and the user's walltime
    instead of the site's."""
    site, logs = tmp_path / "site-dask", tmp_path / "site-logs"
    site.mkdir()
    (site / "jobqueue.yaml").write_text(
        "jobqueue:\n  slurm:\n    queue: debug\n    cores: 2\n    memory: 3GB\n    walltime: '00:10:00'\n"
        f"    name: espnet3-site\n    log-directory: {logs}\n"
        "    job-extra-directives: ['--comment=from-site-jobqueue-yaml']\n")
    env = cli_env(tmp_path / "prefect-home", api_url=session_api_url) | {"DASK_CONFIG": str(site)}
    args = [sys.executable, "flows/collect_stats.py", f"manifests.valid={demo_corpus['valid']}",
            f"output_dir={tmp_path / 'out'}", "shard_size=4", "parallel.env=slurm", "parallel.n_workers=1",
            "parallel.options.walltime=00:19:00"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "out/valid/feats_stats.npz").is_file()
    jobs = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True).stdout.splitlines()
    ours = [j for j in jobs if "JobName=espnet3-site " in j and str(logs) in j]  # MinJobAge keeps them 60 s
    assert ours, jobs
    for job in ours:
        assert re.search(r"\bPartition=debug\b", job) and "Comment=from-site-jobqueue-yaml" in job, job
        assert "NumCPUs=2 " in job and "MinMemoryNode=3G" in job, job  # the site's 2 cores, 3 GB: not ours
        assert "TimeLimit=00:19:00" in job, job  # parallel.options wins over the site's 00:10:00
    assert any(p.name.startswith("espnet3-site-") for p in logs.iterdir())  # the site's log directory
