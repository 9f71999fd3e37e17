"""The command-line entry point (``python flows/<job>.py``, ``python -m espnet3_flows``); the flow scripts
also take their flows from here (:func:`~espnet3_flows.orchestration.job_flow.job_flow`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import textwrap
import threading
import traceback
from typing import Any, NoReturn
from collections.abc import Sequence

import prefect.settings
from omegaconf import OmegaConf

from espnet3_flows.config import describe_keys, split_cli_args
from espnet3_flows.deadlines import is_outage
from espnet3_flows.errors import clip_lines
from espnet3_flows.credentials import mask_secrets
from espnet3_flows.orchestration.console import print_summary, print_unchanged, quiet_console, quiet_workers_of
from espnet3_flows.orchestration.deploy_steps import api_lost, is_api_lost
from espnet3_flows.orchestration.dry_run import dry_run
from espnet3_flows.orchestration.early_start import CONSOLE_FLAGS, EarlyRun
from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.orchestration.job_run import PlannedFlow, plan_job
from espnet3_flows.orchestration.job_flow import USER_ERRORS, error_line, job_flow  # noqa: F401 (the flow scripts')
from espnet3_flows.orchestration.jobs import get_job, preflight, resolve_config
from espnet3_flows.orchestration.local_server import PrivateServerLost, prefect_api
from espnet3_flows.orchestration.prefect_private.lifecycle import drop_undeliverable_api_work, quiet_shipper_failures
from espnet3_flows.orchestration.task_runner import prestart_workers
from espnet3_flows.timeline import mark
from espnet3_flows.storage import StorageError

def main(job: str, argv: Sequence[str] | None = None, early: EarlyRun | None = None) -> int:
    """``python flows/<job>.py [--config FILE] [key=value ...]``: run locally, print a summary.

    With no Prefect server configured, a private local API server is started for the run and
    stopped afterwards. The flow scripts read the config, launch that server, plan the run and
    start its local workers' forkserver before their own imports
    (:func:`~.early_start.start_early`) and hand that ``early`` run over; the run goes on from
    there. This process's environment is not changed for the run's local workers (they are told
    at their start): a caller that goes on, and every process it starts later, keep their own
    logging.

    Args:
        job: A registered job's name.
        argv: The command line's arguments after the script (this process's by default).
        early: What :func:`~.early_start.start_early` returned for ``job`` and the same ``argv``.
    """
    if early is not None and (early.job != job or (argv is not None and early.argv != tuple(argv))):
        raise ValueError(f"the early run of {early.job} {' '.join(early.argv)!r} is not this command line's")
    return _main(job, argv, early)


def _main(job: str, argv: Sequence[str] | None, early: EarlyRun | None) -> int:
    mark("main")
    logging.basicConfig(level=logging.WARNING)
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(usage(job))
        return 0
    dry = "--dry-run" in args
    print_config = "--print-config" in args
    verbose = any(a in CONSOLE_FLAGS for a in args)
    # a configured API server (environment or profile) outlives the run: its UI links are worth printing
    run_links = bool(prefect.settings.get_current_settings().api.url)
    if not verbose:
        quiet_console(run_links)
    args = [a for a in args if a not in ("--dry-run", "--print-config", *CONSOLE_FLAGS)]
    try:
        cfg = early.cfg if early is not None else _resolve(job, args, dry)
        if print_config:  # the merged config as YAML (credentials redacted), usable as --config
            print(OmegaConf.to_yaml(OmegaConf.create(mask_secrets(cfg))), end="")
            return 0
        if dry:
            return dry_run(job, cfg)
        quiet_workers = quiet_workers_of(cfg.parallel.backend, verbose)  # workers on this machine: the same rules
    except Exception as exc:  # noqa: BLE001 - a config, manifest or storage error: one line
        return _report(exc, verbose)
    return _run(job, cfg, early, verbose, run_links, quiet_workers)


def _resolve(job: str, args: Sequence[str], dry_run: bool) -> Any:
    """The job's config from ``--config FILE`` and ``key=value`` overrides (no demo for a dry run)."""
    path, overrides = split_cli_args(list(args))
    from espnet3_flows.inputs.demo import demo_not_generated  # (soundfile, fsspec: not at import)

    with demo_not_generated() if dry_run else contextlib.nullcontext():
        return resolve_config(job, path, {}, overrides)


