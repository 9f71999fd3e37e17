"""What a command-line run does before its heavy imports (Prefect, Dask): read its config, then
launch the private Prefect API server, plan the run and start the forkserver its local workers are
forked from.

A local run's first shard waits for its workers, and a forked worker waits for the forkserver's
imports (Dask, Prefect's task engine, torch and the job's frontend: ~3.7 s of one core on the
2-core machine of ``benchmarks/``, ``startup``). Planned after the CLI's own imports, the
forkserver started ~1.3 s into the run; planned first (config, manifests, ``done`` records: no
Prefect needed), it starts ~0.4 s in, and its imports overlap the CLI's and the server's start.
The plan says whether any worker will be needed: a run whose shards all run in the driver
(``parallel.options.inline_shards``) starts no forkserver, and a run that has nothing to compute or merge
(a rerun) is finished right here: its summary printed and the process ended (``SystemExit``, status
0) before Prefect, Dask or torch is imported (~0.5 s on that machine instead of ~1.4 s).

:func:`start_early` is called by the flow scripts and ``python -m espnet3_flows`` before they
import anything else; it returns an :class:`EarlyRun` (the config, the launched server, the plan),
which they hand to :func:`~.entry.main` (``main(job, early=early)``). Log records of the early
steps are kept in it, for ``main`` to print once Prefect's console logging is set up (the console
shows them as it would have). A config the early step cannot read starts nothing: ``main`` reads
it again and reports it; a planning error is kept and raised by ``main`` where planning would have
raised it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator, Sequence

from espnet3_flows.orchestration.console import plain_console, print_summary, print_unchanged, quiet_workers_of
from espnet3_flows.orchestration.interrupt import exit_on_ctrl_c
from espnet3_flows.orchestration.local_server import LocalPrefectServer, launch_private_server
from espnet3_flows.timeline import mark

#: Command-line flags that change only the console (those that take no plan: :data:`NO_RUN_FLAGS`)
CONSOLE_FLAGS = ("-v", "--verbose")
#: Command-line flags of a command that runs nothing (help, a dry run, the config printed)
NO_RUN_FLAGS = ("-h", "--help", "--dry-run", "--print-config")


@dataclass
class EarlyRun:
    """A run planned by :func:`start_early`.

    Attributes:
        job: The job's name.
        argv: The command line's arguments it was planned from.
        cfg: The resolved config.
        planned: The plan (a :class:`~.job_run.PlannedFlow`), or ``None`` when planning raised.
        error: What planning raised (``main`` raises it where it would have planned).
        records: Log records emitted while reading the config and planning, to print once the
            console is set up.
        server: The private Prefect API server launched for the run (``None`` when an API is
            configured); :func:`~.local_server.prefect_api` takes it over or stops it.
    """

    job: str
    argv: tuple[str, ...]
    cfg: Any
    planned: Any = None
    error: BaseException | None = None
    records: list[logging.LogRecord] = field(default_factory=list)
    server: LocalPrefectServer | None = None

    @property
    def verbose(self) -> bool:
        """Whether the command line asked for every log line (``--verbose``)."""
        return any(a in CONSOLE_FLAGS for a in self.argv)

    def replay_logs(self) -> None:
        """Print the kept log records through the loggers' handlers as they are now configured
        (only those their logger is now enabled for), once."""
        records, self.records = self.records, []
        for record in records:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)


def start_early(job: str, argv: Sequence[str]) -> EarlyRun | None:
    """At a command line's start: read ``job``'s config from ``argv``, then launch the private API
    server (unless one is configured), plan the run, and start the forkserver when the plan needs
    local forked workers.

    Args:
        job: A registered job's name.
        argv: The command line's arguments after the job (flags and ``key=value`` overrides).

    Returns:
        The early run to hand to :func:`~.entry.main`, or ``None`` (help, a dry run, the config
        printed, or a config that cannot be read: nothing was started).

    Raises:
        SystemExit: (status 0) after printing the summary of a run with nothing to compute or
            merge: every shard done earlier and every split's outputs up to date.

    When ``argv`` is this process's own command line, a Ctrl-C from here on ends it in one line
    with status 130 (:mod:`.interrupt`); a caller's own list (a test's) leaves its Ctrl-C alone.
    """
    argv = tuple(argv)
    own = list(argv) == sys.argv[1:]  # this process's command line (not a caller's list, as a test's)
    if own:
        exit_on_ctrl_c(job, argv)  # one line and status 130, from here on
    if any(a in NO_RUN_FLAGS for a in argv):
        return None
    records: list[logging.LogRecord] = []
    with _kept_records(records):
        cfg = _read_config(job, argv)
    if cfg is None:
        return None
    early = EarlyRun(job, argv, cfg, records=records, server=launch_private_server())
    if own:
        exit_on_ctrl_c(job, argv, getattr(cfg, "output_dir", ""))
    with _kept_records(records):
        _plan(early)
    if early.planned is not None and early.planned.unchanged_summaries is not None:
        mark("planned")
        raise SystemExit(_finish_unchanged(early))
    if early.planned is not None:
        _start_workers(early)
    mark("planned")
    return early


def _finish_unchanged(early: EarlyRun) -> int:
    """What ``main`` prints for a run with nothing to compute, without importing Prefect: the
    planning's warnings (one line each unless ``--verbose``), the line and the summary."""
    if early.server is not None:
        early.server.stop()  # launched before planning: not needed
    plain_console(verbose=early.verbose)
    early.replay_logs()
    run = early.planned
    print_unchanged(early.job, run, early.cfg.output_dir)
    print_summary(early.job, run.unchanged_summaries, getattr(early.cfg, "storage_options", None))
    mark("summary_printed")
    return 0


