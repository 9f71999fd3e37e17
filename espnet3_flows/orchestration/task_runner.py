"""Prefect task runners from the ``parallel:`` config: one Dask cluster for every split of a run."""

from __future__ import annotations

import importlib
from typing import Any
from collections.abc import Sequence

from espnet3_flows.parallel.cluster import cluster_spec, make_cluster
from espnet3_flows.parallel.parallel_config import ParallelConfig, scheduler_address
from espnet3_flows.parallel.forkserver import start_forkserver

#: Imported by every worker before its first shard task: the task engine is most of Prefect's import.
PREFECT_WORKER_MODULES = ("prefect.task_engine",)


def make_task_runner(cfg: ParallelConfig) -> Any:
    """The flow's task runner: a one-thread runner in this process for a backend that runs in
    process (``serial``); a ``DaskTaskRunner`` connected to the running scheduler of ``env:
    address`` (a ``scheduler_file`` is read now; the runner closes only its client, the cluster
    stays up); else a ``DaskTaskRunner`` whose cluster :func:`~..parallel.cluster.make_cluster`
    builds from ``cfg`` when the runner's client is first used (scaled as the backend says, and
    closed with the flow), the same cluster ``runner.run`` would start.
    """
    if cfg.in_process:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=1)
    from prefect_dask import DaskTaskRunner

    if cfg.on_running_cluster:
        return DaskTaskRunner(address=scheduler_address(cfg))  # no workers of ours to start
    cluster_spec(cfg)  # the options are checked now, not when the cluster starts inside the flow
    return DaskTaskRunner(cluster_class=make_cluster, cluster_kwargs={"cfg": cfg})


def prestart_workers(cfg: ParallelConfig, modules: Sequence[str], pending_shards: int | None = None, *,
                     here: bool = True, env: dict[str, str] | None = None) -> None:
    """Get the imports of Prefect's task engine and ``modules`` going now, where the shards will
    run: in this process when they run here (``ParallelConfig.runs_here``); in the background,
    in the forkserver, when ``cfg`` forks its local workers; otherwise (``spawn``, batch
    schedulers, a running cluster of ``env: address``) nowhere.

    Call it as early as possible, once ``PREFECT_API_URL`` is in the environment (or given in
    ``env``): the imports then overlap with whatever the driver does before the shards start
    (e.g. waiting for the API server).

    Args:
        cfg: The run's ``parallel:`` section.
        modules: The job's worker modules (runner, provider, frontend).
        pending_shards: How many shards the run computes (``None``: not known yet).
        here: Import them in this process for shards that run here (``False`` before Prefect
            is imported at all: the command line's early start).
        env: More environment for the forkserver and the workers it forks.
    """
    if pending_shards is not None and cfg.runs_here(pending_shards):
        if here:
            for module in (*PREFECT_WORKER_MODULES, *modules):
                importlib.import_module(module)
    elif cfg.backend.forks_workers(cfg):
        start_forkserver((*PREFECT_WORKER_MODULES, *modules), env=env)
