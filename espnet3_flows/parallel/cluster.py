"""Dask clusters from the ``parallel:`` config: local processes, local GPUs, a batch scheduler, or a
running scheduler someone else started."""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import dask

from espnet3_flows.config import ConfigError, check_choices
from espnet3_flows.parallel.forkserver import DASK_TRIM_DEFAULT, drop_inherited_trim_threshold, local_worker_start, worker_start_method

_LOG = logging.getLogger(__name__)

#: ``parallel.env`` → cluster class. ``serial`` runs in the calling process with no Dask.
CLUSTER_CLASSES: dict[str, str] = {
    "local": "distributed.LocalCluster",
    "local_gpu": "dask_cuda.LocalCUDACluster",
    "slurm": "dask_jobqueue.SLURMCluster",
    "pbs": "dask_jobqueue.PBSCluster",
    "sge": "dask_jobqueue.SGECluster",
    "lsf": "dask_jobqueue.LSFCluster",
    "htcondor": "dask_jobqueue.HTCondorCluster",
    "oar": "dask_jobqueue.OARCluster",
    "moab": "dask_jobqueue.MoabCluster",
}
#: Environments without a cluster class: ``serial`` (in-process), ``address`` (a running scheduler).
ENVS = ("serial", *CLUSTER_CLASSES, "address")
START_METHODS = ("forkserver", "spawn")


@dataclass
class ParallelConfig:
    """The ``parallel:`` section: where shards run.

    Attributes:
        env: ``serial`` (in this process, no Dask), ``local`` (a process ``LocalCluster``),
            ``local_gpu`` (``dask_cuda.LocalCUDACluster``, one GPU per worker) or a batch
            scheduler of dask-jobqueue: ``slurm``, ``pbs``, ``sge``, ``lsf``, ``htcondor``,
            ``oar``, ``moab``; or ``address``: the Dask cluster someone else started (named by
            ``address`` or ``scheduler_file``), which is used and left running.
        n_workers: Workers to start; 0 means one per CPU core (``local``), one per visible
            GPU (``local_gpu``) or 1 job (batch schedulers, unless ``adapt`` is set).
        threads_per_worker: Threads per local worker (1: a speech job is CPU-bound per item).
        options: Keyword arguments for the cluster class (e.g. ``queue``, ``cores``,
            ``memory``, ``walltime``, ``job_extra_directives`` for SLURM). Unknown names are
            an error at construction.
        adapt: Adaptive scaling bounds for batch schedulers, e.g. ``{"minimum": 1, "maximum": 8}``.
        allowed_failures: How often a task may lose its worker before Dask gives up on it.
        trim_worker_memory: Keep Dask's default ``MALLOC_TRIM_THRESHOLD_=65536`` in worker
            processes. Off by default: setting it disables glibc's dynamic mmap threshold, so
            every waveform or feature array over 128 KiB is a fresh mmap that is page-faulted
            and unmapped again, which made the fbank loop ~3x slower in CPU time here
            (benchmarks/bench_collect_stats.py). Turn it on if workers must hand memory back
            to the OS promptly.
        start_method: How ``local`` workers start: ``forkserver`` (default) forks them from
            one server process that imported the job's libraries once, in the background, and
            is kept for later runs in the same process (see :mod:`.forkserver`); ``spawn``
            starts a fresh interpreter per worker (Dask's default). Other environments, and
            ``trim_worker_memory``, always spawn.
        address: ``env: address`` only: the running scheduler, e.g. ``tcp://host:8786``. Its
            workers must import this project and see the manifests' audio and ``output_dir``
            at the same paths; for flows, the driver's Prefect API must be reachable from them
            (not a private server on the driver's loopback). The cluster's own settings apply:
            ``n_workers``, ``options``, ``adapt`` and ``trim_worker_memory`` are an error,
            ``threads_per_worker``, ``start_method`` and ``allowed_failures`` are not used.
        scheduler_file: ``env: address`` only, instead of ``address``: the JSON file written by
            ``dask scheduler --scheduler-file PATH``; its ``address`` is read when a run starts.
        allow_overwrite_lock: ESPnet3's key (replace a stale shard lock), accepted so that an
            ESPnet3 ``parallel:`` section loads unchanged; it has no effect here: shards are staged
            and published atomically, and there are no lock files to go stale.
    """

    env: str = field(default="local", metadata={"choices": ENVS})
    n_workers: int = 0
    threads_per_worker: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    adapt: dict[str, Any] = field(default_factory=dict)
    allowed_failures: int = 3
    trim_worker_memory: bool = False
    start_method: str = "forkserver"
    address: str = ""
    scheduler_file: str = ""
    allow_overwrite_lock: bool = False

    def __post_init__(self) -> None:
        check_choices(self, "parallel.")
        if self.n_workers < 0:
            raise ConfigError(f"parallel.n_workers must be >= 0, got {self.n_workers}")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"parallel.start_method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}")
        if self.threads_per_worker < 1:
            raise ConfigError(f"parallel.threads_per_worker must be >= 1, got {self.threads_per_worker}")
        bad_adapt = set(self.adapt) - {"minimum", "maximum", "minimum_jobs", "maximum_jobs", "interval", "wait_count", "target_duration"}
        if bad_adapt:
            raise ConfigError(f"parallel.adapt: unknown keys {sorted(bad_adapt)}")
        if self.env == "address":
            _check_address_config(self)
        elif self.address or self.scheduler_file:
            key = "address" if self.address else "scheduler_file"
            raise ConfigError(f"parallel.{key} names a running scheduler, used only with parallel.env=address "
                              f"(parallel.env is {self.env!r})")
        elif self.env != "serial":
            cluster_spec(self)  # validates options now, not on the cluster


