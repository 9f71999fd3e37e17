"""The ``parallel:`` section (:class:`ParallelConfig`): where shards run, checked when it is read.
Building the cluster it describes is its placement's (:mod:`espnet3_flows.parallel.backends`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from espnet3_flows.code_keys import CODE, DATA_KEYS
from espnet3_flows.config import ConfigError, check_choices
from espnet3_flows.parallel.backends import BACKENDS, BUILTIN_ENVS, Placement, backend_of

START_METHODS = ("forkserver", "spawn")
#: ``parallel.options`` that are plain resource settings. Every other option can make a cluster
#: run something (a worker's environment, ``preload``, a job script's prologue or directives, the
#: python or container image it starts), so a deployment's form may not set it
#: (:mod:`espnet3_flows.code_keys`); the deployment itself may.
DATA_OPTIONS = frozenset({
    "queue", "account", "project", "walltime", "memory", "cores", "processes", "job_cpu", "job_mem",
    "job_name", "death_timeout", "memory_limit", "dashboard_address", "CUDA_VISIBLE_DEVICES",
    "device_memory_limit", "rmm_pool_size", "resources", "namespace"})
_SCHEDULER_WHY = "this process runs on a scheduler it names and unpickles what comes back"


@dataclass
class ParallelConfig:
    """The ``parallel:`` section: where shards run.

    Attributes:
        env: Where shards run: ``local`` (a process ``LocalCluster`` on this machine), ``serial``
            (this process), ``local_gpu``, a batch scheduler of dask-jobqueue (``slurm``,
            ``pbs``, ``sge``, ``lsf``, ``htcondor``, ``oar``, ``moab``), ``ssh``, ``kube``, or
            ``address`` (a running Dask cluster, used and left running). Each is a class, one module
            each (:mod:`espnet3_flows.parallel.backends`); ``docs/configuration.md``'s table of
            envs is made from them.
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
            for 60 s fails (:data:`~espnet3_flows.parallel.backends.local.LOCAL_NO_WORKERS_TIMEOUT`): a run ends, it never hangs.
        trim_worker_memory: Keep Dask's default ``MALLOC_TRIM_THRESHOLD_=65536`` in worker
            processes. Off by default: setting it disables glibc's dynamic mmap threshold, so
            every waveform or feature array over 128 KiB is a fresh mmap that is page-faulted
            and unmapped again, several times the fbank loop's CPU time (``benchmarks/README.md``).
            Turn it on if workers must hand memory back to the OS promptly; its workers are then
            spawned.
        start_method: How ``local`` workers start: ``forkserver`` (default) forks them from
            one server process that imports Prefect's task engine and the job's libraries
            (torch, lhotse, ...) once, in the background while the driver starts, and is kept
            for later runs in the same process, and a worker that died is forked again (see
            :mod:`espnet3_flows.parallel.forkserver`); ``spawn`` starts a fresh interpreter per
            worker (Dask's default). Other environments, and ``trim_worker_memory``, always spawn.
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

    env: str = field(default="local", metadata={"choices": BUILTIN_ENVS, "registry": BACKENDS})
    n_workers: int = 0
    threads_per_worker: int = 1
    options: dict[str, Any] = field(default_factory=dict, metadata={
        CODE: "the cluster runs it (a worker's environment, preload, job script or command)", DATA_KEYS: DATA_OPTIONS})
    adapt: dict[str, Any] = field(default_factory=dict)
    allowed_failures: int = 3
    trim_worker_memory: bool = False
    start_method: str = field(default="forkserver", metadata={"choices": START_METHODS})
    address: str = field(default="", metadata={CODE: _SCHEDULER_WHY})
    scheduler_file: str = field(default="", metadata={CODE: _SCHEDULER_WHY})
    cluster_class: str = field(default="", metadata={CODE: "imported and called"})
    inline_shards: int = 1
    allow_overwrite_lock: bool = False

    def __post_init__(self) -> None:
        check_choices(self, "parallel.")  # env: a built-in backend, a plugin's, or the error naming them
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
        backend_of(self).check_config(self)  # the env's own checks (its options, or a scheduler's address)

    @property
    def backend(self) -> Placement:
        """Where this config's shards run (see :mod:`espnet3_flows.parallel.backends`)."""
        return backend_of(self)

    def runs_here(self, pending_shards: int) -> bool:
        """Whether a run with ``pending_shards`` shards to compute runs them in this process: an
        env that always does (``serial``), or one that may (``local``) with at most
        ``inline_shards`` of them."""
        return self.backend.runs_here(self, pending_shards)


def scheduler_address(cfg: ParallelConfig) -> str:
    """The scheduler address of ``env: address``: ``cfg.address``, or the ``address`` field of
    ``cfg.scheduler_file`` read now (:meth:`~espnet3_flows.parallel.backends.Placement.scheduler_address`).

    Raises:
        ConfigError: for another env, or a scheduler file that cannot give one.
    """
    return cfg.backend.scheduler_address(cfg)


def as_parallel_config(config: ParallelConfig | Any) -> ParallelConfig:
    """``config`` as a :class:`ParallelConfig`: one already, or a mapping / OmegaConf node of its
    keys (validated: an unknown key or a bad value is a :class:`ConfigError` naming it)."""
    if isinstance(config, ParallelConfig):
        return config
    from espnet3_flows.config import load_config, to_plain

    return load_config(ParallelConfig, base=to_plain(config))
