"""Where shards run, as a registry: one declaration per ``parallel.env`` (its cluster class or
factory, how ``n_workers`` becomes workers, which options it takes and which defaults it fills).

A new backend is one :func:`register_backend` call and its test; nothing else in the package
compares ``parallel.env`` to a name. Another package adds one through the entry-point group
``espnet3_flows.backends`` (``name = "package.module:BACKEND"``, a :class:`Backend` of that name:
:mod:`espnet3_flows.registry`). ``parallel.cluster_class: pkg.module.Factory`` runs any other
Dask cluster class or factory a site has (as prefect-dask's ``cluster_class``), called with
``n_workers`` and ``parallel.options``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from espnet3_flows.config import ConfigError, did_you_mean
from espnet3_flows.registry import Registry, instance_of

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_config import ParallelConfig

#: How ``n_workers`` becomes workers
WORKER_MODES = ("n_workers", "scale", "hosts")


@dataclass(frozen=True)
class Backend:
    """One ``parallel.env``.

    Attributes:
        name: The env's name.
        cluster: ``"module.Attr"`` of the cluster class or factory; empty for the two envs that
            start no cluster (``serial``: this process; ``address``: a running cluster).
        workers: How ``n_workers`` becomes workers: ``n_workers`` (a constructor argument),
            ``scale`` (``cluster.scale(n)`` after construction, or ``adapt``), ``hosts`` (one
            worker per host of ``options.hosts`` after the first; ``n_workers``: processes per host).
        in_process: Runs in the calling process (no Dask).
        connects: Connects to a cluster someone else runs (used and left running).
        on_this_machine: Its workers run on this machine (their output is this terminal).
        may_inline: A run with few shards to compute (``parallel.inline_shards``) may run them in
            this process instead of starting this backend's cluster (its workers would be
            processes of this machine with nothing the calling process lacks).
        forks: Its workers may be forked from this project's forkserver.
        jobqueue: A dask-jobqueue batch scheduler (the site's ``jobqueue.yaml``, per-job fallbacks).
        extra: The pip extra that installs its package (named when the import fails).
        defaults: ``(config) -> options`` filled where ``parallel.options`` has none.
        required: Options that must be given.
        also_accepts: ``"module.Attr"`` of a class whose constructor takes the options a factory
            passes on (``SSHCluster`` → ``SpecCluster``).
        check: ``(config) -> None``: further checks of the options (raise :class:`ConfigError`).
        requires: A module its cluster needs (checked when the config is, naming ``extra``).
        env_option: Where the workers' environment variables go in ``options`` (dotted), for
            backends whose workers do not inherit this process's environment; empty for those
            that do.
        doc: One sentence for the generated table of envs (``docs/configuration.md``).
    """

    name: str
    cluster: str = ""
    workers: str = "scale"
    in_process: bool = False
    connects: bool = False
    on_this_machine: bool = False
    may_inline: bool = False
    forks: bool = False
    jobqueue: bool = False
    extra: str = ""
    defaults: Callable[[Any], dict[str, Any]] | None = field(default=None, compare=False)
    required: tuple[str, ...] = ()
    also_accepts: str = ""
    check: Callable[[Any], None] | None = field(default=None, compare=False)
    requires: str = ""
    env_option: str = ""
    doc: str = ""

    def __post_init__(self) -> None:
        if self.workers not in WORKER_MODES:
            raise ValueError(f"backend {self.name}: workers must be one of {WORKER_MODES}, got {self.workers!r}")

    @property
    def makes_cluster(self) -> bool:
        """Whether a run with this backend starts (and closes) a cluster of its own."""
        return bool(self.cluster)

    def check_installed(self) -> None:
        """A :class:`ConfigError` naming the extra when the cluster's package (or ``requires``) is
        not installed; found without importing it (a config is checked before any import)."""
        for module in filter(None, (self.requires, self.cluster.rpartition(".")[0] if self.cluster else "")):
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:  # a parent package missing
                found = False
            if not found:
                raise ConfigError(f"parallel.env={self.name} needs {module}, which is not installed"
                                  f"{_extra_hint(self.extra)}")

    def load(self) -> Any:
        """The cluster class or factory (:class:`ConfigError` naming the extra when it is missing)."""
        if self.requires:
            try:
                importlib.import_module(self.requires)
            except ImportError as exc:
                raise ConfigError(f"parallel.env={self.name} needs {self.requires}, which cannot be imported: "
                                  f"{exc}{_extra_hint(self.extra)}") from None
        return import_object(self.cluster, f"parallel.env={self.name}", self.extra)


#: every ``parallel.env`` by name: the built-in ones (below), then those of installed packages
BACKENDS: Registry[Backend] = Registry("cluster backend", "parallel.env", accept=instance_of(Backend))


def register_backend(backend: Backend) -> Backend:
    """Add (or replace) a backend; returns it."""
    return BACKENDS.register(backend.name, backend)


def backend_names() -> tuple[str, ...]:
    """The registered envs, built-in ones first (in registration order), then installed packages'."""
    return BACKENDS.names()


def get_backend(name: str) -> Backend:
    """The backend of ``parallel.env=name``; a :class:`ConfigError` naming the known ones otherwise."""
    return BACKENDS.get(name)


def backend_of(cfg: ParallelConfig) -> Backend:
    """The backend a config runs on: ``parallel.cluster_class`` when set, else ``parallel.env``'s."""
    if cfg.cluster_class:
        return Backend("cluster_class", cfg.cluster_class, workers="n_workers")
    return get_backend(cfg.env)


def _extra_hint(extra: str) -> str:
    """`` (pip install 'espnet3-flows[EXTRA]')`` for an error message, or nothing without an extra."""
    return f" (pip install 'espnet3-flows[{extra}]')" if extra else ""


def import_object(path: str, what: str, extra: str = "") -> Any:
    """The object ``path`` (``module.Attr`` or ``module:Attr``) names."""
    module, sep, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"{what}: {path!r} is not an importable name such as package.module.Class")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(f"{what} needs {module}, which cannot be imported: {exc}{_extra_hint(extra)}") from None
    except AttributeError:
        raise ConfigError(f"{what}: module {module} has no {name!r}") from None


