"""The run's log is the job's log: what a job did is written to the log of the flow run a person
opens (a deployment's run, the command line's flow, a user's own flow around ``runner_flow``).

A job's shards run in a subflow (``shards``: its task runner is chosen per run), and its lines
were logged with that subflow's run logger: ``prefect flow-run logs <id>``, ``prefect deployment
run --watch`` and the UI's log tab of the run that was triggered showed none of them, and this
package's own records (a merge's warning, a refused input) reached the API only where
``PREFECT_LOGGING_EXTRA_LOGGERS`` named the package. Here, for the duration of :func:`run_log`:

- :func:`job_logger` is the run logger of that outer run: the job's lines (what was planned,
  done earlier and computed, each split's counts) go to its log, and to the console as before;
- this package's warnings and errors (``espnet3_flows.*``) go to its log too, wherever in the run
  they are logged (the subflow, a merge task);
- :func:`log_failure` writes the run's one ``error:`` line there, before Prefect's own record of
  the exception.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Any
from collections.abc import Iterator

#: the logger of this package's own records
PACKAGE_LOGGER = "espnet3_flows"
#: the outer flow run of the job running in this context, and the API handler that sends to its log
_RUN: contextvars.ContextVar[tuple[Any, logging.Handler] | None] = contextvars.ContextVar("espnet3_flows_run_log",
                                                                                         default=None)


class _ToRun(logging.Filter):
    """Points a record that names no flow run at ``flow_run_id`` (Prefect's API log handler sends
    a record to the run its ``flow_run_id`` attribute names, else to the current context's)."""

    def __init__(self, flow_run_id: str):
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "flow_run_id", None):
            record.flow_run_id = self.flow_run_id
        return True


@contextlib.contextmanager
def run_log(flow_run: Any = None) -> Iterator[Any]:
    """Make ``flow_run`` (default: the current flow run; none outside a flow: nothing changes)
    the run whose log the job writes to, for the block. Nested calls keep the outermost run.

    Its ``espnet3_flows`` warnings and errors are sent to that run's log by an API log handler of
    their own, stamped with its id; one that ``PREFECT_LOGGING_EXTRA_LOGGERS`` attached (it sends
    to the current context's run: the subflow's) is set aside meanwhile, so each is sent once.
    The console is untouched.
    """
    if flow_run is None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        flow_run = ctx.flow_run if ctx is not None else None
    if flow_run is None or _RUN.get() is not None:
        yield (_RUN.get() or (None,))[0]
        return
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger(PACKAGE_LOGGER)
    extra = [h for h in logger.handlers if isinstance(h, APILogHandler)]
    ours = APILogHandler(level=logging.WARNING)
    ours.addFilter(_ToRun(str(flow_run.id)))
    for handler in extra:
        logger.removeHandler(handler)
    logger.addHandler(ours)
    token = _RUN.set((flow_run, ours))
    try:
        yield flow_run
    finally:
        _RUN.reset(token)
        logger.removeHandler(ours)
        for handler in extra:
            logger.addHandler(handler)


def job_logger() -> Any:
    """The logger of the job's own lines: the run logger of :func:`run_log`'s run, else the
    current flow or task run's (``get_run_logger``)."""
    current = _RUN.get()
    if current is None:
        from prefect import get_run_logger

        return get_run_logger()
    from prefect.logging.loggers import flow_run_logger

    return flow_run_logger(current[0])


def log_failure(line: str) -> None:
    """Send the run's ``error:`` line to :func:`run_log`'s run, by the handler that sends this
    package's records there (the API only: a command line prints its own, once). Nothing happens
    outside a run log."""
    current = _RUN.get()
    if current is not None:
        current[1].handle(logging.LogRecord(PACKAGE_LOGGER, logging.ERROR, __file__, 0, line, None, None))
