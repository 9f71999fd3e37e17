"""The user-facing flows (typed parameters for the Prefect UI) and the command-line entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
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
from prefect import Flow, flow

from espnet3_flows.config import ConfigError, describe_keys, split_cli_args
from espnet3_flows.deadlines import is_outage
from espnet3_flows.errors import clip_lines
from espnet3_flows.inputs.records import ManifestError
from espnet3_flows.credentials import find_secrets, mask_secrets, refuse_secrets, secrets_in_overrides
from espnet3_flows.orchestration.api_watch import end_flow_run_process, watching_api
from espnet3_flows.orchestration.console import (print_summary, print_unchanged, quiet_console, quiet_workers_of,
                                                 restore_worker_environment)
from espnet3_flows.orchestration.deploy_steps import (api_lost, is_api_lost, refuse_code_from_form, refuse_transient,
                                                      run_paths)
from espnet3_flows.orchestration.dry_run import dry_run
from espnet3_flows.orchestration.early_start import CONSOLE_FLAGS, take_early_run
from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.orchestration.job_run import PlannedFlow, plan_job
from espnet3_flows.orchestration.jobs import get_job, preflight, resolve_config
from espnet3_flows.orchestration.local_server import PrivateServerLost, prefect_api
from espnet3_flows.orchestration.parameters import dotted_values, form_fields
from espnet3_flows.orchestration.prefect_compat import drop_undeliverable_api_work, quiet_shipper_failures
from espnet3_flows.orchestration.task_runner import prestart_workers
from espnet3_flows.timeline import mark
from espnet3_flows.storage import StorageError

@functools.cache
def job_flow(job: str) -> Flow:
    """The Prefect flow of a registered job. Its typed parameters (the UI's form) are the job's
    config keys (:func:`~espnet3_flows.orchestration.parameters.form_fields`: every key, sections
    as nested forms, credentials left out): each defaults to its key's default and wins over
    ``config_file`` when it differs from it; ``overrides`` win over both. A flow module holds
    ``<job> = job_flow("<job>")``."""
    spec = get_job(job)
    schema = spec.config_class
    fields = form_fields(schema)
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.annotation, default=f.default)
              for f in fields]
    params += [inspect.Parameter("config_file", inspect.Parameter.KEYWORD_ONLY, annotation=str | None, default=None),
               inspect.Parameter("overrides", inspect.Parameter.KEYWORD_ONLY, annotation=list[str] | None,
                                 default=None)]
    docs = [(f.name, f.doc) for f in fields]
    docs += [("config_file", "Optional YAML config (on the worker's file system); the other parameters override "
                             "it when they differ from their defaults."),
             ("overrides", "Extra `key=value` overrides, e.g. `[\"parallel.options.queue=gpu\"]`; a credential, here "
                           "or in any parameter, is refused (give it to the worker's environment).")]

    def run(**values: Any) -> dict[str, Any]:
        overrides = values.pop("overrides", None)
        config_file = values.pop("config_file", None)
        _refuse_secrets(schema, values, overrides)
        refuse_code_from_form(job, config_file, values, overrides)
        # a worker's run may still sit in the temporary directory the worker deletes afterwards
        refuse_transient({"config_file": config_file})
        cfg = resolve_config(job, config_file, dotted_values(schema, values), overrides or [],
                             check=lambda merged: refuse_transient(run_paths(merged)))
        try:
            with watching_api():  # a lost server ends the run in bounded time, after its merges
                return run_job(job, cfg, progress=show_progress())  # validated once, above
        except Exception as exc:  # only the API's loss is translated
            if is_api_lost(exc):  # after the client's own retries, or noticed by the watch
                drop_undeliverable_api_work()
                if os.environ.get("PREFECT__FLOW_RUN_ID"):  # a worker's flow-run process: nothing can
                    end_flow_run_process(exc)  # reach the server now (its state, events): one line, exit 1
                raise api_lost(exc) from exc
            raise

    run.__signature__ = inspect.Signature(params, return_annotation=dict[str, Any])  # type: ignore[attr-defined]
    run.__doc__ = spec.description + "\n\nArgs:\n" + "".join(
        f"    {name}: {' '.join(doc.split())}\n" for name, doc in docs)
    run.__name__ = run.__qualname__ = job
    return flow(run, name=spec.title, description=spec.description, log_prints=True)


def show_progress(flow_run: Any = None) -> bool:
    """Whether a flow draws a terminal progress bar: only when started from a terminal, never
    in a deployment's run (a worker's flow-run process: its output is no one's terminal, and
    the UI shows progress as an artifact).

    Args:
        flow_run: The flow run (default: the current one).
    """
    if flow_run is None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        flow_run = ctx.flow_run if ctx else None
    return sys.stderr.isatty() and getattr(flow_run, "deployment_id", None) is None


def _refuse_secrets(schema: type, values: dict[str, Any], overrides: Sequence[str] | None) -> None:
    """Flow parameters are stored by the server in plain text and shown in the UI: a credential in
    any of them (a section's key such as ``parallel.options.env.AWS_SECRET_ACCESS_KEY``, or an
    override) is refused before it is used (the run fails, naming the key path)."""
    in_overrides = [f"{path} (in overrides)" for path in secrets_in_overrides(overrides or [], schema)]
    refuse_secrets(find_secrets(values, schema) + in_overrides)


def main(job: str, argv: Sequence[str] | None = None) -> int:
    """``python flows/<job>.py [--config FILE] [key=value ...]``: run locally, print a summary.

    With no Prefect server configured, a private local API server is started for the run and
    stopped afterwards. The flow scripts launch it, plan the run and start its local workers'
    forkserver before their own imports (:func:`~.early_start.start_early`); the plan is taken
    over here. This process's environment is as it was before once it returns (a caller that goes
    on, and every process it starts later, keep their own logging).
    """
    try:
        return _main(job, argv)
    finally:
        restore_worker_environment()  # quieted for this run's local workers (here or by start_early)


def _main(job: str, argv: Sequence[str] | None) -> int:
    mark("main")
    logging.basicConfig(level=logging.WARNING)
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(usage(job))
        return 0
    dry = "--dry-run" in args
    print_config = "--print-config" in args
    verbose = any(a in CONSOLE_FLAGS for a in args)
    # a configured API server (env or profile) outlives the run: its UI links are worth printing
    run_links = bool(prefect.settings.get_current_settings().api.url)
    if not verbose:
        quiet_console(run_links)
    early = take_early_run(job, args)  # planned by the flow script before its imports (start_early)
    args = [a for a in args if a not in ("--dry-run", "--print-config", *CONSOLE_FLAGS)]
    try:
        cfg = early.cfg if early is not None else _resolve(job, args, dry)
        if print_config:  # the merged config as YAML (credentials redacted), usable as --config
            print(OmegaConf.to_yaml(OmegaConf.create(mask_secrets(cfg))), end="")
            return 0
        if dry:
            return dry_run(job, cfg)
        quiet_workers_of(cfg.parallel.backend, verbose)  # workers on this machine: the same quiet rules there
    except Exception as exc:  # noqa: BLE001 - a config, manifest or storage error: one line
        return _report(exc, verbose)
    return _run(job, cfg, early, verbose, run_links)


def _resolve(job: str, args: Sequence[str], dry_run: bool) -> Any:
    """The job's config from ``--config FILE`` and ``key=value`` overrides (no demo for a dry run)."""
    path, overrides = split_cli_args(list(args))
    from espnet3_flows.inputs.demo import demo_not_generated  # (soundfile, fsspec: not at import)

    with demo_not_generated() if dry_run else contextlib.nullcontext():
        return resolve_config(job, path, {}, overrides)


def _run(job: str, cfg: Any, early: Any, verbose: bool, run_links: bool) -> int:
    """Plan (or take the early plan) while the private API server starts, run the flow, print
    the summary; the exit status."""
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
        needed = run.unchanged_summaries is None
        if needed and run.pending_shards:
            prestart_workers(cfg.parallel, run.worker_modules, run.pending_shards)
        if early is None:
            mark("planned")
        return needed

    try:
        # a private server even for serial runs: Prefect's own temporary one would start only now
        with prefect_api(needs_server=True, while_starting=plan_now) as api:
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
    import os
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
    import os

    from espnet3_flows.patches import patches_enabled

    if _API_LOST.is_set():
        _end_anyway_after(LOST_API_EXIT_SECONDS, status)
    if not patches_enabled():  # the interpreter's own exit, teardown included
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


#: Errors in what the user gave: exit status 2, one line, and no traceback file written
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ManifestError)


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
    line = f"error: {exc}" if users or lost else f"error: {type(exc).__name__}: {exc}"
    if lost:  # that shipper ended its last failure without a newline
        line = "\n" + line
    print(clip_lines(line), file=sys.stderr)  # inputs are clipped where quoted; a library's text here
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

    from espnet3_flows.utterance_job import EngineConfig

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

