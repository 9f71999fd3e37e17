"""Where shards run, as a registry of classes: one :class:`Placement` per ``parallel.env``.

Two are run modes, not clusters: ``serial`` (:mod:`.serial`, this process) and ``address``
(:mod:`.address`, a cluster someone else runs). The others are :class:`Backend` objects, one
module each: ``local``, ``local_gpu``, the dask-jobqueue schedulers (:mod:`.jobqueue`), ``ssh``,
``kube``. A backend makes its cluster, describes it, gives its workers the run's environment and
counts its worker slots; ``docs/configuration.md``'s table of envs is made from them.

A new built-in backend is a :class:`Backend` (or subclass) in a module of this package and one
line of :data:`BUILTIN_BACKENDS`; another package adds one through the entry-point group
``espnet3_flows.backends`` (``name = "package.module:BACKEND"``: :mod:`espnet3_flows.registry`),
and a program one of its own with :func:`register_backend`. ``parallel.env: pkg.module.Factory``
(an import path instead of a name; also read as ``parallel.cluster_class``) runs any other Dask
cluster class or factory a site has (as prefect-dask's ``cluster_class``), called with
``n_workers`` and ``parallel.options``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Mapping

from espnet3_flows.parallel.backends.base import Backend, ClusterSpec, Placement
from espnet3_flows.parallel.backends.scaled import ScaledBackend
from espnet3_flows.parallel.backends.named_objects import extra_hint, import_object
from espnet3_flows.parallel.backends.local_gpu import visible_gpu_count
from espnet3_flows.registry import Registry, instance_of

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings

__all__ = ["BACKENDS", "BUILTIN_ENVS", "Backend", "ClusterSpec", "Placement", "ScaledBackend", "backend_names",
           "backend_of", "backend_rows", "extra_hint", "get_backend", "import_object", "is_cluster_class",
           "register_backend", "visible_gpu_count", "worker_slots"]


#: The built-in envs, as an entry point names one, in the order the UI's drop-down and the docs
#: list them (``jobqueue:BATCH_SCHEDULERS`` is a mapping of seven: ``slurm`` to ``moab``)
BUILTIN_BACKENDS = tuple(f"espnet3_flows.parallel.backends.{ref}" for ref in (
    "serial:SERIAL", "local:LOCAL", "local_gpu:LOCAL_GPU", "jobqueue:BATCH_SCHEDULERS", "ssh:SSH", "kube:KUBE",
    "address:ADDRESS"))
#: every ``parallel.env`` by name: the built-in ones, then those of installed packages
BACKENDS: Registry[Placement] = Registry("cluster backend", "parallel.env", builtins=BUILTIN_BACKENDS,
                                         accept=instance_of(Placement))


def register_backend(backend: Placement) -> Placement:
    """Add (or replace) an env; returns it."""
    return BACKENDS.register(backend.name, backend)


def backend_names() -> tuple[str, ...]:
    """The registered envs, built-in ones first (in registration order), then installed packages'."""
    return BACKENDS.names()


def get_backend(name: str) -> Placement:
    """The env ``parallel.env=name``; a :class:`ConfigError` naming the known ones otherwise."""
    return BACKENDS.get(name)


def is_cluster_class(value: str) -> bool:
    """Whether a ``parallel.env`` value is an import path (``pkg.module.Factory`` or
    ``pkg.module:Factory``) of a cluster class or factory rather than an env's name."""
    return "." in value or ":" in value


def backend_of(cfg: ParallelSettings) -> Placement:
    """Where a config's shards run: ``parallel.env``'s placement, or for an import path that is
    no env's name a :class:`Backend` of that cluster class or factory."""
    if is_cluster_class(cfg.env) and cfg.env not in BACKENDS:
        return Backend(cfg.env, cfg.env)
    return get_backend(cfg.env)


#: The envs of the built-in backends
BUILTIN_ENVS = BACKENDS.names(plugins=False)


def backend_rows(backends: Mapping[str, Placement] | None = None) -> list[list[str]]:
    """The table of envs, a row each: ``env``, what it is, its cluster class, what ``n_workers``
    counts, the options it needs, the extra that installs it (Markdown cells)."""
    return [placement.table_row() for placement in (backends or BACKENDS.items()).values()]


def worker_slots(cfg: ParallelSettings) -> int:
    """How many shards ``cfg``'s run computes at once, as far as the config tells: its workers
    (``n_workers``, or what 0 means for the env; ``adapt.maximum`` when larger) times the threads
    of each (``threads_per_worker``; for a batch scheduler ``options.cores // options.processes``).
    1 for ``serial`` and for ``address`` (a running cluster's size is not known before it is
    reached). The shard plan of a small split is cut so that each of these slots gets shards
    (:func:`~espnet3_flows.sharding.split_shard_size`)."""
    return backend_of(cfg).worker_slots(cfg)
