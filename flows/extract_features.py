"""Feature extraction: ``python flows/extract_features.py [--config FILE] [key=value ...]`` (no args: demo data)."""

import sys

if __name__ == "__main__":  # the private Prefect server, the plan and the workers start before the imports below
    from espnet3_flows.orchestration.early_start import start_early

    early = start_early("extract_features", sys.argv[1:])

from espnet3_flows.orchestration.entry import exit_now, job_flow, main

extract_features = job_flow("extract_features")

if __name__ == "__main__":
    exit_now(main("extract_features", early=early))
