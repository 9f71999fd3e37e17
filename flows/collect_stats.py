"""Collect-stats: ``python flows/collect_stats.py [--config FILE] [key=value ...]`` (no args: demo data)."""

import sys

if __name__ == "__main__":  # the private Prefect server, the plan and the workers start before the imports below
    from espnet3_flows.orchestration.early_start import start_early

    early = start_early("collect_stats", sys.argv[1:])

from espnet3_flows.orchestration.entry import exit_now, job_flow, main

collect_stats = job_flow("collect_stats")

if __name__ == "__main__":
    exit_now(main("collect_stats", early=early))
