"""Dask clusters from the ``parallel:`` config, through the backend registry
(:mod:`espnet3_flows.parallel.backends`): resolved, started, described, and given the run's
environment. Each placement makes its own cluster, client and task-runner options
(:class:`~espnet3_flows.parallel.backends.Placement`); these are the functions over a config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from espnet3_flows.parallel.backends import ClusterSpec, backend_of

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings, Settings


def cluster_spec(cfg: ParallelSettings) -> ClusterSpec:
    """Resolve ``cfg`` to its backend's cluster and checked keyword arguments.

    Raises:
        ConfigError: for an env that starts no cluster (``serial``, ``address``), an unknown
            option name (with the closest valid one), a missing required one, or a cluster package
            that is not installed (naming its extra).
    """
    return backend_of(cfg).spec(cfg)


def make_cluster(cfg: ParallelSettings) -> Any:
    """Start the cluster ``cfg`` describes (as its backend says: workers as a constructor argument,
    scaled, adaptive, or one per host): :meth:`~.backends.Backend.make_cluster`.

    Raises:
        ConfigError: for an env that starts no cluster (``serial``, ``address``) or bad options.
        UnguardedMainError: when this script starts the cluster when it is imported, in one line.
    """
    return backend_of(cfg).make_cluster(cfg)


def describe_parallel(cfg: ParallelSettings) -> str:
    """Which backend a run of ``cfg`` uses, and how (``--dry-run`` prints it)."""
    return backend_of(cfg).describe(cfg)


def with_worker_environ(cfg: Settings, variables: dict[str, str]) -> Settings:
    """``cfg`` with ``variables`` in its workers' OS environment, for backends whose workers do
    not inherit this process's (``ssh``: ``options.worker_options.env``, ``kube``: ``options.env``,
    local nannies: ``options.env``); the user's own entries win. Unchanged for the others."""
    return backend_of(cfg).with_worker_environ(cfg, variables)
