"""Driver-side checks shared by every job, before any cluster starts (jobs come from
:mod:`espnet3_flows.job_registry`)."""

from __future__ import annotations

from typing import Any

from espnet3_flows.job_registry import JobSpec, get_job
from espnet3_flows.storage import Storage

__all__ = ["JobSpec", "check_output_dir", "get_job", "preflight"]


def check_output_dir(output_dir: str, storage_options: dict[str, Any]) -> None:
    """Fail before any work when the output location cannot be written."""
    Storage(output_dir, storage_options).check_writable()


def preflight(job: str, cfg: Any, *, output: bool = True) -> None:
    """Everything checkable on the driver before any cluster starts: the output location is
    writable (unless ``output`` is False: a dry run writes nothing) and the job's own checks
    (x-vectors: the model loads from local files)."""
    if output:
        check_output_dir(cfg.output_dir, cfg.storage_options)
    get_job(job).run_preflight(cfg)
