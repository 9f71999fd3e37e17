"""ESPnet3's Provider/Runner engine: environments, runners, shards, the scheduler, Dask clusters and
the parallel API.

ESPnet3's module names work here with ``espnet3`` replaced by ``espnet3_flows``:
``espnet3_flows.parallel.base_runner.BaseRunner``, ``espnet3_flows.parallel.env_provider.EnvironmentProvider``,
``espnet3_flows.parallel.parallel.get_client``.

The Dask plugins (``EnvSetupPlugin``, ``WorkerEnvPlugin``, ``plugin_for``) are imported on first
use: a run in this process never imports ``distributed``.
"""

from typing import Any

from espnet3_flows.errors import BadItemError, ItemError, ItemFailure, ShardFailure
from espnet3_flows.parallel.base_runner import WHOLE_SHARD, BaseRunner, concatenate_shard_files
from espnet3_flows.parallel.cluster import ParallelConfig, cluster_spec, make_cluster
from espnet3_flows.parallel.env_provider import EnvironmentProvider, ProviderError
from espnet3_flows.parallel.parallel import (
    build_client,
    get_client,
    get_parallel_config,
    parallel_for,
    parallel_map,
    set_parallel,
)
from espnet3_flows.parallel.results import RunOutcome, ShardResult, ShardStatus
from espnet3_flows.parallel.worker_env import get_env

__all__ = [
    "BadItemError", "BaseRunner", "EnvSetupPlugin", "EnvironmentProvider", "ItemError", "ItemFailure", "ParallelConfig",
    "ProviderError", "RunOutcome", "ShardFailure", "ShardResult", "ShardStatus", "WHOLE_SHARD", "WorkerEnvPlugin",
    "build_client", "cluster_spec", "concatenate_shard_files", "get_client", "get_env", "get_parallel_config",
    "make_cluster", "parallel_for", "parallel_map", "plugin_for", "set_parallel",
]


def __getattr__(name: str) -> Any:
    if name in ("EnvSetupPlugin", "WorkerEnvPlugin", "plugin_for"):
        from espnet3_flows.parallel import dask_plugins

        return getattr(dask_plugins, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