def _check_address_config(cfg: ParallelConfig) -> None:
    if bool(cfg.address) == bool(cfg.scheduler_file):
        raise ConfigError("parallel.env=address needs exactly one of parallel.address (e.g. tcp://host:8786) "
                          "or parallel.scheduler_file (written by `dask scheduler --scheduler-file PATH`)"
                          + ("; both are set" if cfg.address else ""))
    fixed = {"n_workers": cfg.n_workers, "options": cfg.options, "adapt": cfg.adapt,
             "trim_worker_memory": cfg.trim_worker_memory}
    for key, value in fixed.items():
        if value:
            raise ConfigError(f"parallel.{key} cannot be set with parallel.env=address: the running cluster's "
                              "workers were started by someone else, with their own settings")
    if cfg.address:
        _check_scheduler_address(cfg.address, "parallel.address")


def _check_scheduler_address(address: str, where: str) -> None:
    from distributed.comm import parse_address
    from distributed.comm.registry import backends

    protocol, location = parse_address(address)
    if protocol not in backends or not location:
        raise ConfigError(f"{where}: {address!r} is not a Dask scheduler address such as tcp://host:8786 "
                          f"(protocols: {', '.join(sorted(backends))})")


def scheduler_address(cfg: ParallelConfig) -> str:
    """The scheduler address of ``env: address``: ``cfg.address``, or the ``address`` field of
    ``cfg.scheduler_file`` read now (the scheduler rewrites the file each time it starts).

    Raises:
        ConfigError: for another env, or a scheduler file that is missing, unreadable, not
            JSON or without a valid ``address``.
    """
    if cfg.env != "address":
        raise ConfigError(f"parallel.env={cfg.env} has no running scheduler to connect to; use parallel.env=address")
    if cfg.address:
        return cfg.address
    path = os.path.expanduser(cfg.scheduler_file)
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
    except OSError as exc:
        raise ConfigError(f"parallel.scheduler_file: cannot read {path} ({exc.strerror or exc}); is the scheduler "
                          "running (`dask scheduler --scheduler-file PATH`) and the file on a path this host sees?") from None
    except ValueError as exc:
        raise ConfigError(f"parallel.scheduler_file: {path} is not JSON ({exc})") from None
    address = info.get("address") if isinstance(info, dict) else None
    if not isinstance(address, str) or not address:
        raise ConfigError(f"parallel.scheduler_file: {path} has no \"address\" field; "
                          "is it a file written by `dask scheduler --scheduler-file`?")
    _check_scheduler_address(address, f"parallel.scheduler_file ({path})")
    return address


@dataclass(frozen=True)
class ClusterSpec:
    """A resolved cluster: class path, constructor keyword arguments, workers and adaptivity."""

    class_path: str
    kwargs: dict[str, Any]
    n_workers: int
    adapt: dict[str, Any]

    @property
    def is_jobqueue(self) -> bool:
        """Whether the cluster submits batch jobs (workers are scaled, not passed as ``n_workers``)."""
        return self.class_path.startswith("dask_jobqueue.")


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        extra = " (pip install 'espnet3-flows[gpu]')" if module == "dask_cuda" else ""
        raise ConfigError(f"parallel.env needs {module}, which cannot be imported: {exc}{extra}") from None


def _accepted_kwargs(cls: type) -> set[str] | None:
    names: set[str] = set()
    classes = list(inspect.getmro(cls))
    job_cls = getattr(cls, "job_cls", None)
    if job_cls is not None:
        classes += list(inspect.getmro(job_cls))
    if cls.__name__ in ("LocalCluster", "LocalCUDACluster"):
        from distributed import Nanny, Worker

        classes += [Nanny, Worker]
    for c in classes:
        init = c.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return names or None


#: Per-job size for batch schedulers when neither ``parallel.options`` nor the site's
#: ``jobqueue.yaml`` (``jobqueue.<scheduler>.<key>``) gives one: one single-process worker of
#: 1 core and 2 GB per job (dask-jobqueue itself has no default and refuses to start).
JOBQUEUE_FALLBACKS = {"cores": 1, "memory": "2GB", "processes": 1}


