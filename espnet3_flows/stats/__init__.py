"""Collect-stats: feature shapes and exact global mean/variance, ESPnet2/ESPnet3-compatible."""

from espnet3_flows.stats.accumulator import StatsAccumulator
from espnet3_flows.stats.frontend import FrontendConfig, build_frontend
from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsProvider, CollectStatsRunner

__all__ = ["CollectStatsConfig", "CollectStatsProvider", "CollectStatsRunner", "FrontendConfig",
           "StatsAccumulator", "build_frontend"]
