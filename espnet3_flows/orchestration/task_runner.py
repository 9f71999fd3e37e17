"""Prefect task runners from the ``parallel:`` config: one Dask cluster for every split of a run."""

from __future__ import annotations

import importlib
from typing import Any
from collections.abc import Sequence

from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.parallel.forkserver import start_forkserver

#: Imported by every worker before its first shard task: the task engine is most of Prefect's import.
PREFECT_WORKER_MODULES = ("prefect.task_engine",)


def make_task_runner(cfg: ParallelConfig) -> Any:
    """The flow's ``DaskTaskRunner`` on the cluster of ``cfg``'s placement
    (:meth:`~espnet3_flows.parallel.backends.Placement.dask_runner_options`): the one ``runner.run``
    would start, built when the runner's client is first used and closed with the flow; or the
    running scheduler of ``env: address`` (a ``scheduler_file`` is read now), whose client alone is
    closed. Shards that run in this process (``ParallelConfig.runs_here``) need no task runner of
    this kind: the flow runs them on Prefect's thread pool.

    Raises:
        ConfigError: for an env with no Dask cluster (``serial``), or options it cannot run.
    """
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(**cfg.backend.dask_runner_options(cfg))


def prestart_workers(cfg: ParallelConfig, modules: Sequence[str], pending_shards: int | None = None, *,
                     here: bool = True, environ: dict[str, str] | None = None) -> None:
    """Get the imports of Prefect's task engine and ``modules`` going now, where the shards will
    run: in this process when they run here (``ParallelConfig.runs_here``); in the background,
    in the forkserver, when ``cfg`` forks its local workers; otherwise (``spawn``, batch
    schedulers, a running cluster of ``env: address``) nowhere.

    Call it as early as possible, once ``PREFECT_API_URL`` is in the environment (or given in
    ``environ``): the imports then overlap with whatever the driver does before the shards start
    (e.g. waiting for the API server).

    Args:
        cfg: The run's ``parallel:`` section.
        modules: The job's worker modules (runner, provider, frontend).
        pending_shards: How many shards the run computes (``None``: not known yet).
        here: Import them in this process for shards that run here (``False`` before Prefect
            is imported at all: the command line's early start).
        environ: More environment variables for the forkserver and the workers it forks.
    """
    if pending_shards is not None and cfg.runs_here(pending_shards):
        if here:
            for module in (*PREFECT_WORKER_MODULES, *modules):
                importlib.import_module(module)
    elif cfg.backend.forks_workers(cfg):
        start_forkserver((*PREFECT_WORKER_MODULES, *modules), environ=environ)
