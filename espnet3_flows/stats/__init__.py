"""Collect-stats: feature shapes and exact global mean/variance, ESPnet2/ESPnet3-compatible.

The names below are imported on first use (importing the package imports no numpy or torch).
"""

from __future__ import annotations

from espnet3_flows.lazy_exports import lazy_getattr

_EXPORTS = {
    "StatsAccumulator": "espnet3_flows.stats.accumulator",
    "FrontendConfig": "espnet3_flows.frontends.config",
    "build_frontend": "espnet3_flows.frontends.frontend",
    "CollectStatsConfig": "espnet3_flows.stats.config",
    "CollectStatsRunner": "espnet3_flows.stats.job",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
