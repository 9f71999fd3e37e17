"""Feature extraction: ``python flows/extract_features.py [--config FILE] [key=value ...]`` (no args: demo data)."""

import sys

if __name__ == "__main__":  # the private Prefect server starts while the imports below run
    from espnet3_flows.orchestration.local_server import launch_early

    launch_early(sys.argv[1:])

from espnet3_flows.orchestration.entry import exit_now, job_flow, main  # noqa: E402

extract_features = job_flow("extract_features")

if __name__ == "__main__":
    exit_now(main("extract_features"))
