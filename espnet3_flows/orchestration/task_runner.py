"""Prefect task runners from the ``parallel:`` config: one Dask cluster for every split of a run."""

from __future__ import annotations

from typing import Any

from espnet3_flows.parallel.cluster import ParallelConfig, cluster_spec, configure_worker_processes


def make_task_runner(cfg: ParallelConfig) -> Any:
    """``DaskTaskRunner`` on the configured cluster, or a one-thread runner for ``serial``.

    Batch-scheduler clusters get ``adapt_kwargs`` (fixed ``n_workers`` becomes
    ``minimum = maximum = n_workers``) because prefect-dask scales only adaptively.
    """
    if cfg.env == "serial":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=1)
    from prefect_dask import DaskTaskRunner

    spec = cluster_spec(cfg)
    configure_worker_processes(cfg)
    adapt = spec.adapt or None
    if spec.is_jobqueue and adapt is None:
        adapt = {"minimum": spec.n_workers, "maximum": spec.n_workers}
    return DaskTaskRunner(cluster_class=spec.class_path, cluster_kwargs=dict(spec.kwargs), adapt_kwargs=adapt)
