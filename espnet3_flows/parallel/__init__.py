"""ESPnet3's Provider/Runner engine: environments, runners, shards, the scheduler, Dask clusters and
the parallel API.

ESPnet3's module names work here with ``espnet3`` replaced by ``espnet3_flows``:
``espnet3_flows.parallel.base_runner.BaseRunner``, ``espnet3_flows.parallel.env_provider.EnvironmentProvider``,
``espnet3_flows.parallel.parallel.get_client``, ``espnet3_flows.parallel.inference_provider.InferenceProvider``;
what differs on purpose is listed in ``docs/espnet3-conformance.md``.

The Dask plugins (``EnvSetupPlugin``, ``WorkerEnvPlugin``, ``plugin_for``) are imported on first
use: a run in this process never imports ``distributed``.
"""

from typing import Any

from espnet3_flows.errors import BadItemError, ItemError, ItemFailure, ShardFailure, UnguardedMainError
from espnet3_flows.parallel.base_runner import WHOLE_SHARD, BaseRunner, concatenate_shard_files
from espnet3_flows.parallel.cluster import cluster_spec, make_cluster
from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.parallel.env_provider import EnvironmentProvider, InferenceProvider, ProviderError
from espnet3_flows.parallel.parallel import (
    GpuClusterError,
    build_client,
    build_local_gpu_cluster,
    get_client,
    get_parallel_config,
    parallel_for,
    parallel_map,
    set_parallel,
    visible_gpu_count,
)
from espnet3_flows.parallel.results import RunOutcome, ShardResult, ShardStatus
from espnet3_flows.parallel.worker_env import get_env

__all__ = [
    "BadItemError", "BaseRunner", "DictReturnWorkerPlugin", "EnvSetupPlugin", "EnvironmentProvider", "GpuClusterError",
    "InferenceProvider", "ItemError", "ItemFailure", "ParallelConfig", "ProviderError", "RunOutcome", "ShardFailure",
    "ShardResult", "ShardStatus", "WHOLE_SHARD", "WorkerEnvPlugin", "build_client", "build_local_gpu_cluster",
    "cluster_spec", "concatenate_shard_files", "get_client", "get_env", "get_parallel_config", "make_cluster",
    "parallel_for", "parallel_map", "plugin_for", "set_parallel", "visible_gpu_count", "UnguardedMainError",
]


def __getattr__(name: str) -> Any:
    if name in ("EnvSetupPlugin", "WorkerEnvPlugin", "plugin_for"):
        from espnet3_flows.parallel import dask_plugins

        return getattr(dask_plugins, name)
    if name == "DictReturnWorkerPlugin":
        from espnet3_flows.parallel import dask_plugins

        return dask_plugins.WorkerEnvPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
