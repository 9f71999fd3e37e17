"""``parallel.env: local``: a process ``LocalCluster`` on this machine, its workers forked from a
forkserver that imported the job's libraries once; and :class:`OnThisMachine`, what every cluster
whose nannies live in this process shares (``local``, ``local_gpu``)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, ClassVar
from collections.abc import Iterator

from espnet3_flows.parallel.backends.base import Backend, ClusterSpec

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_config import ParallelConfig

#: Seconds a shard waits with no worker at all on a ``local``/``local_gpu`` cluster before it
#: fails (Dask's ``distributed.scheduler.no-workers-timeout``, which wins when set): their nannies
#: restart a dead worker within seconds, so an empty cluster for this long has none left to come.
LOCAL_NO_WORKERS_TIMEOUT = 60.0


class OnThisMachine(Backend):
    """A cluster whose nannies are in this process and whose workers are processes of this
    machine: their output is this terminal, they take the nanny's and worker's options, and a
    nanny whose worker died is kept (it restarts it)."""

    output_here = True
    no_workers_timeout: ClassVar[float | None] = LOCAL_NO_WORKERS_TIMEOUT

    def worker_classes(self) -> list[type]:
        from distributed import Nanny, Worker

        return [Nanny, Worker]

    def started(self, cluster: Any, spec: ClusterSpec) -> None:
        from espnet3_flows.parallel.cluster import keep_restarted_workers

        keep_restarted_workers(cluster)


class LocalProcesses(OnThisMachine):
    """``distributed.LocalCluster`` of worker processes (``n_workers`` 0: one per core), forked
    from the forkserver (``start_method: forkserver``) or spawned; a run with few shards to
    compute (``parallel.inline_shards``) runs them in this process instead."""

    forks = True

    def defaults(self, cfg: ParallelConfig) -> dict[str, Any]:
        return {"n_workers": cfg.n_workers or os.cpu_count() or 1, "threads_per_worker": cfg.threads_per_worker,
                "processes": True, "dashboard_address": ":0"}  # a free port: several runs may share a host

    def default_workers(self) -> int:
        return os.cpu_count() or 1

    def runs_here(self, cfg: ParallelConfig, pending_shards: int) -> bool:
        # its workers would be processes of this machine with nothing this process lacks
        return 0 < pending_shards <= cfg.inline_shards

    @contextlib.contextmanager
    def starting(self, spec: ClusterSpec, cfg: ParallelConfig) -> Iterator[dict[str, Any]]:
        from espnet3_flows.parallel.forkserver import local_worker_start, main_import_checked, worker_start_method

        method, kwargs = local_worker_start(cfg, spec.kwargs)
        if method == "forkserver" and "worker_class" not in kwargs:  # a user's worker_class restarts as Dask says
            from espnet3_flows.parallel.forking_nanny import ForkingNanny

            kwargs = {**kwargs, "worker_class": ForkingNanny}  # a dead worker's restart is forked too
        with worker_start_method(method), main_import_checked(method):
            yield kwargs

    def shown_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if k != "env"}  # the forked workers' copy of this environment


LOCAL = LocalProcesses(
    "local", "distributed.LocalCluster",
    doc="A process ``LocalCluster`` on this machine (``n_workers`` 0: one per core), its workers forked from a "
        "forkserver that imported the job's libraries once.")
