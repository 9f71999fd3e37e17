"""Every worker busy on a small split: a split too small for ``2 × workers × shard_size`` is cut
into 2 to 4 shards per worker, while a large split's shards do not depend on the cluster's size
(scaling a cluster up or down recomputes nothing there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from espnet3_flows.config import load_config
from espnet3_flows.orchestration.job_run import plan_job
from espnet3_flows.parallel.backends import worker_slots
from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.sharding import MIN_BUSY_SHARD, split_shard_size
from espnet3_flows.stats import CollectStatsConfig
from tests.parallel.espnet3_runners import ListProvider, RecordsRunner
from tests.parallel.jobs_for_tests import ArrayProvider, SlowPidRunner


@pytest.mark.parametrize("workers", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("n", [1, 7, 100, 999, 5000, 20_000])
def test_a_small_split_gives_every_worker_two_to_four_shards(n, workers):
    size = split_shard_size(1000, n, workers)
    if n >= 2 * workers * 1000:
        assert size == 1000
    elif n >= 2 * workers * 2 * MIN_BUSY_SHARD:
        assert 2 * workers <= n / size < 4 * workers  # the mean number of shards
        assert size & (size - 1) == 0  # a power of two: a split that grows a little keeps its cut
    else:  # a mean of twice the fewest items: no shard but the last has fewer than MIN_BUSY_SHARD
        assert size == 2 * MIN_BUSY_SHARD


def test_a_smoke_test_of_a_few_items_stays_one_shard():
    assert split_shard_size(1000, 4, 8) == 2 * MIN_BUSY_SHARD == 8  # content-defined: 4 to 16 items a shard


def test_a_run_in_this_process_keeps_its_shard_size():
    assert split_shard_size(256, 10, 1) == split_shard_size(256, 10, 0) == 256


def test_a_large_split_is_cut_the_same_on_any_cluster():
    runner = RecordsRunner(ListProvider({"n": 0}), shard_size=16)
    items = range(2 * 8 * 16)  # large for up to 8 workers
    plans = {w: [s.hash for s in runner.plan(items, workers=w).shards] for w in (1, 2, 4, 8)}
    assert plans[1] == plans[2] == plans[4] == plans[8]
    small = runner.plan(range(100), workers=8)
    assert len(small.shards) >= 8 and small.shard_size < 16


def test_a_small_split_that_grows_a_little_keeps_its_shards():
    runner = RecordsRunner(ListProvider({"n": 0}), shard_size=1000)
    before = {s.hash for s in runner.plan(range(5000), workers=8).shards}
    after = [s.hash for s in runner.plan(range(5010), workers=8).shards]
    assert len(before & set(after)) >= len(after) - 2  # only the last shard (or two) changed


@pytest.mark.parametrize("parallel,slots", [
    ({"env": "serial"}, 1),
    ({"env": "local", "n_workers": 4}, 4),
    ({"env": "local", "n_workers": 2, "threads_per_worker": 3}, 6),
    ({"env": "local"}, os.cpu_count()),
    ({"env": "slurm", "n_workers": 8, "options": {"cores": 1, "memory": "2GB"}}, 8),
    ({"env": "slurm", "n_workers": 2, "options": {"cores": 4, "processes": 2, "memory": "2GB"}}, 4),
    ({"env": "slurm", "adapt": {"minimum": 1, "maximum": 12}, "options": {"cores": 1, "memory": "2GB"}}, 12),
    ({"env": "address", "options": {"address": "tcp://127.0.0.1:8786"}}, 1),
])
def test_worker_slots_read_from_the_config(parallel, slots):
    assert worker_slots(ParallelConfig(**parallel)) == slots


def test_local_gpu_counts_the_visible_gpus(monkeypatch):
    # this machine has no GPU: its count is what torch would say on an 8-GPU node
    monkeypatch.setattr("espnet3_flows.parallel.backends.local_gpu.visible_gpu_count", lambda: 8)
    assert worker_slots(_unchecked(env="local_gpu")) == 8
    assert worker_slots(_unchecked(env="local_gpu", n_workers=2)) == 2


def _unchecked(**kwargs) -> ParallelConfig:
    """A ``local_gpu`` config without its install check (dask-cuda is not installed here)."""
    cfg = object.__new__(ParallelConfig)
    for name, field in ParallelConfig.__dataclass_fields__.items():
        default = field.default_factory() if callable(field.default_factory) else field.default  # type: ignore[misc]
        object.__setattr__(cfg, name, kwargs.get(name, default))
    return cfg


def test_a_job_plans_a_small_split_for_every_worker(demo_corpus, tmp_path):
    def shards(*overrides: str) -> int:
        cfg = load_config(CollectStatsConfig, overrides=[f"manifests.train={demo_corpus['train']}",
                                                          f"output_dir={tmp_path / 'out'}", *overrides])
        return len(plan_job("collect_stats", cfg, publish=False).runners[0].plan.shards)

    assert shards("parallel.env=serial") == 1  # 48 utterances, shard_size 1000
    assert shards("parallel.env=local", "parallel.n_workers=4") >= 4  # 2 x 4 would be shards of 6: fewer, of >= 4
    serial = shards("parallel.env=serial", "shard_size=4")  # 48 >= 2 x 4 workers x 4: large, cut as anywhere
    assert shards("parallel.env=local", "parallel.n_workers=2", "shard_size=4") == serial
    assert shards("parallel.env=local", "parallel.n_workers=4", "shard_size=4") == serial


def test_thirty_items_on_two_workers_are_two_to_four_shards_each_of_four_items_or_more(demo_corpus, tmp_path):
    manifest = tmp_path / "thirty.tsv"
    manifest.write_text("".join(Path(demo_corpus["train"]).read_text().splitlines(keepends=True)[:30]))
    cfg = load_config(CollectStatsConfig, overrides=[f"manifests.train={manifest}", f"output_dir={tmp_path / 'out'}",
                                                      "parallel.env=local", "parallel.n_workers=2"])
    plan = plan_job("collect_stats", cfg, publish=False).runners[0].plan
    sizes = [s.stop - s.start for s in plan.shards]
    assert sum(sizes) == 30 and 2 * 2 <= len(sizes) <= 4 * 2, sizes
    assert min(sizes[:-1]) >= MIN_BUSY_SHARD, sizes


@pytest.mark.dask
def test_a_hundred_slow_items_run_on_every_worker(tmp_path):
    """The issue's case: 100 items on 4 local workers used to be one shard on one worker."""
    out = SlowPidRunner(ArrayProvider({"n": 100}), output_dir=str(tmp_path)).run(
        range(100), parallel={"env": "local", "n_workers": 4}, progress=False)
    assert len(out.merged) == 4, f"every worker computed shards: {len(out.merged)} did"
    assert len(out.plan.shards) >= 8


