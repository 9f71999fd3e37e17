"""``parallel.env: kube``: pods of dask-kubernetes' operator ``KubeCluster``, ``n_workers`` of them
(the cluster factory: :func:`espnet3_flows.parallel.kube.kube_cluster`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from espnet3_flows.parallel.backends.base import Backend
from espnet3_flows.parallel.backends.cluster_setup import set_option

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings, Settings


class KubePods(Backend):
    """Worker pods; they do not inherit this process's environment (it goes in ``options.env``)."""

    def defaults(self, cfg: ParallelSettings) -> dict[str, Any]:
        return {"n_workers": cfg.n_workers or 1}

    def with_worker_environ(self, cfg: Settings, variables: dict[str, str]) -> Settings:
        return set_option(cfg, "env", variables) if variables else cfg


KUBE = KubePods("kube", "espnet3_flows.parallel.kube.kube_cluster", extra="kubernetes",
                also_accepts="dask_kubernetes.operator.KubeCluster", requires="dask_kubernetes.operator",
                doc="Pods of dask-kubernetes' operator ``KubeCluster`` (``options.image``, ``resources``, "
                    "``namespace``), ``n_workers`` of them.")
