"""The registered jobs' Prefect flows, importable from an installed package.

A deployment names a flow by module path, so a worker runs it wherever it was started and
without a checkout: ``entrypoint: espnet3_flows.flows.collect_stats`` (see
``deployments/prefect.yaml``). Each attribute is the flow of the job of that name in
:mod:`espnet3_flows.job_registry`, the same object ``flows/<job>.py`` defines.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from espnet3_flows.job_registry import available_jobs

    if name.startswith("__") or name not in available_jobs():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (jobs: {', '.join(available_jobs())})")
    from espnet3_flows.orchestration.entry import job_flow

    return job_flow(name)


def __dir__() -> list[str]:
    from espnet3_flows.job_registry import available_jobs

    return sorted(available_jobs())