@pytest.mark.dask
def test_local_gpu_starts_a_worker_per_gpu_and_every_one_computes_shards(monkeypatch, tmp_path):
    """Issue 62, part 5, on the CPU: with three GPUs counted (a fake count) and ``parallel.env:
    local_gpu`` (dask-cuda's cluster stood in for by a ``LocalCluster`` that, as dask-cuda does,
    starts a worker per GPU), a small split is cut for three workers and every one of them computes
    shards. (On a GPU, each worker's own device: ``tests/parallel/test_local_gpu.py``.)"""
    import importlib.machinery
    import sys
    import types

    from distributed import LocalCluster

    gpus = 3

    def local_cuda_cluster(n_workers=None, **kwargs):
        return LocalCluster(n_workers=n_workers or gpus, **kwargs)

    module = types.ModuleType("dask_cuda")
    module.__spec__ = importlib.machinery.ModuleSpec("dask_cuda", None)
    module.LocalCUDACluster = local_cuda_cluster
    monkeypatch.setitem(sys.modules, "dask_cuda", module)
    monkeypatch.setattr("espnet3_flows.parallel.backends.local_gpu.visible_gpu_count", lambda: gpus)
    out = SlowPidRunner(ArrayProvider({"n": 60}), output_dir=str(tmp_path)).run(
        range(60), parallel={"env": "local_gpu"}, progress=False)
    assert len(out.plan.shards) >= 2 * gpus
    assert len(out.merged) == gpus, f"every GPU's worker computed shards: {len(out.merged)} did"
