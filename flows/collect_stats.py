"""Collect-stats: ``python flows/collect_stats.py [--config FILE] [key=value ...]`` (no args: demo data)."""

import sys

from espnet3_flows.orchestration.entry import collect_stats, main

__all__ = ["collect_stats"]

if __name__ == "__main__":
    sys.exit(main("collect_stats"))