def _run(job: str, cfg: Any, early: EarlyRun | None, verbose: bool, run_links: bool,
         quiet_workers: dict[str, str]) -> int:
    """Plan (or take the early plan) while the private API server starts, run the flow, print
    the summary; the exit status. ``quiet_workers``: what the run's local workers start with
    (:func:`~.console.quiet_workers_of`)."""
    planned: list[PlannedFlow] = []

    def plan_now() -> bool:  # overlaps the private API server's start
        if early is None:
            preflight(job, cfg)
            planned.append(plan_job(job, cfg))
        else:
            early.replay_logs()
            if early.error is not None:
                raise early.error
            planned.append(early.planned)
        run = planned[0]
        run.worker_environ = quiet_workers
        needed = run.unchanged_summaries is None
        if needed and run.pending_shards:
            prestart_workers(cfg.parallel, run.worker_modules, run.pending_shards, environ=quiet_workers)
        if early is None:
            mark("planned")
        return needed

    try:
        # a private server even for serial runs: Prefect's own temporary one would start only now
        with prefect_api(needs_server=True, while_starting=plan_now,
                         server=early.server if early is not None else None) as api:
            run = planned[0]
            if api is False:  # nothing to compute or merge: no server, no flow, no cluster
                summaries = run.unchanged_summaries or {}
                print_unchanged(job, run, cfg.output_dir)
            else:
                if not verbose:
                    quiet_console(run_links)  # handlers configured since (Dask's, on import)
                summaries = run_job(job, planned=run)
    except Exception as exc:  # noqa: BLE001 - the CLI prints one line; the traceback is in the logs
        status = _report(exc, verbose)
        if status == 1 and not verbose:
            # not onto a store that is itself failing (its retries would only delay the exit)
            outage = isinstance(exc, (OSError, StorageError)) or is_outage(exc)
            saved = None if outage else _save_traceback(job, cfg)
            where = f"the traceback is in {saved}; " if saved else ""
            print(f"       ({where}--verbose prints it and every log line)", file=sys.stderr)
        return status
    print_summary(job, summaries, getattr(cfg, "storage_options", None))
    mark("summary_printed")
    return 0


#: How long the exit of a command line whose Prefect API was lost may take: Prefect's exit
#: handlers try to deliver what they still queue to the server that is gone (each event waits for
#: a connection; with every patch off, Prefect 3.8.8's events drain was seen to wait forever), and
#: nothing of that can arrive. The outputs are written by then; the process ends anyway.
LOST_API_EXIT_SECONDS = 20.0
_API_LOST = threading.Event()  # set by the run's error report (_report), read by exit_now


def _end_anyway_after(seconds: float, status: int) -> None:
    """End this process with ``status`` in ``seconds``, whatever its exit is waiting on then."""
    import time

    def end() -> None:
        time.sleep(seconds)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    threading.Thread(target=end, name="end-after-lost-api", daemon=True).start()


def exit_now(status: int) -> NoReturn:
    """End the command-line process with ``status``: its exit handlers run (a private server
    stopped, logs flushed) and its other threads are joined as at a normal exit, but the
    interpreter's teardown of every imported module (~0.9 s with torch, Prefect and Dask loaded,
    after the summary is printed) is skipped. For the CLI's own process only (``flows/<job>.py``,
    ``python -m espnet3_flows``, the console scripts); :func:`main` itself returns. After a run
    that lost its Prefect API the exit takes at most :data:`LOST_API_EXIT_SECONDS`."""
    import atexit

    from espnet3_flows.patches import patches_enabled

    if _API_LOST.is_set():
        _end_anyway_after(LOST_API_EXIT_SECONDS, status)
    if not patches_enabled("exit_now"):  # the interpreter's own exit, teardown included
        sys.exit(status)
    # what the interpreter does first at exit: thread pools told to stop, other threads joined
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _report(exc: BaseException, verbose: bool) -> int:
    """Print the one ``error:`` line (with ``--verbose`` also the traceback); the exit status:
    2 for an error in what the user gave (the config, a manifest: :data:`USER_ERRORS`), 1 for a
    run that failed."""
    users = isinstance(exc, USER_ERRORS)
    lost = is_api_lost(exc) or isinstance(exc, PrivateServerLost)
    if lost:
        _API_LOST.set()  # a command line's exit is bounded (exit_now)
        quiet_shipper_failures()  # (this process exits next: nothing to put back)
        drop_undeliverable_api_work()  # else the exit waits ~7 s per queued event for the dead server
        exc = exc if isinstance(exc, PrivateServerLost) else api_lost(exc)  # (that one names its log)
    line = error_line(exc)
    if lost:  # that shipper ended its last failure without a newline
        line = "\n" + line
    print(line, file=sys.stderr)
    if verbose:
        traceback.print_exc()
    return 2 if users else 1


