"""Collect-stats: ``python flows/collect_stats.py [--config FILE] [key=value ...]`` (no args: demo data)."""

import sys

from espnet3_flows.orchestration.entry import job_flow, main

collect_stats = job_flow("collect_stats")

if __name__ == "__main__":
    sys.exit(main("collect_stats"))
