"""ESPnet3's Provider/Runner engine: environments, runners, shards, the scheduler, Dask clusters and
the parallel API.

ESPnet3's module names work here with ``espnet3`` replaced by ``espnet3_flows``:
``espnet3_flows.parallel.base_runner.BaseRunner``, ``espnet3_flows.parallel.env_provider.EnvironmentProvider``,
``espnet3_flows.parallel.parallel.get_client``, ``espnet3_flows.parallel.inference_provider.InferenceProvider``;
what differs on purpose is listed in ``docs/espnet3-conformance.md``.

Every name below is imported on first use (importing a submodule imports no other): a run in this
process never imports ``distributed`` for the Dask plugins (``EnvSetupPlugin``, ``WorkerEnvPlugin``,
``plugin_for``), and a command line reads its config without fsspec or numpy.
"""

from __future__ import annotations

from typing import Any

from espnet3_flows.lazy_exports import lazy_getattr

#: The public names, imported on first use (importing a submodule, or reading a job's config,
#: imports no fsspec, numpy or Dask): name -> its module
_EXPORTS = {
    **dict.fromkeys(("BadItemError", "ItemError", "ItemFailure", "ShardFailure", "UnguardedMainError"),
                    "espnet3_flows.errors"),
    **dict.fromkeys(("WHOLE_SHARD", "BaseRunner", "concatenate_shard_files"), "espnet3_flows.parallel.base_runner"),
    **dict.fromkeys(("cluster_spec", "make_cluster"), "espnet3_flows.parallel.cluster"),
    "ParallelConfig": "espnet3_flows.parallel.parallel_config",
    **dict.fromkeys(("EnvironmentProvider", "InferenceProvider", "ProviderError"),
                    "espnet3_flows.parallel.env_provider"),
    **dict.fromkeys(("GpuClusterError", "build_client", "build_local_gpu_cluster", "get_client", "get_parallel_config",
                     "parallel_for", "parallel_map", "set_parallel", "visible_gpu_count"),
                    "espnet3_flows.parallel.parallel"),
    **dict.fromkeys(("RunOutcome", "ShardResult", "ShardStatus"), "espnet3_flows.parallel.results"),
    # get_env: worker_resources' earlier name, kept for code that imports it
    **dict.fromkeys(("get_env", "worker_resources"), "espnet3_flows.parallel.worker_registry"),
    **dict.fromkeys(("EnvSetupPlugin", "WorkerEnvPlugin", "plugin_for"), "espnet3_flows.parallel.dask_plugins"),
}

__all__ = sorted([*_EXPORTS, "DictReturnWorkerPlugin"])

_lazy = lazy_getattr(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "DictReturnWorkerPlugin":  # ESPnet3's older name
        from espnet3_flows.parallel import dask_plugins

        return dask_plugins.WorkerEnvPlugin
    return _lazy(name)