class _Keep(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]):
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _kept_records(records: list[logging.LogRecord]) -> Iterator[None]:
    """Every log record of the block kept in ``records`` (this package's whatever their level:
    replayed where enabled once the console is set up), and none printed now (no "last resort"
    printing of warnings before the console is set up)."""
    root, ours = logging.getLogger(), logging.getLogger("espnet3_flows")
    keep, level = _Keep(records), ours.level
    root.addHandler(keep)
    ours.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        root.removeHandler(keep)
        ours.setLevel(level)


def _read_config(job: str, argv: tuple[str, ...]) -> Any:
    """The job's config from the command line, or ``None`` when it cannot be read (``main`` reads
    it again and reports it)."""
    from espnet3_flows.config import split_cli_args
    from espnet3_flows.orchestration.jobs import resolve_config

    try:
        path, overrides = split_cli_args([a for a in argv if a not in CONSOLE_FLAGS])
        return resolve_config(job, path, {}, overrides)
    except Exception:  # noqa: BLE001 - main() reads the config again and reports it
        return None


def _plan(early: EarlyRun) -> None:
    """Plan ``early``'s run into it (or keep what planning raised, for ``main`` to raise)."""
    from espnet3_flows.orchestration.job_run import plan_job
    from espnet3_flows.orchestration.jobs import preflight

    try:
        preflight(early.job, early.cfg)
        early.planned = plan_job(early.job, early.cfg)
        early.planned.worker_environ = quiet_workers_of(early.cfg.parallel.backend, early.verbose)
    except Exception as exc:  # noqa: BLE001 - raised by main() where it plans
        early.error = exc


def _start_workers(early: EarlyRun) -> None:
    """Start the forkserver for a plan whose pending shards run on local forked workers, with the
    early server's URL and the run's worker variables in its environment (as the workers will see
    them); nothing is imported here."""
    from espnet3_flows.orchestration.task_runner import prestart_workers

    run = early.planned
    if run.pending_shards:
        url = {"PREFECT_API_URL": early.server.api_url} if early.server is not None else {}
        prestart_workers(run.parallel, run.worker_modules, run.pending_shards, here=False,
                         environ={**run.worker_environ, **url})
