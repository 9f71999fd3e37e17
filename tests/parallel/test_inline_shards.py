"""``parallel.options.inline_shards``: a ``local`` run with few shards to compute runs them in this process
instead of starting a cluster; more shards, ``inline_shards: 0`` or another backend start one."""

from __future__ import annotations

import os

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.parallel_config import ParallelConfig
from tests.parallel.jobs_for_tests import ArrayProvider, PidRunner

pytestmark = pytest.mark.dask


def _pids(tmp_path, name: str, n: int, **parallel) -> set[float]:
    runner = PidRunner(ArrayProvider({"n": n}), output_dir=str(tmp_path / name), shard_size=4)
    return runner.run(range(n), parallel=ParallelConfig(**parallel), progress=False).merged


def test_one_shard_runs_here_more_start_the_cluster(tmp_path):
    assert _pids(tmp_path, "one", 4, env="local", n_workers=1) == {float(os.getpid())}
    on_cluster = _pids(tmp_path, "four", 20, env="local", n_workers=1)  # 4 shards
    assert len(on_cluster) == 1 and float(os.getpid()) not in on_cluster
    assert float(os.getpid()) not in _pids(tmp_path, "off", 4, env="local", n_workers=1, options={"inline_shards": 0})
    assert _pids(tmp_path, "more", 20, env="local", n_workers=1, options={"inline_shards": 4}) == {float(os.getpid())}


def test_which_configs_run_here():
    assert ParallelConfig(env="serial").runs_here(0) and ParallelConfig(env="serial").runs_here(50)
    local = ParallelConfig(env="local")
    assert local.runs_here(1) and not local.runs_here(2) and not local.runs_here(0)  # nothing pending: no run
    assert not ParallelConfig(env="slurm").runs_here(1)  # a batch scheduler was asked for: its jobs run it
    assert not ParallelConfig(env="address", options={"address": "tcp://10.0.0.5:8786"}).runs_here(1)
    with pytest.raises(ConfigError, match="inline_shards must be >= 0"):
        ParallelConfig(env="local", options={"inline_shards": -1})
