"""ESPnet3's Provider/Runner engine: environments, runners, shards and Dask clusters."""

from espnet3_flows.parallel.cluster import (
    ParallelConfig,
    cluster_spec,
    get_client,
    get_parallel_config,
    make_cluster,
    parallel_map,
    set_parallel,
)
from espnet3_flows.parallel.provider import EnvironmentProvider, ProviderError
from espnet3_flows.errors import BadItemError
from espnet3_flows.parallel.runner import BaseRunner, ItemError, RunOutcome, ShardFailure, ShardResult
from espnet3_flows.parallel.sink import ShardSink
from espnet3_flows.parallel.worker_env import EnvSetupPlugin, get_env, plugin_for

__all__ = [
    "BadItemError", "BaseRunner", "EnvSetupPlugin", "EnvironmentProvider", "ItemError", "ParallelConfig", "ProviderError",
    "RunOutcome", "ShardFailure", "ShardResult", "ShardSink", "cluster_spec", "get_client", "get_env",
    "get_parallel_config", "make_cluster", "parallel_map", "plugin_for", "set_parallel",
]
