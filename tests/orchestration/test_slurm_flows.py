"""The flows with ``parallel.env: slurm`` on a real single-node SLURM cluster (ci/slurm/start.sh)."""

from __future__ import annotations

import numpy as np
import pytest

from espnet3_flows.orchestration.flows import run_job
from tests.support.servers import slurm_available

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
