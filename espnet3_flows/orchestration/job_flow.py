"""A registered job as a Prefect flow: typed parameters (the UI's form), checked and resolved into
the job's config, the job run, and on failure its one ``error:`` line first in the run's log
(:mod:`~espnet3_flows.orchestration.run_log`)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any
from collections.abc import Sequence

from prefect import Flow, flow
from prefect.states import Failed

from espnet3_flows.config import ConfigError
from espnet3_flows.credentials import find_secrets, refuse_secrets, secrets_in_overrides
from espnet3_flows.errors import Espnet3FlowsError, clip_lines
from espnet3_flows.inputs.records import ManifestError
from espnet3_flows.orchestration.api_watch import end_flow_run_process, watching_api
from espnet3_flows.orchestration.deploy_steps import (PrefectApiLost, api_lost, is_api_lost, refuse_code_from_form,
                                                      refuse_transient, run_paths)
from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.orchestration.jobs import get_job, resolve_config
from espnet3_flows.orchestration.local_server import PrivateServerLost
from espnet3_flows.orchestration.parameters import dotted_values, form_fields
from espnet3_flows.orchestration.prefect_private.lifecycle import drop_undeliverable_api_work, quiet_failed_run_exit
from espnet3_flows.orchestration.run_log import log_failure, run_log


#: the parameters every job flow adds to its job's config keys
FLOW_ONLY_PARAMETERS = frozenset({"config", "overrides"})


@functools.cache
def job_flow(job: str) -> Flow:
    """The Prefect flow of a registered job. Its typed parameters (the UI's form) are the job's
    config keys (:func:`~espnet3_flows.orchestration.parameters.form_fields`: every key, sections
    as nested forms, credentials left out): each defaults to its key's default and wins over
    ``config`` (a YAML file, as the CLI's ``--config``) when it differs from it; ``overrides`` win
    over both. A flow module holds ``<job> = job_flow("<job>")``."""
    spec = get_job(job)
    schema = spec.config_class
    fields = form_fields(schema)
    taken = sorted(FLOW_ONLY_PARAMETERS & {f.name for f in fields})
    if taken:
        raise TypeError(f"job {job!r}: its config key(s) {', '.join(taken)} would hide the flow's own parameter(s) "
                        f"of that name ({', '.join(sorted(FLOW_ONLY_PARAMETERS))}): rename the key(s)")
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.annotation, default=f.default)
              for f in fields]
    params += [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=str | None, default=None),
               inspect.Parameter("overrides", inspect.Parameter.KEYWORD_ONLY, annotation=list[str] | None,
                                 default=None)]
    docs = [(f.name, f.doc) for f in fields]
    docs += [("config", "Optional YAML config file, as the command line's `--config` (on the worker's file system; "
                        "a relative path is in the run's working directory); the other parameters override it when "
                        "they differ from their defaults."),
             ("overrides", "Extra `key=value` overrides, e.g. `[\"parallel.options.queue=gpu\"]`; a credential, here "
                           "or in any parameter, is refused (give it to the worker's environment).")]

    def run(**values: Any) -> dict[str, Any]:
        with run_log():  # the job's lines, and its error line first, in this run's log
            try:
                return _run_flow_values(job, schema, values)
            except Exception as exc:
                if is_api_lost(exc) or isinstance(exc, PrefectApiLost):  # that run's log is out of reach
                    raise
                line = error_line(exc)
                log_failure(line)
                if isinstance(exc, Espnet3FlowsError) and _deployment_run():
                    # a failure on purpose (an input, the config, failed shards): the run ends Failed
                    # with that line, and its log is not ~50 lines of tracebacks of it (Prefect's,
                    # twice); a failed shard's traceback is in the log of the run's shards subflow
                    quiet_failed_run_exit()  # nor again as the flow-run process's "unexpected exception"
                    return Failed(message=line)
                raise

    run.__signature__ = inspect.Signature(params, return_annotation=dict[str, Any])  # type: ignore[attr-defined]
    run.__doc__ = spec.description + "\n\nArgs:\n" + "".join(
        f"    {name}: {' '.join(doc.split())}\n" for name, doc in docs)
    run.__name__ = run.__qualname__ = job
    return flow(run, name=spec.title, description=spec.description, log_prints=True)


def _run_flow_values(job: str, schema: type, values: dict[str, Any]) -> dict[str, Any]:
    """A job flow's body: its parameters checked (no credential, no code from the form, no path in
    a worker's temporary directory), resolved into the job's config, and the job run."""
    overrides = values.pop("overrides", None)
    config_file = values.pop("config", None)
    _refuse_secrets(schema, values, overrides)
    refuse_code_from_form(job, config_file, values, overrides)
    # a worker's run may still sit in the temporary directory the worker deletes afterwards
    refuse_transient({"config": config_file})
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


def _deployment_run(flow_run: Any = None) -> bool:
    """Whether ``flow_run`` (default: the current one) is a deployment's (triggered from the UI, a
    schedule, the API): its worker's flow-run process is no one's terminal."""
    if flow_run is None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        flow_run = ctx.flow_run if ctx else None
    return getattr(flow_run, "deployment_id", None) is not None


def show_progress(flow_run: Any = None) -> bool:
    """Whether a flow draws a terminal progress bar: only when started from a terminal, never
    in a deployment's run (the UI shows progress as an artifact).

    Args:
        flow_run: The flow run (default: the current one).
    """
    return sys.stderr.isatty() and not _deployment_run(flow_run)


def _refuse_secrets(schema: type, values: dict[str, Any], overrides: Sequence[str] | None) -> None:
    """Flow parameters are stored by the server in plain text and shown in the UI: a credential in
    any of them (a section's key such as ``parallel.options.env.AWS_SECRET_ACCESS_KEY``, or an
    override) is refused before it is used (the run fails, naming the key path)."""
    in_overrides = [f"{path} (in overrides)" for path in secrets_in_overrides(overrides or [], schema)]
    refuse_secrets(find_secrets(values, schema) + in_overrides)


#: Errors in what the user gave: exit status 2, one line, and no traceback file written
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ManifestError)


def error_line(exc: BaseException) -> str:
    """The one ``error:`` line of a failed run (its type named unless the user's input or the lost
    API is the cause: their messages say it all), inputs clipped where quoted."""
    plain = isinstance(exc, (*USER_ERRORS, PrefectApiLost, PrivateServerLost)) or is_api_lost(exc)
    return clip_lines(f"error: {exc}" if plain else f"error: {type(exc).__name__}: {exc}")
