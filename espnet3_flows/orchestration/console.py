"""What a command-line run prints: the project's own messages, warnings and one ``error:`` line,
and the run's summary (:func:`print_summary`, :func:`print_unchanged`).

A CLI run on a local cluster would otherwise print Dask's INFO chatter (cluster start, worker
registration: ~36 lines per run), Prefect's per-task-run state lines, and, when something
fails, the same exception as a traceback from the task engine on the worker, from the flow
engine on the driver and from Dask (~150 lines around the one line that says what is wrong).
:func:`quiet_console` keeps on the console only

- records logged by this package (progress, per-split summaries),
- warnings and errors of everything else (a model's own, through ``get_run_logger`` too), except
  the state reports of Prefect's flow and task engines (``Finished in state Failed(...)`` once per failed shard and again for the flow: the
  CLI prints the outcome itself, once, as ``error: ...``) and Dask's warnings about failed
  computations (the same failure again), and a Dask worker's failed heartbeat (a race of
  Dask's own when the cluster closes: the scheduler goes first; a scheduler lost mid-run fails
  the run with its own ``error:`` line), and the ``Still processing items: N items remaining``
  of Prefect's event and log queues draining at the process's exit (on a busy machine a run's
  last events are still queued when it ends; they are still sent, and the line says nothing a
  user can act on),

each as one line, without its traceback, and Prefect's link to the flow run in the UI when the
API is a server of the user's. Only the console changes: Prefect's API log handler
still sends every record, tracebacks included, to the server, and ``--verbose`` keeps it all.

A run's local worker processes apply the same rules: the run object carries what they start
with (:func:`quiet_worker_environ`: :data:`QUIET_VAR`, read by the forkserver they are forked from,
and Dask's own logging level, read by a spawned worker when it imports Dask), and Prefect's worker
setup quiets each worker of a quiet run. Only for clusters on this machine: jobs on a scheduler
(SLURM) keep full logs in their own log files. Nothing of it goes through this process's own
environment.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from pathlib import Path
from typing import Any
from collections.abc import Iterator

QUIET_VAR = "ESPNET3_FLOWS_QUIET"
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
#: what ``distributed.worker`` logs at ERROR when a heartbeat meets a closed scheduler
_HEARTBEAT_RACE = "Failed to communicate with scheduler during heartbeat"


@functools.lru_cache(maxsize=256)
def _source(pathname: str) -> str:
    """``ours``, ``prefect`` or ``other``: where a record was logged from (symlinks resolved)."""
    real = os.path.realpath(pathname)
    if real.startswith(_PACKAGE_DIR):
        return "ours"
    import prefect

    return "prefect" if real.startswith(os.path.dirname(os.path.realpath(prefect.__file__)) + os.sep) else "other"


class _QuietFilter(logging.Filter):
    """Drops what the module docstring says a quiet console does not show."""

    def __init__(self, run_links: bool):
        super().__init__()
        self.run_links = run_links

    def filter(self, record: logging.LogRecord) -> bool:
        source = _source(record.pathname)
        if source == "ours" or record.name.startswith("espnet3_flows"):
            return True
        if record.name.startswith(_ENGINE_LOGGERS):
            if source == "prefect":
                # the engines' run states and failures: the CLI reports the outcome itself; the
                # link to the run in the UI only where a server outlives the run
                return self.run_links and record.getMessage().startswith("View at ")
            return record.levelno >= logging.WARNING  # user code (a model) through get_run_logger
        if record.name.startswith("distributed"):
            return _dask_line_shown(record)
        return record.levelno >= logging.WARNING


def _dask_line_shown(record: logging.LogRecord) -> bool:
    """A quiet console's rule for Dask's own records: errors, but the heartbeat race."""
    return record.levelno >= logging.ERROR and not record.getMessage().startswith(_HEARTBEAT_RACE)


class _OneLineFormatter(logging.Formatter):
    """The wrapped formatter's line, without traceback or stack (the record itself is left
    intact for the other handlers, e.g. Prefect's API handler)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        bare = copy.copy(record)
        bare.exc_info = bare.exc_text = bare.stack_info = None
        return self.inner.format(bare).splitlines()[0] if record.getMessage() else ""


