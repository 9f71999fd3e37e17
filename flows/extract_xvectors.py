"""X-vector extraction: ``python flows/extract_xvectors.py [--config FILE] [key=value ...]``."""

import sys

if __name__ == "__main__":  # the private Prefect server starts while the imports below run
    from espnet3_flows.orchestration.local_server import launch_early

    launch_early(sys.argv[1:])

from espnet3_flows.orchestration.entry import exit_now, job_flow, main  # noqa: E402

extract_xvectors = job_flow("extract_xvectors")

if __name__ == "__main__":
    exit_now(main("extract_xvectors"))
