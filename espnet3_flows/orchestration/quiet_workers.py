"""Preloaded by the forkserver of local workers after the driver's script (every run this package
orchestrates names it among the workers' modules: :func:`.job_run.runner_modules`): the script's
imports set up Prefect's console logging; the workers quiet it as the driver asked
(:func:`.console.apply_from_environment`). The engine below knows nothing of Prefect's console."""

from espnet3_flows.orchestration.console import apply_from_environment

apply_from_environment()
