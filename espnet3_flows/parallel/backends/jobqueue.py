"""The batch schedulers of dask-jobqueue (``parallel.env``: ``slurm``, ``pbs``, ``sge``, ``lsf``,
``htcondor``, ``oar``, ``moab``): a cluster of batch jobs, ``n_workers`` of them or ``adapt``'s
bounds, sized by ``parallel.options`` and the site's ``jobqueue.yaml``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from espnet3_flows.parallel.backends.scaled import ScaledBackend
from espnet3_flows.parallel.backends.cluster_setup import WorkerMemory

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings

#: Per-job size for batch schedulers when neither ``parallel.options`` nor the site's
#: ``jobqueue.yaml`` (``jobqueue.<scheduler>.<key>``) gives one: one single-process worker of
#: 1 core and 2 GB per job (dask-jobqueue itself has no default and refuses to start).
JOBQUEUE_FALLBACKS = {"cores": 1, "memory": "2GB", "processes": 1}
#: The batch jobs' nannies add Dask's ``MALLOC_TRIM_THRESHOLD_`` unless this is exported
TRIM_VAR = "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_"
#: env → dask-jobqueue's cluster class
SCHEDULERS = {"slurm": "SLURMCluster", "pbs": "PBSCluster", "sge": "SGECluster", "lsf": "LSFCluster",
              "htcondor": "HTCondorCluster", "oar": "OARCluster", "moab": "MoabCluster"}


class BatchJobs(ScaledBackend):
    """Workers in batch jobs of a dask-jobqueue cluster class; per-job fallbacks where neither
    the options nor the site's ``jobqueue.yaml`` size a job."""

    own_options = WorkerMemory

    def place_workers(self, cfg: ParallelSettings, kwargs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        import dask

        for key, fallback in JOBQUEUE_FALLBACKS.items():
            # dask-jobqueue reads a site's jobqueue.yaml (~/.config/dask/jobqueue.yaml, DASK_CONFIG)
            # only for arguments not passed: a fallback is passed only where the site set none
            if dask.config.get(f"jobqueue.{self.name}.{key}", None) is None:
                kwargs.setdefault(key, fallback)
        if not self.trims_worker_memory(cfg):  # the batch jobs' nannies add no MALLOC_TRIM_THRESHOLD_
            prologue = list(kwargs.get("job_script_prologue") or [])
            kwargs["job_script_prologue"] = [*prologue, f"export {TRIM_VAR}=None"]
        return super().place_workers(cfg, kwargs)

    def worker_slots(self, cfg: ParallelSettings) -> int:
        """Jobs (``n_workers``, ``adapt``'s maxima) times worker processes per job times the
        threads of each (``options.cores // options.processes``)."""
        processes = max(1, int(cfg.options.get("processes") or 1))
        threads = max(1, int(cfg.options.get("cores") or 1) // processes)
        workers = max(cfg.n_workers, 1, int(cfg.adapt.get("maximum") or 0),
                      int(cfg.adapt.get("maximum_jobs") or 0) * processes)
        return workers * threads


BATCH_SCHEDULERS = {
    name: BatchJobs(name, f"dask_jobqueue.{cls}",
                    doc=f"Batch jobs of dask-jobqueue's ``{cls}`` (``options``: its ``queue``, ``cores``, ``memory``, "
                        "``walltime``, ...; the rest from the site's ``jobqueue.yaml``), ``n_workers`` of them or "
                        "``adapt``'s bounds.")
    for name, cls in SCHEDULERS.items()}