def _save_traceback(job: str, cfg: Any) -> str | None:
    """Write the exception being handled, with its traceback, to
    ``<output_dir>/logs/<job>-<UTC time>.error.txt``; its location, or None if it could not be
    written (an output that is itself the problem)."""
    import datetime

    from espnet3_flows.storage import Storage

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    rel = f"logs/{job}-{stamp}.error.txt"
    try:
        store = Storage(cfg.output_dir, cfg.storage_options)
        store.write_text(rel, clip_lines(traceback.format_exc()))
        return store.uri(rel)
    except Exception:  # noqa: BLE001 - best effort: the error line was printed already
        return None


def usage(job: str) -> str:
    """Help text: the command line form, then every config key with its default and the first
    sentence of its description (from the config dataclasses' docstrings)."""
    schema = get_job(job).config_class
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    docs = describe_keys(schema)
    lines = [f"usage: python flows/{job}.py [--config FILE] [--dry-run] [--print-config] [--verbose] [key=value ...]",
             f"       (also: python -m espnet3_flows {job} ..., espnet3-{job.replace('_', '-')} ...)", "",
             "  --config FILE  a YAML file of these keys (examples in conf/); key=value overrides win",
             "  --dry-run      check the config, plan every split and print what a run would compute and on",
             "                 which cluster (no server, no cluster started, no outputs published)",
             "  --print-config print the merged config (file < overrides, credentials redacted) as YAML and exit",
             "  --verbose      print every log line (Dask, Prefect's engines) and tracebacks; by default the",
             "                 console shows this project's messages, warnings and one `error:` line", "",
             "  where shards run (parallel.env; docs/configuration.md, Parallel configuration):",
             "    parallel.env=local parallel.n_workers=8               a local cluster of 8 processes",
             "    parallel.env=slurm parallel.options.queue=gpu         SLURM jobs (dask-jobqueue)",
             "    parallel.env=ssh 'parallel.options.hosts=[head,node1,node2]'   workstations over SSH",
             "    parallel.env=serial                                   this process, no Dask", "",
             "  your data (a TSV of utt_id, path[, text[, speaker]], a Kaldi data directory or lhotse cuts):",
             "    manifests.train=data/train.tsv manifests.dev=data/dev output_dir=exp/mine", "",
             "keys (default): the first sentence of each; docs/configuration.md has the whole text:"]

    from espnet3_flows.job_config import EngineConfig

    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    # the job's own keys first, the engine's (every job's) after them
    ordered = {k: v for k, v in defaults.items() if k not in engine}
    ordered.update((k, v) for k, v in defaults.items() if k in engine)

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value and key not in ("options", "adapt", "model"):
                walk(value, f"{prefix}{key}.")
            else:
                lines.append(f"  {prefix}{key}={json.dumps(value)}")
                text = first_sentence(docs.get(f"{prefix}{key}", ""))
                if text:
                    lines.extend(textwrap.wrap(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                               break_on_hyphens=False))

    walk(ordered, "")
    return "\n".join(lines)


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")


def plain_text(text: str) -> str:
    """A docstring's text for a terminal: Sphinx roles as their names (``:class:`~a.B``` -> ```B```)
    and double backquotes single."""
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return text.replace("``", "`")


def first_sentence(text: str) -> str:
    """The whole first sentence of ``text`` (an abbreviation's period ends none), as plain text."""
    text = plain_text(" ".join(text.split()))
    for match in re.finditer(r"\.(?=\s)", text):
        if not text[:match.end()].endswith(_ABBREVIATIONS):
            return text[:match.end()]
    return text

