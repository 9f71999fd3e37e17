"""Dask clusters from the ``parallel:`` config, through the backend registry
(:mod:`espnet3_flows.parallel.backends`): built, scaled, given this project's scheduler and worker
settings for themselves only (nothing of them stays in this process's Dask config or environment),
and checked to run this project on every worker."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator


from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends import (
    Backend,
    builtin_defaults,
    check_options,
)
from espnet3_flows.parallel.forkserver import (
    DASK_TRIM_DEFAULT,
    local_worker_start,
    main_import_checked,
    without_inherited_trim_threshold,
    worker_start_method,
)
from espnet3_flows.parallel.main_guard import refuse_while_importing_main

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_config import ParallelConfig

_LOG = logging.getLogger(__name__)

#: Seconds a shard waits with no worker at all on a ``local``/``local_gpu`` cluster before it
#: fails (Dask's ``distributed.scheduler.no-workers-timeout``, which wins when set): their nannies
#: restart a dead worker within seconds, so an empty cluster for this long has none left to come.
LOCAL_NO_WORKERS_TIMEOUT = 60.0


@dataclass(frozen=True)
class ClusterSpec:
    """A resolved cluster: its backend, class or factory, keyword arguments, workers, adaptivity.

    Attributes:
        backend: The backend.
        class_path: The cluster class or factory.
        kwargs: Its keyword arguments (``options``, the backend's defaults and the worker settings).
        n_workers: Workers to scale to after construction (``scale`` backends), else as given.
        adapt: Adaptive scaling bounds (``scale`` backends).
    """

    backend: Backend
    class_path: str
    kwargs: dict[str, Any]
    n_workers: int
    adapt: dict[str, Any]

    @property
    def is_jobqueue(self) -> bool:
        """Whether the cluster submits batch jobs."""
        return self.backend.jobqueue

    def describe(self) -> str:
        """One line: the backend, its cluster and options (credentials masked), how it scales
        (``--dry-run`` prints it)."""
        from espnet3_flows.credentials import redact

        shown = json.dumps(redact({k: v for k, v in self.kwargs.items() if k != "env" or not self.backend.forks}),
                           default=str, sort_keys=True)
        scale = (f", adapt {self.adapt}" if self.adapt else f", scaled to {self.n_workers} worker(s)") \
            if self.backend.workers == "scale" else ""
        return f"{self.backend.name}: {self.class_path}({shown}){scale}"


#: Per-job size for batch schedulers when neither ``parallel.options`` nor the site's
#: ``jobqueue.yaml`` (``jobqueue.<scheduler>.<key>``) gives one: one single-process worker of
#: 1 core and 2 GB per job (dask-jobqueue itself has no default and refuses to start).
JOBQUEUE_FALLBACKS = {"cores": 1, "memory": "2GB", "processes": 1}
#: Worker environments' setting of Dask's malloc trimming (their nannies add it when it is unset)
_TRIM_KEY = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
_TRIM_ENV = "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_"


def cluster_spec(cfg: ParallelConfig) -> ClusterSpec:
    """Resolve ``cfg`` to its backend's cluster and checked keyword arguments.

    Raises:
        ConfigError: for a backend that starts no cluster (``serial``, ``address``), an unknown
            option name (with the closest valid one), a missing required one, or a cluster package
            that is not installed (naming its extra).
    """
    backend = cfg.backend
    if not backend.makes_cluster:
        what = "connects to a running one" if backend.connects else "runs in this process"
        raise ConfigError(f"parallel.env={backend.name}: no cluster to build (it {what})")
    factory = backend.load()
    check_options(cfg, backend, factory)
    kwargs = dict(cfg.options)
    for key, value in builtin_defaults(cfg, backend).items():
        kwargs.setdefault(key, value)
    n = cfg.n_workers
    if backend.workers == "n_workers" and n:
        kwargs.setdefault("n_workers", n)
    elif backend.workers == "hosts" and n:
        kwargs["worker_options"] = {**kwargs.get("worker_options", {}), "n_workers": n}  # processes per host
    elif backend.workers == "scale":
        n = n or (0 if cfg.adapt else 1)
    if backend.jobqueue:
        import dask

        for key, fallback in JOBQUEUE_FALLBACKS.items():
            # dask-jobqueue reads a site's jobqueue.yaml (~/.config/dask/jobqueue.yaml, DASK_CONFIG)
            # only for arguments not passed: a fallback is passed only where the site set none
            if dask.config.get(f"jobqueue.{backend.name}.{key}", None) is None:
                kwargs.setdefault(key, fallback)
        if not cfg.trim_worker_memory:  # the batch jobs' nannies add no MALLOC_TRIM_THRESHOLD_
            prologue = list(kwargs.get("job_script_prologue") or [])
            kwargs["job_script_prologue"] = [*prologue, f"export {_TRIM_ENV}=None"]
    return ClusterSpec(backend, backend.cluster, kwargs, n, dict(cfg.adapt) if backend.workers == "scale" else {})


@contextlib.contextmanager
def worker_settings(cfg: ParallelConfig) -> Iterator[None]:
    """For the block in which a cluster of ``cfg`` starts its local workers: Dask's malloc
    trimming for their environment as ``trim_worker_memory`` says (their nannies read it when they
    are made), and Dask's ``MALLOC_TRIM_THRESHOLD_`` left in this process's environment by an
    earlier nanny kept from them. Both are undone when the block ends."""
    import dask

    value = int(DASK_TRIM_DEFAULT) if cfg.trim_worker_memory else None
    with dask.config.set({_TRIM_KEY: value}), without_inherited_trim_threshold():
        yield


def make_cluster(cfg: ParallelConfig) -> Any:
    """Start the cluster ``cfg`` describes (as its backend says: workers as a constructor argument,
    scaled, adaptive, or one per host). Also prefect-dask's ``cluster_class`` of the flows'
    task runner, called with ``cfg``.

    Raises:
        UnguardedMainError: when this script starts the cluster when it is imported (its workers,
            or their forkserver, import it: :mod:`.main_guard`), in one line naming the fix.
    """
    refuse_while_importing_main("a Dask cluster")
    spec = cluster_spec(cfg)
    factory = spec.backend.load()
    with worker_settings(cfg):
        method, kwargs = local_worker_start(cfg, spec.kwargs) if spec.backend.forks else ("spawn", spec.kwargs)
        checked = main_import_checked(method) if spec.backend.forks else contextlib.nullcontext()
        with worker_start_method(method), checked:
            cluster = factory(**kwargs)
            if spec.backend.on_this_machine:
                keep_restarted_workers(cluster)
            if spec.backend.workers == "scale":
                if spec.adapt:
                    cluster.adapt(**spec.adapt)
                else:
                    cluster.scale(spec.n_workers)
    return cluster


def keep_restarted_workers(cluster: Any) -> None:
    """Stop ``cluster`` (a ``SpecCluster`` whose nannies live in this process: ``local``,
    ``local_gpu``) from closing a nanny whose worker died.

    Dask's ``SpecCluster`` closes a worker's nanny for good when, ``distributed.deploy.
    lost-worker-timeout`` (15 s) after its worker left, that worker is not back at that instant. A
    nanny restarts its worker itself, so for a shard that kills every worker it runs on the check
    fell, sooner or later, between one death and the next restart: the cluster lost its nannies
    one by one and the run waited forever on an empty cluster. The check exists for workers in
    jobs that vanish; local nannies cannot, so their workers' comings and goings are only tracked.
    """
    from distributed import SpecCluster
    from distributed.deploy.cluster import Cluster

    from espnet3_flows.patches import patches_enabled

    patched = "_update_worker_status"  # SpecCluster's own (the timer), over the base Cluster's
    if (isinstance(cluster, SpecCluster) and patches_enabled() and patched in vars(SpecCluster)
            and patched in vars(Cluster)):
        # the base Cluster's bookkeeping of the scheduler's worker list, without SpecCluster's timer
        cluster._update_worker_status = super(SpecCluster, cluster)._update_worker_status


def describe_parallel(cfg: ParallelConfig) -> str:
    """Which backend a run of ``cfg`` uses, and how (``--dry-run`` prints it)."""
    backend = cfg.backend
    if backend.in_process:
        return f"{backend.name}: in this process, no Dask"
    if backend.connects:
        where = cfg.address or f"the scheduler of {cfg.scheduler_file}"
        return f"{backend.name}: the running cluster at {where} (left running)"
    return cluster_spec(cfg).describe()


def with_worker_env(cfg: ParallelConfig, variables: dict[str, str]) -> ParallelConfig:
    """``cfg`` with ``variables`` in its workers' environment, for backends whose workers do not
    inherit this process's (``ssh``: ``options.worker_options.env``, ``kube``: ``options.env``);
    the user's own entries win. Unchanged for the others."""
    where = cfg.backend.env_option
    if not where or not variables:
        return cfg
    options = copy.deepcopy(cfg.options)
    node = options
    *parents, leaf = where.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = {**variables, **(node.get(leaf) or {})}
    return dataclasses.replace(cfg, options=options)


def prepare_client(client: Any, cfg: ParallelConfig) -> None:
    """On a client of a cluster this run started: this project's scheduler settings
    (:class:`~.dask_plugins.ClusterSettings`), and a check that every worker can import this project.

    Raises:
        ConfigError: naming the workers (host and address) where ``espnet3_flows`` is not importable.
    """
    from espnet3_flows.parallel.dask_plugins import ClusterSettings

    if not cfg.backend.makes_cluster:
        return
    no_workers_timeout = LOCAL_NO_WORKERS_TIMEOUT if cfg.backend.on_this_machine else None
    client.register_plugin(ClusterSettings(cfg.allowed_failures, no_workers_timeout=no_workers_timeout))
    check_workers_import(client)


def check_workers_import(client: Any, module: str = "espnet3_flows") -> None:
    """Raise a :class:`ConfigError` naming each worker that cannot import ``module`` (its
    interpreter lacks this project: the shard tasks would fail there to unpickle)."""
    probe = f"__import__('importlib.util').util.find_spec({module!r}) is not None"
    found = client.run(eval, probe)  # a builtin: nothing of this project is shipped for the check
    missing = sorted(addr for addr, ok in found.items() if not ok)
    if missing:
        hosts = sorted({addr.split("://")[-1].rsplit(":", 1)[0] for addr in missing})
        raise ConfigError(f"{module} cannot be imported on host(s) {', '.join(hosts)} (workers "
                          f"{', '.join(missing)}): install espnet3-flows in the workers' Python there "
                          "(parallel.options.remote_python for ssh) or put this checkout on their PYTHONPATH")