def _console_handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    found: dict[int, logging.Handler] = {}
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                    and stream is not None and getattr(stream, "name", "") in ("<stderr>", "<stdout>"):
                found[id(handler)] = handler
    return list(found.values())


#: Prefect's queue services that drain at interpreter exit (their loggers' names), and the line
#: each logs every 4 s while items remain then
_EXIT_DRAINS = ("EventsWorker", "APILogWorker")
_DRAIN_PROGRESS = "Still processing items"


class _DrainProgressFilter(logging.Filter):
    """Drops the exit-time drain progress line of a Prefect queue service (its other records stay)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_DRAIN_PROGRESS)


def quiet_console(run_links: bool = False) -> None:
    """Apply the quiet rules to every console handler of this process (idempotent).

    The drain progress of Prefect's queues is dropped at its loggers, for the rest of the process:
    it is logged at the interpreter's exit, after :func:`quiet_during` has given the handlers
    back.

    Args:
        run_links: keep Prefect's ``View at <UI URL>`` line of each run (when the API is a
            server the user runs; a private server's links are dead once the run ends).
    """
    for name in _EXIT_DRAINS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DrainProgressFilter) for f in logger.filters):
            logger.addFilter(_DrainProgressFilter())
    for handler in _console_handlers():
        if not any(isinstance(f, _QuietFilter) for f in handler.filters):
            handler.addFilter(_QuietFilter(run_links))
        if not isinstance(handler.formatter, _OneLineFormatter):
            handler.setFormatter(_OneLineFormatter(handler.formatter))


@contextlib.contextmanager
def quiet_during(run_links: bool = False) -> Iterator[None]:
    """:func:`quiet_console` for the duration of a block (a user's script calling ``runner_flow``);
    afterwards every console handler has its own filters and formatter back. Handlers configured
    during the block (Dask's, when it is imported) are quieted by calling :func:`quiet_console`
    again inside it, and restored here as well. (The run's local workers are quieted by what
    they start with: :func:`quiet_worker_environ`.)"""
    quiet_console(run_links)
    try:
        yield
    finally:
        for handler in _console_handlers():
            for f in [f for f in handler.filters if isinstance(f, _QuietFilter)]:
                handler.removeFilter(f)
            if isinstance(handler.formatter, _OneLineFormatter):
                handler.setFormatter(handler.formatter.inner)


class _ClusterChatterFilter(logging.Filter):
    """Drops what a cluster this package starts adds to a console that is not its own: Dask's
    INFO and WARNING lines (cluster start, worker registration) and the Dask task runner's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("distributed"):
            return _dask_line_shown(record)
        return not (record.name.startswith("prefect.task_runner") and record.levelno < logging.WARNING)


@contextlib.contextmanager
def quiet_cluster_during() -> Iterator[None]:
    """Inside a user's flow, whose console is theirs (its lines, Prefect's, their logging): for the
    block, only the chatter of the Dask cluster this package starts is dropped (driver side:
    :class:`_ClusterChatterFilter` on every console handler; local workers quiet, as a command
    line's, by what they start with); afterwards the handlers are as they were."""
    import distributed  # noqa: F401 - Dask adds its console handler on import: it is filtered too

    added = [(handler, _ClusterChatterFilter()) for handler in _console_handlers()
             if not any(isinstance(f, _ClusterChatterFilter) for f in handler.filters)]
    for handler, f in added:
        handler.addFilter(f)
    try:
        yield
    finally:
        for handler, f in added:
            handler.removeFilter(f)


def plain_console(verbose: bool = False) -> None:
    """The console of a command line that ends before importing Prefect (a rerun with nothing to
    compute): warnings and errors, as Prefect's console prints them, one line each unless
    ``verbose``. Nothing changes where logging is configured already."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=logging.WARNING, datefmt="%H:%M:%S",
                        format="%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s")
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.setFormatter(_OneLineFormatter(handler.formatter))


class _CompletedShardFilter(logging.Filter):
    """Drops the task engine's ``Finished in state Completed()`` of shard tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and getattr(record, "task_name", None) == SHARD_TASK
                    and record.getMessage().startswith("Finished in state Completed"))


#: The name of the shard tasks (``orchestration.shard_tasks``)
SHARD_TASK = "shard"


def quiet_completed_shards() -> None:
    """Make Prefect's task engine in this process log nothing when a shard task completes
    (idempotent): in a run of thousands of shards those lines are the whole log, each one also a
    log record the API server writes, and the task run's state already says it. Retries,
    failures, warnings and what a runner logs itself stay."""
    logger = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, _CompletedShardFilter) for f in logger.filters):
        logger.addFilter(_CompletedShardFilter())


