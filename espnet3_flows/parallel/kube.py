"""Dask on Kubernetes (``parallel.env: kube``): dask-kubernetes' operator ``KubeCluster`` from the
``parallel`` section, its ``DaskCluster`` resource built by dask-kubernetes' own
``make_cluster_spec`` with this project's image, the worker command, the run's environment and the
pods' resources. Needs the ``kubernetes`` extra and a Kubernetes API (a kubeconfig, or the
in-cluster service account) with the Dask operator installed.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from espnet3_flows.config import ConfigError

#: The image the project's Dockerfile builds (``docker-compose.yml`` names it so); its Python has
#: espnet3-flows installed, which the workers need.
DEFAULT_IMAGE = "espnet3-flows:0.1.0"
DEFAULT_NAME = "espnet3-flows"
#: The pods' worker command (Dask's CLI; the image's PATH has it)
WORKER_COMMAND = "dask worker"


def kube_cluster_spec(name: str = DEFAULT_NAME, image: str = DEFAULT_IMAGE, n_workers: int = 1,
                      resources: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                      worker_command: str = WORKER_COMMAND) -> dict[str, Any]:
    """The ``DaskCluster`` resource the operator is given (dask-kubernetes' ``make_cluster_spec``).

    Args:
        name: The cluster's name (its pods are named after it).
        image: The container image of the scheduler and the workers.
        n_workers: Worker pods.
        resources: The containers' requests and limits, e.g. ``{"requests": {"cpu": "2", "memory":
            "4Gi"}, "limits": {...}}``.
        env: Environment variables of every container (e.g. ``PREFECT_API_URL``, AWS settings).
        worker_command: The workers' command.
    """
    from dask_kubernetes.operator import make_cluster_spec

    return make_cluster_spec(name=name, image=image, n_workers=n_workers, resources=dict(resources or {}) or None,
                             env=dict(env or {}) or None, worker_command=worker_command)


def kube_cluster(name: str = DEFAULT_NAME, image: str = DEFAULT_IMAGE, n_workers: int = 1,
                 resources: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 namespace: str | None = None, worker_command: str = WORKER_COMMAND, **kwargs: Any) -> Any:
    """A ``KubeCluster`` running :func:`kube_cluster_spec`'s resource in ``namespace`` (the
    kubeconfig's by default); further keyword arguments go to ``KubeCluster``.

    Raises:
        ConfigError: when no Kubernetes API can be reached (no kubeconfig or credentials).
    """
    from dask_kubernetes.operator import KubeCluster

    spec = kube_cluster_spec(name, image, n_workers, resources, env, worker_command)
    try:
        return KubeCluster(custom_cluster_spec=spec, namespace=namespace, **kwargs)
    except ValueError as exc:
        if "credentials" not in str(exc) and "kubeconfig" not in str(exc).lower():
            raise
        raise ConfigError(f"parallel.env=kube: no Kubernetes API to talk to ({exc}): set KUBECONFIG to a "
                          "kubeconfig of a cluster with the Dask operator installed, or run inside one") from None
