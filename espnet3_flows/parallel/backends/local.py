"""``parallel.env: local``: a process ``LocalCluster`` on this machine, its workers forked from a
forkserver that imported the job's libraries once; and :class:`OnThisMachine`, what every cluster
whose nannies live in this process shares (``local``, ``local_gpu``)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from collections.abc import Iterator

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends.base import Backend, ClusterSpec
from espnet3_flows.parallel.backends.cluster_setup import WorkerMemory, set_option

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings, Settings

#: Seconds a shard waits with no worker at all on a ``local``/``local_gpu`` cluster before it
#: fails (Dask's ``distributed.scheduler.no-workers-timeout``, which wins when set): their nannies
#: restart a dead worker within seconds, so an empty cluster for this long has none left to come.
LOCAL_NO_WORKERS_TIMEOUT = 60.0
#: How ``local`` workers start (``parallel.options.start_method``)
START_METHODS = ("forkserver", "spawn")


@dataclass(frozen=True)
class LocalOptions(WorkerMemory):
    """``parallel.options`` that ``local`` reads itself (the others go to ``LocalCluster``).

    Attributes:
        start_method: How workers start: ``forkserver`` (default) forks them from one server
            process that imports Prefect's task engine and the job's libraries (torch, lhotse,
            ...) once, in the background while the driver starts, and is kept for later runs in
            the same process, and a worker that died is forked again (see
            :mod:`espnet3_flows.parallel.forkserver`); ``spawn`` starts a fresh interpreter per
            worker (Dask's default). With ``trim_worker_memory`` workers are always spawned.
            (Also read as ``parallel.start_method``.)
        inline_shards: At most this many shards to compute run in this process, not on a new
            cluster. They run one after the other, as ``serial`` runs them: a cluster's start, its
            workers' imports and its teardown cost more than a second worker gains on a small run
            (a dev split, a smoke test). The outputs are the same. 0: always start the cluster
            (e.g. for a runner that may crash its process). (Also read as ``parallel.inline_shards``.)
    """

    start_method: str = field(default="forkserver", metadata={"choices": START_METHODS})
    inline_shards: int = 1

    def __post_init__(self) -> None:
        if self.inline_shards < 0:
            raise ConfigError(f"parallel.options.inline_shards must be >= 0, got {self.inline_shards}")


class OnThisMachine(Backend):
    """A cluster whose nannies are in this process and whose workers are processes of this
    machine: their output is this terminal, they take the nanny's and worker's options, and a
    nanny whose worker died is kept (it restarts it)."""

    output_here = True
    no_workers_timeout: ClassVar[float | None] = LOCAL_NO_WORKERS_TIMEOUT
    own_options: ClassVar[type | None] = WorkerMemory

    def worker_classes(self) -> list[type]:
        from distributed import Nanny, Worker

        return [Nanny, Worker]

    def started(self, cluster: Any, spec: ClusterSpec) -> None:
        from espnet3_flows.parallel.dask_private import keep_restarted_workers

        keep_restarted_workers(cluster)

    def with_worker_environ(self, cfg: Settings, variables: dict[str, str]) -> Settings:
        """``cfg`` with ``variables`` in its nannies' ``env`` (``options.env``; the user's own
        entries win): the run's workers are told at their start, not through this process's
        environment."""
        return set_option(cfg, "env", variables) if variables else cfg

    @contextlib.contextmanager
    def starting(self, spec: ClusterSpec, cfg: ParallelSettings) -> Iterator[dict[str, Any]]:
        from espnet3_flows.parallel.forkserver import spawned_with

        with super().starting(spec, cfg) as kwargs, spawned_with(kwargs.get("env")):
            yield kwargs

    def shown_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kwargs.items() if k != "env"}  # what the workers are told at their start


class LocalProcesses(OnThisMachine):
    """``distributed.LocalCluster`` of worker processes (``n_workers`` 0: one per core), forked
    from the forkserver (``start_method: forkserver``) or spawned; a run with few shards to
    compute (``parallel.options.inline_shards``) runs them in this process instead."""

    own_options: ClassVar[type | None] = LocalOptions

    def defaults(self, cfg: ParallelSettings) -> dict[str, Any]:
        return {"n_workers": cfg.n_workers or os.cpu_count() or 1, "threads_per_worker": cfg.threads_per_worker,
                "processes": True, "dashboard_address": ":0"}  # a free port: several runs may share a host

    def default_workers(self) -> int:
        return os.cpu_count() or 1

    def forks_workers(self, cfg: ParallelSettings) -> bool:
        """With ``start_method: forkserver`` and without ``trim_worker_memory`` (glibc reads
        ``MALLOC_TRIM_THRESHOLD_`` when a process starts, so that setting needs spawned workers)."""
        from espnet3_flows.patches import patches_enabled

        options = self.options_of(cfg)
        return (options.start_method == "forkserver" and not options.trim_worker_memory
                and patches_enabled("forks_workers"))  # (on multiprocessing's and Dask's internals: off, spawned)

    def runs_here(self, cfg: ParallelSettings, pending_shards: int) -> bool:
        # its workers would be processes of this machine with nothing this process lacks
        return 0 < pending_shards <= self.options_of(cfg).inline_shards

    @contextlib.contextmanager
    def starting(self, spec: ClusterSpec, cfg: ParallelSettings) -> Iterator[dict[str, Any]]:
        from espnet3_flows.parallel.forkserver import (local_worker_start, main_import_checked, spawned_with,
                                                       worker_start_method)

        method, kwargs = local_worker_start(spec.kwargs) if self.forks_workers(cfg) else ("spawn", spec.kwargs)
        if method == "forkserver" and "worker_class" not in kwargs:  # a user's worker_class restarts as Dask says
            from espnet3_flows.parallel.forking_nanny import ForkingNanny

            kwargs = {**kwargs, "worker_class": ForkingNanny}  # a dead worker's restart is forked too
        spawned = kwargs.get("env") if method == "spawn" else None
        with worker_start_method(method), main_import_checked(method), spawned_with(spawned):
            yield kwargs


LOCAL = LocalProcesses(
    "local", "distributed.LocalCluster",
    doc="A process ``LocalCluster`` on this machine (``n_workers`` 0: one per core), its workers forked from a "
        "forkserver that imported the job's libraries once.")