#: Dask's logging level for ``distributed`` in a new process (its config from the environment):
#: a spawned worker logs its start banner when it imports Dask, before any setup of ours runs
DASK_LOG_VAR = "DASK_LOGGING__DISTRIBUTED"


def quiet_worker_environ(quiet: bool = True) -> dict[str, str]:
    """The variables a run's local worker processes start with to be quiet (none when not
    ``quiet``): :data:`QUIET_VAR`, which the forkserver's last preload reads
    (:func:`apply_from_environment`: every worker forked from it starts quiet), and Dask's
    ``distributed`` logging at ``warning`` for spawned workers, unless the user set a level.

    They go to the workers' processes only, as they start (the forkserver's start, the cluster's
    ``env``); this process's environment is never changed."""
    if not quiet:
        return {}
    return {QUIET_VAR: "1", **({} if DASK_LOG_VAR in os.environ else {DASK_LOG_VAR: "warning"})}


def quiet_workers_of(backend: Any, verbose: bool) -> dict[str, str]:
    """A command line's rule, as what its local workers start with (:func:`quiet_worker_environ`):
    quiet unless ``verbose`` when they print to its terminal (``backend`` runs them in process or
    on this machine); batch-scheduler jobs keep their full logs in their own files."""
    return quiet_worker_environ(not verbose and backend.output_here)


def apply_from_environment() -> None:
    """In the forkserver of a run's local workers: be quiet if the run started it so
    (:func:`quiet_worker_environ`)."""
    if os.environ.get(QUIET_VAR, "").startswith("1"):
        quiet_console()


def print_unchanged(job: str, run: Any, output_dir: str) -> None:
    """The line of a run that has nothing to compute or merge (``run`` a
    :class:`~.job_run.PlannedFlow` whose ``unchanged_summaries`` is set): no server, flow or
    cluster was started."""
    print(f"{job}: nothing to compute: all {run.total_shards} shard(s) of {len(run.runners)} split(s) "
          f"were done earlier (planned in {run.plan_seconds:.1f} s); outputs in {output_dir}")


def print_summary(job: str, summaries: dict[str, Any], storage_options: dict[str, Any] | None) -> None:
    """The CLI's closing summary: per split its utterances, audio, shards computed and cached,
    the location of its ``summary.json`` and its warnings (credentials in ``storage_options``
    redacted)."""
    from espnet3_flows.storage import redact

    options = redact(storage_options or {})
    print(f"\n{job} finished" + (f" (storage options: {options})" if options else ""))
    for split, s in summaries.items():
        print(f"  {split}: {s.get('utterances')} utterances, {s.get('seconds', 0):.1f} s of audio, "
              f"shards computed {s.get('shards_computed')} / cached {s.get('shards_cached')}, "
              f"skipped {s.get('skipped')}")
        if s.get("files", {}).get("summary.json"):
            print(f"    {s['files']['summary.json']}")
        for warning in s.get("warnings", []):
            print(f"    warning: {warning}")
