"""X-vector extraction: ``python flows/extract_xvectors.py [--config FILE] [key=value ...]``."""

import sys

if __name__ == "__main__":  # the private Prefect server, the plan and the workers start before the imports below
    from espnet3_flows.orchestration.early_start import start_early

    early = start_early("extract_xvectors", sys.argv[1:])

from espnet3_flows.orchestration.entry import exit_now, job_flow, main

extract_xvectors = job_flow("extract_xvectors")

if __name__ == "__main__":
    exit_now(main("extract_xvectors", early=early))
