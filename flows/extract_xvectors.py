"""X-vector extraction: ``python flows/extract_xvectors.py [--config FILE] [key=value ...]``."""

import sys

from espnet3_flows.orchestration.entry import extract_xvectors, main

__all__ = ["extract_xvectors"]

if __name__ == "__main__":
    sys.exit(main("extract_xvectors"))
