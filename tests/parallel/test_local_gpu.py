"""``parallel.env=local_gpu``: one Dask worker per visible GPU (dask-cuda's LocalCUDACluster).

The tests marked ``gpu`` run with ``--run-gpu`` on a machine with a CUDA GPU and the ``[gpu]``
extra (``make install EXTRAS=dev,gpu CONSTRAINTS=constraints-gpu.txt``). Asked to run where
either is missing they fail, naming what is missing; without the option they are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import gpu_missing
from tests.support.floats import assert_same_floats

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.dask
def test_each_worker_gets_its_own_gpu():
    import torch
    from distributed import Client

    from espnet3_flows.parallel.cluster import make_cluster
    from espnet3_flows.parallel.parallel_config import ParallelConfig

    n = torch.cuda.device_count()
    with make_cluster(ParallelConfig(env="local_gpu")) as cluster, Client(cluster) as client:
        client.wait_for_workers(n, timeout=120)
        visible = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        devices = client.run(lambda: __import__("torch").cuda.current_device())
    assert len(visible) == n
    assert sorted(v.split(",")[0] for v in visible.values()) == sorted(str(i) for i in range(n)), visible
    assert set(devices.values()) == {0}, "each worker sees its own GPU as device 0"


@pytest.mark.gpu
@pytest.mark.dask
@pytest.mark.prefect
def test_collect_stats_flow_on_local_gpu_equals_a_cpu_cluster(prefect_harness, demo_corpus, tmp_path):
    from espnet3_flows.orchestration.flows import run_job

    def run(env: dict, out: Path) -> dict:
        cfg = {"manifests": {"train": demo_corpus["train"]}, "output_dir": str(out), "shard_size": 8,
               "parallel": env}
        return run_job("collect_stats", cfg, progress=False)["train"]

    gpu = run({"env": "local_gpu"}, tmp_path / "gpu")
    cpu = run({"env": "local", "n_workers": 1}, tmp_path / "cpu")
    assert gpu["shards_computed"] == gpu["shards"] == cpu["shards"]
    with np.load(tmp_path / "gpu" / "train" / "feats_stats.npz") as a, \
            np.load(tmp_path / "cpu" / "train" / "feats_stats.npz") as b:
        for key in b.files:
            assert_same_floats(a[key], b[key])  # other processes (and devices): last bits may differ


def test_run_gpu_fails_rather_than_skips_without_a_gpu(tmp_path):
    """The option's contract on whatever machine this runs: no GPU → every GPU test FAILS with
    the reason; a GPU → they pass."""
    from tests.support.servers import cli_env

    env = cli_env(tmp_path / "home")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--run-gpu", "-m", "gpu",
                           "-rA", str(Path(__file__))], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    missing = gpu_missing()
    if missing:
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert "2 errors" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]  # fail in setup
        assert f"--run-gpu was given but {missing}" in proc.stdout, proc.stdout[-3000:]
    else:
        assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:]
