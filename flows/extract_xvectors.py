"""X-vector extraction: ``python flows/extract_xvectors.py [--config FILE] [key=value ...]``."""

import sys

from espnet3_flows.orchestration.entry import job_flow, main

extract_xvectors = job_flow("extract_xvectors")

if __name__ == "__main__":
    sys.exit(main("extract_xvectors"))
