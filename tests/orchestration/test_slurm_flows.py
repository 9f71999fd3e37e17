"""The flows with ``parallel.env: slurm`` on a real single-node SLURM cluster (ci/slurm/start.sh)."""

from __future__ import annotations

import numpy as np
import pytest

from espnet3_flows.orchestration.flows import run_job
from tests.support.servers import slurm_available

pytestmark = [pytest.mark.slurm, pytest.mark.prefect, pytest.mark.slow]

SLURM = {"env": "slurm", "n_workers": 2,
         "options": {"queue": "debug", "cores": 1, "memory": "2GB", "walltime": "00:20:00"}}


@pytest.fixture(autouse=True)
def _needs_slurm():
    assert slurm_available(), "SLURM is not running: start it with `eval \"$(ci/slurm/start.sh)\"`"


def test_collect_stats_on_slurm_matches_serial(prefect_harness, demo_corpus, tmp_path):
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "shard_size": 4}
    on_slurm = run_job("collect_stats", cfg | {"output_dir": str(tmp_path / "slurm"), "parallel": SLURM},
                       progress=False)["valid"]
    assert on_slurm["shards_computed"] == 3
    run_job("collect_stats", cfg | {"output_dir": str(tmp_path / "serial"), "parallel": {"env": "serial"}},
            progress=False)
    a = np.load(tmp_path / "slurm/valid/feats_stats.npz")
    b = np.load(tmp_path / "serial/valid/feats_stats.npz")
    assert int(a["count"]) == int(b["count"])
    np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)
