"""Dask clusters from the ``parallel:`` config, through the backend registry
(:mod:`espnet3_flows.parallel.backends`): built, scaled, given this project's scheduler and worker
settings for themselves only (nothing of them stays in this process's Dask config or environment),
and checked to run this project on every worker."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends import Backend, ClusterSpec, backend_of
from espnet3_flows.parallel.forkserver import DASK_TRIM_DEFAULT, without_inherited_trim_threshold
from espnet3_flows.parallel.main_guard import refuse_while_importing_main

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings, Settings

_LOG = logging.getLogger(__name__)


#: Worker environments' setting of Dask's malloc trimming (their nannies add it when it is unset)
_TRIM_KEY = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"


def cluster_spec(cfg: ParallelSettings) -> ClusterSpec:
    """Resolve ``cfg`` to its backend's cluster and checked keyword arguments.

    Raises:
        ConfigError: for an env that starts no cluster (``serial``, ``address``), an unknown
            option name (with the closest valid one), a missing required one, or a cluster package
            that is not installed (naming its extra).
    """
    backend = backend_of(cfg)
    if not isinstance(backend, Backend):
        raise ConfigError(f"parallel.env={backend.name}: no cluster to build ({backend.describe(cfg)})")
    return backend.spec(cfg)


@contextlib.contextmanager
def worker_settings(cfg: ParallelSettings) -> Iterator[None]:
    """For the block in which a cluster of ``cfg`` starts its local workers: Dask's malloc
    trimming for their environment as ``trim_worker_memory`` says (their nannies read it when they
    are made), and Dask's ``MALLOC_TRIM_THRESHOLD_`` left in this process's environment by an
    earlier nanny kept from them. Both are undone when the block ends."""
    import dask

    value = int(DASK_TRIM_DEFAULT) if cfg.trim_worker_memory else None
    with dask.config.set({_TRIM_KEY: value}), without_inherited_trim_threshold():
        yield


def make_cluster(cfg: ParallelSettings) -> Any:
    """Start the cluster ``cfg`` describes (as its backend says: workers as a constructor argument,
    scaled, adaptive, or one per host). Also prefect-dask's ``cluster_class`` of the flows'
    task runner, called with ``cfg``.

    Raises:
        UnguardedMainError: when this script starts the cluster when it is imported (its workers,
            or their forkserver, import it: :mod:`.main_guard`), in one line naming the fix.
    """
    refuse_while_importing_main("a Dask cluster")
    spec = cluster_spec(cfg)
    with worker_settings(cfg):
        return spec.backend.start(spec, cfg)


def describe_parallel(cfg: ParallelSettings) -> str:
    """Which backend a run of ``cfg`` uses, and how (``--dry-run`` prints it)."""
    return backend_of(cfg).describe(cfg)


def with_worker_env(cfg: Settings, variables: dict[str, str]) -> Settings:
    """``cfg`` with ``variables`` in its workers' environment, for backends whose workers do not
    inherit this process's (``ssh``: ``options.worker_options.env``, ``kube``: ``options.env``);
    the user's own entries win. Unchanged for the others."""
    return backend_of(cfg).with_worker_env(cfg, variables)


def prepare_client(client: Any, cfg: ParallelSettings) -> None:
    """On a client of a cluster this run started: this project's scheduler settings
    (:class:`~.dask_plugins.ClusterSettings`), and a check that every worker can import this project.

    Raises:
        ConfigError: naming the workers (host and address) where ``espnet3_flows`` is not importable.
    """
    from espnet3_flows.parallel.dask_plugins import ClusterSettings

    backend = backend_of(cfg)
    if not isinstance(backend, Backend):
        return
    client.register_plugin(ClusterSettings(cfg.allowed_failures, no_workers_timeout=backend.no_workers_timeout))
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
