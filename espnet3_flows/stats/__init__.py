"""Collect-stats: feature shapes and exact global mean/variance, ESPnet2/ESPnet3-compatible.

The names below are imported on first use (importing the package imports no numpy or torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StatsAccumulator": "espnet3_flows.stats.accumulator",
    "FrontendConfig": "espnet3_flows.frontends.frontend",
    "build_frontend": "espnet3_flows.frontends.frontend",
    "CollectStatsConfig": "espnet3_flows.stats.job",
    "CollectStatsRunner": "espnet3_flows.stats.job",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
