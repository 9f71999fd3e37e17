"""Prefect orchestration of the engine (the only package that imports prefect).

``espnet3_flows.orchestration.runner_flow(runner, indices, parallel=...)`` runs any runner as a
Prefect flow; ``run_job(job, config)`` runs a registered job. Both are imported on first use, so
that importing a module of this package does not import Prefect's flow engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_job", "runner_flow"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from espnet3_flows.orchestration import flows

        return getattr(flows, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
