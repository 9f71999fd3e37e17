"""A backend whose cluster starts empty and is scaled, or adapts, after it is made (the batch
schedulers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from espnet3_flows.parallel.backends.base import Backend, ClusterSpec

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings


class ScaledBackend(Backend):
    """A backend whose cluster starts empty: ``cluster.scale(n_workers)`` (1 by default) after
    construction, or ``cluster.adapt(**parallel.adapt)``."""

    counts = "jobs, ``cluster.scale(n)`` (or ``adapt``)"

    def place_workers(self, cfg: ParallelSettings, kwargs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return cfg.n_workers or (0 if cfg.adapt else 1), dict(cfg.adapt)

    def started(self, cluster: Any, spec: ClusterSpec) -> None:
        if spec.adapt:
            cluster.adapt(**spec.adapt)
        else:
            cluster.scale(spec.n_workers)

    def describe_scaling(self, spec: ClusterSpec) -> str:
        return f", adapt {spec.adapt}" if spec.adapt else f", scaled to {spec.n_workers} worker(s)"