def cluster_spec(cfg: ParallelConfig) -> ClusterSpec:
    """Resolve ``cfg`` to a cluster class and checked keyword arguments.

    Raises:
        ConfigError: for ``serial`` and ``address``, an unknown option name (with the closest valid one), or
            a cluster package that is not installed.
    """
    if cfg.env == "serial":
        raise ConfigError("parallel.env=serial runs without a cluster")
    if cfg.env == "address":
        raise ConfigError("parallel.env=address connects to a running scheduler; it has no cluster to build")
    class_path = CLUSTER_CLASSES[cfg.env]
    cls = _import(class_path)
    accepted = _accepted_kwargs(cls)
    if accepted is not None:
        for key in cfg.options:
            if key not in accepted:
                close = difflib.get_close_matches(key, sorted(accepted), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"parallel.options.{key}: not an option of {class_path}{hint}")
    kwargs = dict(cfg.options)
    n = cfg.n_workers
    if cfg.env == "local":
        n = n or (os.cpu_count() or 1)
        kwargs.setdefault("n_workers", n)
        kwargs.setdefault("threads_per_worker", cfg.threads_per_worker)
        kwargs.setdefault("processes", True)
        kwargs.setdefault("dashboard_address", ":0")  # a free port: several runs may share a host
    elif cfg.env == "local_gpu":
        if n:
            kwargs.setdefault("n_workers", n)
        kwargs.setdefault("threads_per_worker", cfg.threads_per_worker)
        kwargs.setdefault("dashboard_address", ":0")  # a free port: several runs may share a host
    else:
        n = n or (0 if cfg.adapt else 1)
        for key, fallback in JOBQUEUE_FALLBACKS.items():
            # dask-jobqueue reads a site's jobqueue.yaml (~/.config/dask/jobqueue.yaml, DASK_CONFIG)
            # only for arguments not passed: a fallback is passed only where the site set none
            if dask.config.get(f"jobqueue.{cfg.env}.{key}", None) is None:
                kwargs.setdefault(key, fallback)
    return ClusterSpec(class_path, kwargs, n, dict(cfg.adapt))


_TRIM_KEY = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
_TRIM_ENV = "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_"


#: Messages Dask's scheduler keeps per worker stream (and transitions in its log) for debugging;
#: Dask's default is 1,000 (see :func:`configure_worker_processes`)
LOW_LEVEL_LOG_LENGTH = 16


def configure_worker_processes(cfg: ParallelConfig) -> None:
    """Dask settings for the worker processes this process starts (locally or as batch jobs).

    Sets the allowed failures per task and, unless ``cfg.trim_worker_memory``, removes
    ``MALLOC_TRIM_THRESHOLD_`` from the environment Dask's nannies give their workers, both in
    this process's Dask config (local nannies) and in the environment that batch jobs inherit.

    Also shortens Dask's developer logs (``distributed.admin.low-level-log-length``, see
    :data:`LOW_LEVEL_LOG_LENGTH`) for the scheduler this process runs: each of the scheduler's
    streams to a worker keeps its last 1,000 messages by default, and every ``compute-task``
    message holds a whole Prefect task run spec (~100 KB deserialized), so a run of thousands
    of shards kept ~100 MB per worker on the driver for the rest of the flow.
    """
    import dask

    dask.config.set({"distributed.scheduler.allowed-failures": cfg.allowed_failures,
                     "distributed.admin.low-level-log-length": LOW_LEVEL_LOG_LENGTH})
    if cfg.trim_worker_memory:
        dask.config.set({_TRIM_KEY: int(DASK_TRIM_DEFAULT)})
        os.environ.pop(_TRIM_ENV, None)
    else:
        dask.config.set({_TRIM_KEY: None})
        os.environ[_TRIM_ENV] = "None"
        drop_inherited_trim_threshold()


def make_cluster(cfg: ParallelConfig) -> Any:
    """Start the cluster described by ``cfg`` (scaled, or adaptive for batch schedulers)."""
    spec = cluster_spec(cfg)
    cls = _import(spec.class_path)
    configure_worker_processes(cfg)
    method, kwargs = local_worker_start(cfg, spec.kwargs)
    with worker_start_method(method):
        cluster = cls(**kwargs)
    if spec.is_jobqueue:
        if spec.adapt:
            cluster.adapt(**spec.adapt)
        else:
            cluster.scale(spec.n_workers)
    return cluster


def as_parallel_config(config: ParallelConfig | Any) -> ParallelConfig:
    """``config`` as a :class:`ParallelConfig`: one already, or a mapping / OmegaConf node of its
    keys (validated: an unknown key or a bad value is a :class:`ConfigError` naming it)."""
    if isinstance(config, ParallelConfig):
        return config
    from espnet3_flows.config import load_config, to_plain

    return load_config(ParallelConfig, base=to_plain(config))
