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
import os
from dataclasses import dataclass, field
from typing import Any, Iterator


from espnet3_flows.config import ConfigError, check_choices
from espnet3_flows.parallel.backends import (
    BUILTIN_ENVS,
    Backend,
    backend_of,
    builtin_defaults,
    check_options,
    get_backend,
)
from espnet3_flows.parallel.forkserver import (
    DASK_TRIM_DEFAULT,
    local_worker_start,
    main_import_checked,
    without_inherited_trim_threshold,
    worker_start_method,
)
from espnet3_flows.parallel.main_guard import refuse_while_importing_main

_LOG = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")

#: Seconds a shard waits with no worker at all on a ``local``/``local_gpu`` cluster before it
#: fails (Dask's ``distributed.scheduler.no-workers-timeout``, which wins when set): their nannies
#: restart a dead worker within seconds, so an empty cluster for this long has none left to come.
LOCAL_NO_WORKERS_TIMEOUT = 60.0


@dataclass
class ParallelConfig:
    """The ``parallel:`` section: where shards run.

    Attributes:
        env: ``serial`` (in this process, no Dask: ESPnet3's earlier ``local``, and its runner
            with no parallel config), ``local`` (a process ``LocalCluster`` of ``n_workers``, as
            ESPnet3's current runner and ``parallel_map`` read ``local``),
            ``local_gpu`` (``dask_cuda.LocalCUDACluster``, one GPU per worker; ``make install
            EXTRAS=dev,espnet,gpu CONSTRAINTS=constraints-gpu.txt``: dask-cuda needs dask
            2026.7.1), a batch scheduler of dask-jobqueue (``slurm``, ``pbs``, ``sge``, ``lsf``,
            ``htcondor``, ``oar``, ``moab``), ``ssh`` (``distributed.SSHCluster`` on
            ``options.hosts``; the ``ssh`` extra), ``kube`` (dask-kubernetes' operator
            ``KubeCluster``; the ``kubernetes`` extra), or ``address``: the Dask cluster someone
            else started (named by ``address`` or ``scheduler_file``), which is used and left
            running. The envs are a registry (:mod:`espnet3_flows.parallel.backends`: per env its
            cluster class or factory, how ``n_workers`` becomes workers, its options and
            defaults).
        n_workers: Workers to start; 0 means one per CPU core (``local``), one per visible
            GPU (``local_gpu``), 1 job (batch schedulers, unless ``adapt`` is set), one worker
            per host after the first (``ssh``; else worker processes per host) or 1 pod (``kube``).
        threads_per_worker: Threads per local worker (1: a speech job is CPU-bound per item).
        options: Keyword arguments for the cluster class (e.g. ``queue``, ``cores``,
            ``memory``, ``walltime``, ``job_extra_directives`` for SLURM; ``hosts``,
            ``connect_options``, ``worker_options``, ``scheduler_options``, ``remote_python`` for
            ``ssh``; ``image``, ``resources``, ``env``, ``namespace`` for ``kube``). Unknown names
            are an error at construction, with a suggestion. For batch schedulers, what is left
            out comes from the site's dask-jobqueue config (``~/.config/dask/jobqueue.yaml``,
            ``DASK_CONFIG``) as dask-jobqueue reads it; ``cores``, ``memory`` and ``processes``
            fall back to 1, ``2GB`` and 1 only where neither gives one.
        adapt: Adaptive scaling bounds for batch schedulers, e.g. ``{"minimum": 1, "maximum": 8}``.
        allowed_failures: How often a shard's task may lose its worker before Dask gives up on
            it (the shard then fails). On ``local`` and ``local_gpu`` a dead worker is restarted
            by its nanny for as long as the cluster runs, and a shard that finds no worker at all
            for 60 s fails (:data:`LOCAL_NO_WORKERS_TIMEOUT`): a run ends, it never hangs.
        trim_worker_memory: Keep Dask's default ``MALLOC_TRIM_THRESHOLD_=65536`` in worker
            processes. Off by default: setting it disables glibc's dynamic mmap threshold, so
            every waveform or feature array over 128 KiB is a fresh mmap that is page-faulted
            and unmapped again, which made the fbank loop ~3x slower in CPU time here
            (``benchmarks/bench_collect_stats.py``). Turn it on if workers must hand memory back
            to the OS promptly; its workers are then spawned.
        start_method: How ``local`` workers start: ``forkserver`` (default) forks them from
            one server process that imports Prefect's task engine and the job's libraries
            (torch, lhotse, ...) once, in the background while the driver starts, and is kept
            for later runs in the same process (see :mod:`espnet3_flows.parallel.forkserver`);
            ``spawn`` starts a fresh interpreter per worker (Dask's default). Other
            environments, and ``trim_worker_memory``, always spawn.
        address: ``env: address`` only: the running scheduler, e.g. ``tcp://host:8786``. The
            run connects a client, runs its shards there and closes only its client: the
            scheduler and workers keep running, so repeated runs (nightly deployments) pay
            neither a cluster start nor the workers' imports. Its workers must import this
            project and see the manifests' audio and ``output_dir`` at the same paths; for
            flows, the Prefect API must be reachable from them: set ``PREFECT_API_URL`` to a
            server (not the private one on the driver's loopback), in the workers' environment
            too. The cluster's own settings apply: ``n_workers``, ``options``, ``adapt`` and
            ``trim_worker_memory`` are an error, ``threads_per_worker``, ``start_method`` and
            ``allowed_failures`` are not used.
        scheduler_file: ``env: address`` only, instead of ``address``: the JSON file written by
            ``dask scheduler --scheduler-file PATH``; its ``address`` is read when a run starts
            (e.g. a cluster started in a SLURM allocation, on shared storage).
        cluster_class: Any other Dask cluster class or factory, ``package.module.Name`` (as
            prefect-dask's ``cluster_class``): called with ``n_workers`` and ``options``; ``env``
            stays at its default then.
        inline_shards: At most this many shards to compute run in this process, not on a new
            ``local`` cluster. They run one after the other, as ``serial`` runs them: a cluster's
            start, its workers' imports and its teardown (~2 s here) cost more than a second
            worker gains on a small run (a dev split, a smoke test). The outputs are the same.
            0: always start the cluster (e.g. for a runner that may crash its process). Other
            backends always use their cluster.
        allow_overwrite_lock: ESPnet3's key (replace a stale shard lock), accepted so that an
            ESPnet3 ``parallel:`` section loads unchanged; it has no effect here: shards are staged
            and published atomically, and there are no lock files to go stale.
    """

    env: str = field(default="local", metadata={"choices": BUILTIN_ENVS})
    n_workers: int = 0
    threads_per_worker: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    adapt: dict[str, Any] = field(default_factory=dict)
    allowed_failures: int = 3
    trim_worker_memory: bool = False
    start_method: str = field(default="forkserver", metadata={"choices": START_METHODS})
    address: str = ""
    scheduler_file: str = ""
    cluster_class: str = ""
    inline_shards: int = 1
    allow_overwrite_lock: bool = False

    def __post_init__(self) -> None:
        if self.env not in BUILTIN_ENVS:
            get_backend(self.env)  # a registered backend beyond the built-in ones, or the error naming them
        check_choices(self, "parallel.", skip=() if self.env in BUILTIN_ENVS else ("env",))
        if self.cluster_class and self.env != ParallelConfig.env:  # env left at its default
            raise ConfigError(f"parallel.cluster_class runs {self.cluster_class}; leave parallel.env unset with it "
                              f"(parallel.env is {self.env!r})")
        if self.n_workers < 0:
            raise ConfigError(f"parallel.n_workers must be >= 0, got {self.n_workers}")
        if self.inline_shards < 0:
            raise ConfigError(f"parallel.inline_shards must be >= 0, got {self.inline_shards}")
        if self.threads_per_worker < 1:
            raise ConfigError(f"parallel.threads_per_worker must be >= 1, got {self.threads_per_worker}")
        bad_adapt = set(self.adapt) - {"minimum", "maximum", "minimum_jobs", "maximum_jobs", "interval", "wait_count", "target_duration"}
        if bad_adapt:
            raise ConfigError(f"parallel.adapt: unknown keys {sorted(bad_adapt)}")
        backend = backend_of(self)
        if backend.connects:
            _check_address_config(self)
        elif self.address or self.scheduler_file:
            key = "address" if self.address else "scheduler_file"
            raise ConfigError(f"parallel.{key} names a running scheduler, used only with parallel.env=address "
                              f"(parallel.env is {self.env!r})")
        elif backend.makes_cluster:
            if self.options or backend.required or backend.check is not None:
                cluster_spec(self)  # validates options now, not on the cluster (imports its class)
            else:
                backend.check_installed()

    @property
    def backend(self) -> Backend:
        """The backend this config runs on (see :mod:`espnet3_flows.parallel.backends`)."""
        return backend_of(self)

    def runs_here(self, pending_shards: int) -> bool:
        """Whether a run with ``pending_shards`` shards to compute runs them in this process: a
        backend that always does (``serial``), or one that may (``local``) with at most
        ``inline_shards`` of them."""
        backend = self.backend
        return backend.in_process or (backend.may_inline and 0 < pending_shards <= self.inline_shards)


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
    if not cfg.backend.connects:
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

    if isinstance(cluster, SpecCluster):
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


def as_parallel_config(config: ParallelConfig | Any) -> ParallelConfig:
    """``config`` as a :class:`ParallelConfig`: one already, or a mapping / OmegaConf node of its
    keys (validated: an unknown key or a bad value is a :class:`ConfigError` naming it)."""
    if isinstance(config, ParallelConfig):
        return config
    from espnet3_flows.config import load_config, to_plain

    return load_config(ParallelConfig, base=to_plain(config))
