"""Prefect tasks: a shard (named by its runner's key and its content hash) and merge-and-publish."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from espnet3_flows.parallel.runner import BaseRunner, ItemError, ShardFailure
from espnet3_flows.parallel.worker_env import get_env, get_runner
from espnet3_flows.sharding import Shard, shard_name


@task(name="shard", cache_policy=NO_CACHE, persist_result=False, task_run_name="{split}/{shard.name}")
def shard_task(runner_key: str, split: str, shard: Shard) -> dict[str, Any]:
    """Compute one shard on a worker: ``init_state`` → ``reduce_state``* → ``finalize_state`` →
    publish → ``done``.

    The parameters identify the work and never carry it: the split's runner was installed on
    the worker once (:func:`~espnet3_flows.parallel.worker_env.install_runners`) and the shard
    names its own byte range of the manifest. The shard's cache is its ``done`` record, keyed
    by the shard hash: finished shards are resolved on the driver and never submitted, and a
    matching record found here (a run killed after publishing) is reused. Nothing is persisted
    by Prefect: the record is the result.

    Returns:
        ``{"index", "num_items", "seconds", "reused"}``.
    """
    runner = get_runner(runner_key)
    found = runner.load_done(shard)
    if found is not None:
        return {"index": shard.index, "num_items": shard.num_items, "seconds": found.seconds, "reused": True}
    res = runner.run_shard(shard, get_env(runner.provider))
    return {"index": shard.index, "num_items": shard.num_items, "seconds": res.seconds, "reused": False}


@task(name="merge-and-publish", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, persist_result=False)
def merge_task(runner: BaseRunner, shards: list[tuple[int, str, bool]]) -> Any:
    """Read a split's shard results and run the runner's ``publish`` step (merge, final files).

    Args:
        shards: ``(index, hash, cached)`` of every shard of the plan. The small ``done`` records
            are read here (16 at a time); per-utterance rows are streamed from shard files by
            the job's ``publish``.
    """
    def read(entry: tuple[int, str, bool]) -> Any:
        index, shard_hash, cached = entry
        found = runner.read_done(shard_hash, cached)
        if found is None:
            raise ShardFailure(f"{runner.shard_subdir}/{shard_name(shard_hash)} (shard {index} of the plan): no done "
                               "record (removed while the run was merging?); rerun to recompute it")
        return found

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(read, shards))
    return runner.publish(results)


def retry_unless_bad_item(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn`` of shard tasks: a bad item (``ItemError`` under
    ``on_error: fail``: a missing or corrupt file, a manifest line) fails the same way on every
    try, so the run fails at once; storage and network errors, and everything else, are retried."""
    return not isinstance(getattr(state, "data", None), ItemError)
