"""Feature extraction: ``python flows/extract_features.py [--config FILE] [key=value ...]`` (no args: demo data)."""

import sys

from espnet3_flows.orchestration.entry import job_flow, main

extract_features = job_flow("extract_features")

if __name__ == "__main__":
    sys.exit(main("extract_features"))
