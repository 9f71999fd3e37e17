"""What a quiet console keeps of other libraries' records (the CLI's end-to-end output is in
test_cli_errors.py)."""

from __future__ import annotations

import logging

import distributed.worker

from espnet3_flows.orchestration.console import _QuietFilter


def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, distributed.worker.__file__, 1, message, None, None)


def test_a_heartbeat_that_meets_a_closing_scheduler_is_not_shown_other_dask_errors_are():
    """Seen under load: Dask's cluster close stops the scheduler first, and a worker's heartbeat in
    flight logged an ERROR line after a good run's summary."""
    quiet = _QuietFilter(run_links=False)
    race = _record("distributed.worker", logging.ERROR, "Failed to communicate with scheduler during heartbeat.")
    assert not quiet.filter(race)
    assert quiet.filter(_record("distributed.worker", logging.ERROR, "Compute Failed"))
    assert not quiet.filter(_record("distributed.worker", logging.WARNING, "Heartbeat to scheduler failed"))
