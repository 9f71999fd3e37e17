"""The ``parallel:`` section (:class:`ParallelConfig`): where shards run, checked when it is read.
Building the cluster it describes is its placement's (:mod:`espnet3_flows.parallel.backends`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from espnet3_flows.code_keys import CODE, DATA_KEYS
from espnet3_flows.config import ConfigError, check_choices
from espnet3_flows.parallel.backends import BACKENDS, BUILTIN_ENVS, Placement, backend_of, is_cluster_class

#: The keys that were ``parallel`` keys of their own and are now a placement's own
#: ``parallel.options`` (:mod:`espnet3_flows.parallel.backends.own_options`), or ``env``: their old
#: spelling is read as the new one
MOVED_KEYS = {"trim_worker_memory": "options.trim_worker_memory", "start_method": "options.start_method",
              "inline_shards": "options.inline_shards", "address": "options.address",
              "scheduler_file": "options.scheduler_file", "cluster_class": "env"}
#: ``parallel.options`` that are plain resource settings. Every other option can make a cluster
#: run something (a worker's environment, ``preload``, a job script's prologue or directives, the
#: python or container image it starts), so a deployment's form may not set it
#: (:mod:`espnet3_flows.code_keys`); the deployment itself may.
DATA_OPTIONS = frozenset({
    "queue", "account", "project", "walltime", "memory", "cores", "processes", "job_cpu", "job_mem",
    "job_name", "death_timeout", "memory_limit", "dashboard_address", "CUDA_VISIBLE_DEVICES",
    "device_memory_limit", "rmm_pool_size", "resources", "namespace",
    "trim_worker_memory", "start_method", "inline_shards"})


def _env_is_code(section: dict[str, Any]) -> str | None:
    value = section.get("env")
    return "a cluster class: imported and called" if isinstance(value, str) and is_cluster_class(value) else None


@dataclass
class ParallelConfig:
    """The ``parallel:`` section: where shards run.

    Attributes:
        env: Where shards run: ``local`` (a process ``LocalCluster`` on this machine), ``serial``
            (this process), ``local_gpu``, a batch scheduler of dask-jobqueue (``slurm``,
            ``pbs``, ``sge``, ``lsf``, ``htcondor``, ``oar``, ``moab``), ``ssh``, ``kube``, or
            ``address`` (a running Dask cluster, used and left running). Each is a class, one module
            each (:mod:`espnet3_flows.parallel.backends`); ``docs/configuration.md``'s table of
            envs is made from them. Or an import path, ``package.module.Name``: any other Dask
            cluster class or factory (as prefect-dask's ``cluster_class``), called with
            ``n_workers`` and ``options`` (also read as ``parallel.cluster_class``).
        n_workers: Workers to start; 0 means one per CPU core (``local``), one per visible
            GPU (``local_gpu``), 1 job (batch schedulers, unless ``adapt`` is set), one worker
            per host after the first (``ssh``; else worker processes per host) or 1 pod (``kube``).
        threads_per_worker: Threads per local worker (1: a speech job is CPU-bound per item).
        options: Keyword arguments for the cluster class (e.g. ``queue``, ``cores``,
            ``memory``, ``walltime``, ``job_extra_directives`` for SLURM; ``hosts``,
            ``connect_options``, ``worker_options``, ``scheduler_options``, ``remote_python`` for
            ``ssh``; ``image``, ``resources``, ``env``, ``namespace`` for ``kube``), and the env's
            own typed options, which its cluster is not given: ``start_method`` and
            ``inline_shards`` for ``local``, ``trim_worker_memory`` for ``local``, ``local_gpu``
            and the batch schedulers, ``address`` or ``scheduler_file`` for ``address`` (see
            "Options an env reads itself"). Unknown names are an error at construction, with a
            suggestion. For batch schedulers, what is left
            out comes from the site's dask-jobqueue config (``~/.config/dask/jobqueue.yaml``,
            ``DASK_CONFIG``) as dask-jobqueue reads it; ``cores``, ``memory`` and ``processes``
            fall back to 1, ``2GB`` and 1 only where neither gives one.
        adapt: Adaptive scaling bounds for batch schedulers, e.g. ``{"minimum": 1, "maximum": 8}``.
        allowed_failures: How often a shard's task may lose its worker before Dask gives up on
            it (the shard then fails). On ``local`` and ``local_gpu`` a dead worker is restarted
            by its nanny for as long as the cluster runs, and a shard that finds no worker at all
            for 60 s fails (:data:`~espnet3_flows.parallel.backends.local.LOCAL_NO_WORKERS_TIMEOUT`): a run
            ends, it never hangs.
        allow_overwrite_lock: ESPnet3's key (replace a stale shard lock), accepted so that an
            ESPnet3 ``parallel:`` section loads unchanged; it has no effect here: shards are staged
            and published atomically, and there are no lock files to go stale.
    """

    #: the old spellings of :data:`MOVED_KEYS`, read as their new keys
    CONFIG_ALIASES: ClassVar[dict[str, str]] = MOVED_KEYS

    env: str = field(default="local", metadata={"choices": BUILTIN_ENVS, "registry": BACKENDS, CODE: _env_is_code})
    n_workers: int = 0
    threads_per_worker: int = 1
    options: dict[str, Any] = field(default_factory=dict, metadata={
        CODE: "the cluster runs it (a worker's environment, preload, job script or command)", DATA_KEYS: DATA_OPTIONS})
    adapt: dict[str, Any] = field(default_factory=dict)
    allowed_failures: int = 3
    allow_overwrite_lock: bool = False

    def __post_init__(self) -> None:
        # env: a built-in backend, a plugin's, or the error naming them; or a cluster class's import path
        check_choices(self, "parallel.", skip=("env",) if is_cluster_class(self.env) else ())
        if self.n_workers < 0:
            raise ConfigError(f"parallel.n_workers must be >= 0, got {self.n_workers}")
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

    @property
    def placement_options(self) -> Any:
        """The env's own options as ``options`` sets them (typed: e.g.
        :class:`~espnet3_flows.parallel.backends.local.LocalOptions`), ``None`` for an env without any."""
        return self.backend.options_of(self)

    def runs_here(self, pending_shards: int) -> bool:
        """Whether a run with ``pending_shards`` shards to compute runs them in this process: an
        env that always does (``serial``), or one that may (``local``) with at most
        ``options.inline_shards`` of them."""
        return self.backend.runs_here(self, pending_shards)


def scheduler_address(cfg: ParallelConfig) -> str:
    """The scheduler address of ``env: address``: ``options.address``, or the ``address`` field of
    ``options.scheduler_file`` read now (:meth:`~espnet3_flows.parallel.backends.Placement.scheduler_address`).

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
