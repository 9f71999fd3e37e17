"""What a quiet console keeps of other libraries' records (the CLI's end-to-end output is in
test_cli_errors.py)."""

from __future__ import annotations

import logging

import distributed.worker

from espnet3_flows.orchestration.console import _QuietFilter, quiet_console


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


def test_the_exit_drains_progress_line_is_not_shown_their_other_records_are():
    """Seen under load (three pytest processes on 2 cores): a good run's script printed Prefect's
    ``EventsWorker - Still processing items: 3 items remaining...`` after its last line, logged
    while the events still queued at the interpreter's exit are sent. Dropped at the loggers
    (the exit comes after quiet_during has given the handlers back); other records stay."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    quiet_console()
    for service in (EventsWorker, APILogWorker):
        logger = logging.getLogger(service.__name__)  # the logger Prefect's queue services log with
        assert not logger.filter(_record(logger.name, logging.WARNING, "Still processing items: 3 items remaining..."))
        assert logger.filter(_record(logger.name, logging.ERROR, "Service 'EventsWorker' failed with 3 pending items."))
