"""Prefect task runners from the ``parallel:`` config: one Dask cluster for every split of a run."""

from __future__ import annotations

from typing import Any, Sequence

from espnet3_flows.parallel.cluster import ParallelConfig, cluster_spec, configure_worker_processes, scheduler_address
from espnet3_flows.parallel.forkserver import local_worker_start, start_forkserver, wants_forkserver

#: Imported by every worker before its first shard task: the task engine is most of Prefect's import.
PREFECT_WORKER_MODULES = ("prefect.task_engine",)


def make_task_runner(cfg: ParallelConfig) -> tuple[Any, str]:
    """``DaskTaskRunner`` on the configured cluster, or a one-thread runner for ``serial``, and the
    start method of its local workers (``forkserver`` or ``spawn``; see :mod:`..parallel.forkserver`).

    ``env: address`` connects to the running scheduler (a ``scheduler_file`` is read now) and
    starts nothing: the runner closes only its client when the flow ends, the cluster stays up.

    The cluster starts when the runner's client is first used; that must happen under
    ``worker_start_method(method)``. Batch-scheduler clusters get ``adapt_kwargs`` (fixed
    ``n_workers`` becomes ``minimum = maximum = n_workers``) because prefect-dask scales only
    adaptively.
    """
    if cfg.env == "serial":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=1), "spawn"
    from prefect_dask import DaskTaskRunner

    if cfg.env == "address":
        return DaskTaskRunner(address=scheduler_address(cfg)), "spawn"  # no local workers to start
    spec = cluster_spec(cfg)
    configure_worker_processes(cfg)
    method, kwargs = local_worker_start(cfg, spec.kwargs)
    adapt = spec.adapt or None
    if spec.is_jobqueue and adapt is None:
        adapt = {"minimum": spec.n_workers, "maximum": spec.n_workers}
    return DaskTaskRunner(cluster_class=spec.class_path, cluster_kwargs=kwargs, adapt_kwargs=adapt), method


def prestart_workers(cfg: ParallelConfig, modules: Sequence[str]) -> None:
    """Start importing Prefect's task engine and ``modules`` for the local workers now, in the
    background (the forkserver), when ``cfg`` forks its workers; otherwise (``spawn``, batch
    schedulers, a running cluster of ``env: address``) do nothing.

    Call it as early as possible, once ``PREFECT_API_URL`` is in the environment: the
    imports then overlap with whatever the driver does before the cluster starts.
    """
    if wants_forkserver(cfg):
        configure_worker_processes(cfg)
        start_forkserver((*PREFECT_WORKER_MODULES, *modules))