def accepted_options(factory: Any, backend: Backend) -> set[str] | None:
    """The keyword arguments ``factory`` takes, ``None`` when it takes any: a class's constructors
    along its MRO (and its job class's, for dask-jobqueue; a local cluster's nanny and worker), a
    function's parameters (with those of ``backend.also_accepts`` where it passes ``**kwargs`` on)."""
    if inspect.isclass(factory):
        classes = list(inspect.getmro(factory))
        job_cls = getattr(factory, "job_cls", None)
        if job_cls is not None:
            classes += list(inspect.getmro(job_cls))
        if backend.on_this_machine:
            from distributed import Nanny, Worker

            classes += [Nanny, Worker]
        inits = [c.__dict__["__init__"] for c in classes if "__init__" in c.__dict__]
    else:
        names, open_ended = _keywords(factory)
        if open_ended and not backend.also_accepts:
            return None
        inits = [factory] + ([import_object(backend.also_accepts, f"parallel.env={backend.name}").__init__]
                             if open_ended else [])
    accepted: set[str] = set()
    for init in inits:
        accepted |= _keywords(init)[0]
    accepted.discard("self")
    return accepted or None


def _keywords(func: Any) -> tuple[set[str], bool]:
    """(names ``func`` takes by keyword, whether it also takes ``**kwargs``)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return set(), True
    return ({p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)},
            any(p.kind == p.VAR_KEYWORD for p in params))


def check_options(cfg: ParallelConfig, backend: Backend, factory: Any) -> None:
    """Unknown option names (with the closest valid one) and missing required ones are errors now,
    not on the cluster."""
    accepted = accepted_options(factory, backend)
    if accepted is not None:
        for key in cfg.options:
            if key not in accepted:
                raise ConfigError(f"parallel.options.{key}: not an option of {backend.cluster}"
                                  f"{did_you_mean(key, sorted(accepted))}")
    for key in backend.required:
        if key not in cfg.options:
            raise ConfigError(f"parallel.env={backend.name} needs parallel.options.{key}")
    if backend.check is not None:
        backend.check(cfg)


# ---- the built-in backends ------------------------------------------------------------------
def _local_defaults(cfg: ParallelConfig) -> dict[str, Any]:
    return {"n_workers": cfg.n_workers or os.cpu_count() or 1, "threads_per_worker": cfg.threads_per_worker,
            "processes": True, "dashboard_address": ":0"}  # a free port: several runs may share a host


def _local_gpu_defaults(cfg: ParallelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"threads_per_worker": cfg.threads_per_worker, "dashboard_address": ":0"}
    if cfg.n_workers:
        out["n_workers"] = cfg.n_workers  # else one per visible GPU
    return out


def _ssh_defaults(cfg: ParallelConfig) -> dict[str, Any]:
    # the remote workers run the driver's interpreter path unless told otherwise (a venv at the
    # same path on every host, as a lab's shared software tree has it)
    return {"remote_python": sys.executable}


def _check_ssh(cfg: ParallelConfig) -> None:
    hosts = cfg.options.get("hosts")
    if not isinstance(hosts, (list, tuple)) or len(hosts) < 2 or not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError("parallel.options.hosts: a list of at least two host names, the first running the "
                          f"scheduler and the others one worker each (SSHCluster's hosts), got {hosts!r}")


def _kube_defaults(cfg: ParallelConfig) -> dict[str, Any]:
    return {"n_workers": cfg.n_workers or 1}


register_backend(Backend("serial", in_process=True,
                         doc="In this process, one shard after the other, no Dask (ESPnet3's earlier ``local``, and "
                             "its runner with no parallel config)."))
register_backend(Backend("local", "distributed.LocalCluster", workers="n_workers", on_this_machine=True, forks=True,
                         may_inline=True, defaults=_local_defaults,
                         doc="A process ``LocalCluster`` on this machine (``n_workers`` 0: one per core), its workers "
                             "forked from a forkserver that imported the job's libraries once."))
register_backend(Backend("local_gpu", "dask_cuda.LocalCUDACluster", workers="n_workers", on_this_machine=True,
                         extra="gpu", defaults=_local_gpu_defaults,
                         doc="A worker per visible GPU, each seeing only its own (``n_workers`` 0: every GPU); "
                             "dask-cuda needs ``constraints-gpu.txt``'s dask."))
for _name, _cls in (("slurm", "SLURMCluster"), ("pbs", "PBSCluster"), ("sge", "SGECluster"), ("lsf", "LSFCluster"),
                    ("htcondor", "HTCondorCluster"), ("oar", "OARCluster"), ("moab", "MoabCluster")):
    register_backend(Backend(_name, f"dask_jobqueue.{_cls}", workers="scale", jobqueue=True,
                             doc=f"Batch jobs of dask-jobqueue's ``{_cls}`` (``options``: its ``queue``, ``cores``, "
                                 "``memory``, ``walltime``, ...; the rest from the site's ``jobqueue.yaml``), "
                                 "``n_workers`` of them or ``adapt``'s bounds."))
register_backend(Backend("ssh", "distributed.SSHCluster", workers="hosts", required=("hosts",), defaults=_ssh_defaults,
                         also_accepts="distributed.SpecCluster", check=_check_ssh, requires="asyncssh", extra="ssh",
                         env_option="worker_options.env",
                         doc="Workers on other machines over SSH: ``options.hosts``' first runs the scheduler, each "
                             "other one a worker of ``n_workers`` processes."))
register_backend(Backend("kube", "espnet3_flows.parallel.kube.kube_cluster", workers="n_workers", extra="kubernetes",
                         defaults=_kube_defaults, also_accepts="dask_kubernetes.operator.KubeCluster",
                         requires="dask_kubernetes.operator", env_option="env",
                         doc="Pods of dask-kubernetes' operator ``KubeCluster`` (``options.image``, ``resources``, "
                             "``namespace``), ``n_workers`` of them."))
register_backend(Backend("address", connects=True,
                         doc="The Dask cluster someone else started, at ``address`` or ``scheduler_file``: used and "
                             "left running."))

#: The envs of the built-in backends
BUILTIN_ENVS = BACKENDS.names(plugins=False)


#: How each ``workers`` mode turns ``n_workers`` into workers, for the generated table
WORKER_MODE_DOCS = {"n_workers": "workers, started with the cluster",
                    "scale": "jobs, ``cluster.scale(n)`` (or ``adapt``)",
                    "hosts": "processes per host"}


def backend_rows(backends: Mapping[str, Backend] | None = None) -> list[list[str]]:
    """The table of envs, a row each: ``env``, what it is, its cluster class, what ``n_workers``
    counts, the options it needs, the extra that installs it (Markdown cells)."""
    rows = []
    for name, b in (backends or BACKENDS.items()).items():
        cluster = f"``{b.cluster}``" if b.cluster else ("a running one" if b.connects else "none")
        workers = "—" if not b.makes_cluster else WORKER_MODE_DOCS[b.workers]
        needs = ", ".join(f"``options.{k}``" for k in b.required) or "—"
        extra = f"``[{b.extra}]``" if b.extra else "—"
        rows.append([f"``{name}``", b.doc or "—", cluster, workers, needs, extra])
    return rows


def builtin_defaults(cfg: ParallelConfig, backend: Backend) -> Mapping[str, Any]:
    """The options a backend fills where ``parallel.options`` has none."""
    return backend.defaults(cfg) if backend.defaults is not None else {}


def visible_gpu_count() -> int:
    """The CUDA GPUs this process sees (``torch.cuda.device_count()``, which honours
    ``CUDA_VISIBLE_DEVICES``), as ESPnet3 counts them; without torch, the entries of
    ``CUDA_VISIBLE_DEVICES`` (0 when it is unset)."""
    try:
        import torch
    except ImportError:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return int(torch.cuda.device_count())


def worker_slots(cfg: ParallelConfig) -> int:
    """How many shards ``cfg``'s cluster computes at once, as far as the config tells: its workers
    (``n_workers``, or what 0 means for the env; ``adapt.maximum`` when larger) times the threads
    of each (``threads_per_worker``; for a batch scheduler ``options.cores // options.processes``).
    1 for ``serial`` and for ``address`` (a running cluster's size is not known before it is
    reached). The shard plan of a small split is cut so that each of these slots gets shards
    (:func:`~espnet3_flows.sharding.split_shard_size`)."""
    backend = backend_of(cfg)
    if backend.in_process or backend.connects:
        return 1
    options = cfg.options
    if backend.jobqueue:
        processes = max(1, int(options.get("processes") or 1))
        threads = max(1, int(options.get("cores") or 1) // processes)
        adapt = cfg.adapt
        workers = max(cfg.n_workers, 1, int(adapt.get("maximum") or 0),
                      int(adapt.get("maximum_jobs") or 0) * processes)
        return workers * threads
    if backend.workers == "hosts":
        hosts = options.get("hosts") or []
        return max(1, len(hosts) - 1) * max(1, cfg.n_workers)
    threads = max(1, int(options.get("threads_per_worker") or cfg.threads_per_worker))
    workers = int(options.get("n_workers") or cfg.n_workers or 0)
    if workers == 0 and backend.name == "local":
        workers = os.cpu_count() or 1
    elif workers == 0 and backend.name == "local_gpu":
        workers = visible_gpu_count()
    return max(workers, 1, int(cfg.adapt.get("maximum") or 0)) * threads
