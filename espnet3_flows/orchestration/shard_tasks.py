"""Prefect tasks around the engine's shard lifecycle: a shard (named by its runner's key and its
content hash) and a runner's merge. Both call the engine's functions; nothing here reimplements them."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from espnet3_flows.errors import ItemError
from espnet3_flows.orchestration.console import SHARD_TASK
from espnet3_flows.parallel.merge_step import merge_runner
from espnet3_flows.parallel.results import ShardStatus
from espnet3_flows.parallel.scheduler import execute_shard
from espnet3_flows.sharding import Shard


@task(name=SHARD_TASK, cache_policy=NO_CACHE, persist_result=False, task_run_name="{label}/{shard.name}")
def shard_task(runner_key: str, label: str, shard: Shard, local: bool = False, run_id: str = "") -> dict[str, Any]:
    """Compute one shard where the task runs: ``init_state`` → ``forward`` / ``reduce_state``* →
    ``finalize_state`` → publish → ``done`` (:func:`~espnet3_flows.parallel.scheduler.execute_shard`).

    The parameters identify the work and never carry it: the runner was installed on the worker
    once (:func:`~espnet3_flows.parallel.dask_plugins.install_runners`) and the shard names its own
    items (for a manifest, its byte range). The shard's cache is its ``done`` record, keyed by the
    shard hash: finished shards are resolved on the driver and never submitted, and a matching
    record found here (a run killed after publishing) is reused. Nothing is persisted by Prefect:
    the record is the result.

    Returns:
        ``{"index", "num_items", "seconds", "reused"}``.
    """
    return execute_shard(runner_key, shard, local, run_id)


@task(name="merge", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, persist_result=False,
      task_run_name="{label}/merge")
def merge_task(runner: Any, label: str, shards: list[tuple[int, str, int, bool, float]]) -> Any:
    """The runner's ``merge`` over its completed shard directories, in plan order
    (:func:`~espnet3_flows.parallel.merge_step.merge_runner`).

    Args:
        shards: Every shard of the plan as :meth:`ShardStatus.to_tuple` (small: the ``done``
            records are read here).
    """
    return merge_runner(runner, [ShardStatus.from_tuple(s) for s in shards])


def retry_unless_bad_item(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn`` of shard tasks: a bad item (``ItemError`` under
    ``on_error: fail``: a missing or corrupt file, a manifest line) fails the same way on every
    try, so the run fails at once; storage and network errors, and everything else, are retried."""
    return not isinstance(getattr(state, "data", None), ItemError)
