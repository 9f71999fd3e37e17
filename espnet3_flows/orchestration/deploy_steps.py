"""A deployment's flow run on a worker: the pull step that picks its working directory (``pull:``
in ``deployments/prefect.yaml``), the check that keeps a run from writing into a directory the
worker deletes, the check that keeps its form's parameters from naming code (and the pull step
that opens keys to them), and the one line a run ends with when its Prefect API server is gone.

Prefect 3.8's process worker starts every flow run in a fresh ``tempfile.TemporaryDirectory``
(``/tmp/tmp…prefect``) and removes it when the run ends; the run inherits the worker's environment,
not its working directory. A relative ``output_dir`` taken there is gone after a run that reports
Completed. So the pull step chooses a lasting directory and names it in the run's log, and the
flow refuses relative paths when it still runs in such a temporary directory (a deployment made
without this pull step, or a worker whose start directory cannot be read).

One rule for relative paths in a run's ``manifests``, ``output_dir`` and ``config``: they
resolve in the flow process's working directory, on the driver, when the run starts (the config
file is read there, the planner makes manifests absolute, fsspec makes ``output_dir`` absolute).
For the command line that is the current directory; for a deployment run it is the directory
chosen here.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil

from espnet3_flows.code_keys import refuse_untrusted_code
from espnet3_flows.errors import causes, clip
from espnet3_flows.orchestration.jobs import get_job, merged_data
from espnet3_flows.orchestration.parameters import dotted_values

log = logging.getLogger(__name__)

#: The worker's environment variable naming the flow runs' working directory
WORKDIR_VAR = "ESPNET3_FLOWS_WORKDIR"
#: Names of the per-run directories Prefect's process worker makes under the temp root and
#: removes after the run (``TemporaryDirectory(suffix="prefect")``, the workspace supervisor's)
_TRANSIENT_NAMES = ("tmp*prefect", "prefect-workspace-attempt-*")


def working_directory(directory: str | None = None) -> dict[str, str]:
    """Pull step: the flow run's working directory, where relative paths in its parameters
    (``manifests``, ``output_dir``, ``config``) resolve.

    ``directory`` if given, else ``$ESPNET3_FLOWS_WORKDIR`` on the worker, else the directory the
    worker was started in (a relative setting is taken in that one too); created if missing and
    named in the run's log. Prefect changes into the returned ``directory`` before it imports the
    flow, so a deployment does not depend on where ``prefect deploy`` ran. A directory the worker
    deletes after the run is returned as is, with a warning: the flow then refuses relative
    paths (:func:`refuse_transient`).
    """
    start = worker_start_directory()
    if directory:
        chosen, source = directory, "the pull step's directory"
    elif os.environ.get(WORKDIR_VAR):
        chosen, source = os.environ[WORKDIR_VAR], f"${WORKDIR_VAR}"
    elif start is not None:
        chosen, source = str(start), "the directory the worker was started in"
    else:
        chosen, source = os.getcwd(), "the worker's start directory is unknown"
    path = ((start or Path.cwd()) / Path(chosen).expanduser()).resolve()
    logger = _run_logger()
    if is_transient_directory(path):
        logger.warning("espnet3-flows: the working directory %s (%s) is a temporary directory the Prefect "
                       "worker deletes after the run; relative paths are refused: %s", path, source, _FIX)
    else:
        path.mkdir(parents=True, exist_ok=True)
        logger.info("espnet3-flows: working directory %s (%s): relative paths in the run's parameters "
                    "resolve there", path, source)
    return {"directory": str(path)}


#: The pull step that opens config keys that are code to a deployment's run parameters
TRUST_STEP = f"{__name__}.trust_code"


def trust_code(keys: list[str] | str) -> dict[str, list[str]]:
    """Pull step: the config keys (dotted: ``frontend.model``, ``parallel.options``, a key
    opens its sub-keys) whose code this deployment's run parameters may set (docs/credentials.md,
    "Inputs that are code"). By default they may not: a run's parameters come from whoever
    fills in its form. The flow reads this step from the deployment's record on the server, never
    from the run, so only whoever deploys (or edits the deployment) declares it."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    bad = [k for k in keys if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", k)]
    if bad or not keys:
        raise ValueError(f"trust_code: keys must be dotted config keys such as 'frontend.model', got {bad or keys!r}")
    _run_logger().warning("espnet3-flows: this deployment lets its runs' parameters set code in %s", ", ".join(keys))
    return {"trusted_code": keys}


@dataclass(frozen=True)
class DeploymentTrust:
    """What a flow run's deployment itself sets: its parameters (the operator's, from
    ``prefect.yaml``) and the keys its :func:`trust_code` step opens to the run's parameters."""

    parameters: dict[str, Any]
    trusted_keys: tuple[str, ...]


def deployment_trust() -> DeploymentTrust | None:
    """This flow run's deployment's :class:`DeploymentTrust`, read from the API (the record,
    not the run); ``None`` when the run belongs to no deployment (the command line, a script, a
    subflow), whose parameters are its caller's own."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    deployment_id = getattr(ctx.flow_run, "deployment_id", None) if ctx and ctx.flow_run else None
    if deployment_id is None:
        return None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
    keys: list[str] = []
    for step in deployment.pull_steps or []:
        args = step.get(TRUST_STEP)
        if isinstance(args, Mapping):
            found = args.get("keys") or []
            keys += [found] if isinstance(found, str) else [str(k) for k in found]
    return DeploymentTrust(dict(deployment.parameters or {}), tuple(keys))


def refuse_code_from_form(job: str, config_file: str | None, values: dict[str, Any],
                          overrides: Sequence[str] | None) -> None:
    """In a deployment's run, refuse the run's parameters when they name code (a ``_target_``,
    an ``parallel.env`` that is a cluster class, a worker's environment...: :mod:`espnet3_flows.code_keys`) that the
    deployment's own parameters do not hold and its ``trust_code`` pull step does not open:
    whoever can fill in a deployment's form must not run code on its workers. Checked on the
    merged sources before the config is validated (validation imports what they name)."""
    trust = deployment_trust()
    if trust is None:
        return
    schema = get_job(job).config_class
    own = dict(trust.parameters)
    trusted = merged_data(job, own.pop("config", None), dotted_values(schema, own), own.pop("overrides", None) or [])
    data = merged_data(job, config_file, dotted_values(schema, values), overrides or [])
    refuse_untrusted_code(schema, data, trusted, trust.trusted_keys, source="this deployment run's parameters",
                          remedy="set them in the deployment's own parameters (prefect.yaml), or open the keys to "
                                 "its runs with the pull step espnet3_flows.orchestration.deploy_steps.trust_code "
                                 "(docs/credentials.md, \"Inputs that are code\")")


def worker_start_directory() -> Path | None:
    """The directory the Prefect worker that runs this process was started in: the working
    directory of the nearest ancestor process that is ``prefect worker start`` (a flow run
    inherits the worker's environment, but starts in a temporary directory); ``None`` when no
    ancestor is one (not a worker's run) or it cannot be read."""
    try:
        for proc in psutil.Process().parents():
            try:
                args = proc.cmdline()
                if any(a == "worker" and b == "start" for a, b in pairwise(args)):
                    return Path(proc.cwd())
            except psutil.Error:  # another user's process, or one that just exited
                continue
    except psutil.Error:
        return None
    return None


def is_transient_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is, or is inside, a directory a Prefect worker made for one flow run and
    deletes when it ends."""
    resolved = Path(path).expanduser().resolve()
    try:
        first = resolved.relative_to(Path(tempfile.gettempdir()).resolve()).parts[:1]
    except ValueError:
        return False
    return bool(first) and any(fnmatch.fnmatchcase(first[0], name) for name in _TRANSIENT_NAMES)


def run_paths(cfg: Any) -> dict[str, str]:
    """A job config's paths that resolve in the run's working directory, by key: ``output_dir``
    and each ``manifests.<split>``."""
    paths = {f"manifests.{split}": str(path) for split, path in (getattr(cfg, "manifests", None) or {}).items()}
    if getattr(cfg, "output_dir", None):
        paths["output_dir"] = str(cfg.output_dir)
    return paths


def refuse_transient(paths: Mapping[str, str | None]) -> None:
    """Raise :class:`~espnet3_flows.config.ConfigError` when this process works in a directory the
    Prefect worker deletes after the run and any of ``paths`` (key → value) is a relative local
    path: its outputs would be deleted, or its input looked for in an empty directory."""
    cwd = Path.cwd()
    relative = [f"{key}={value}" for key, value in paths.items() if value and _relative_local(value)]
    if relative and is_transient_directory(cwd):
        from espnet3_flows.config import ConfigError

        raise ConfigError(f"{', '.join(relative)} would resolve in {cwd}, a temporary directory the Prefect "
                          f"worker deletes when the run ends: {_FIX}")


_FIX = (f"set {WORKDIR_VAR} in the worker's environment to a lasting directory "
        f"(`{WORKDIR_VAR}=$PWD prefect worker start --pool espnet3`), or give absolute paths")


def _relative_local(path: str) -> bool:
    return "://" not in path and not os.path.isabs(os.path.expanduser(path))


def _run_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The flow run's logger (its records reach the API: the run's logs in the UI) when this
    process runs a deployment's flow run, else this module's."""
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not run_id:
        return log
    from prefect.logging.loggers import flow_run_logger

    return flow_run_logger(flow_run_id=UUID(run_id))


class PrefectApiLost(RuntimeError):
    """The run's Prefect API server stopped answering (after the client's own retries)."""


def api_lost(exc: BaseException) -> PrefectApiLost:
    """The error a run ends with when its Prefect API server stopped answering (``exc``: the
    client's connection error), naming the server and what to do. A deployment's flow run also
    prints it as one ``error:`` line on stderr (the worker's log), the only place it can still reach."""
    from prefect.context import FlowRunContext
    from prefect.settings import get_current_settings

    ctx = FlowRunContext.get()
    run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else os.environ.get("PREFECT__FLOW_RUN_ID", "<flow run id>")
    message = (f"the Prefect API at {get_current_settings().api.url} stopped answering "
               f"({type(exc).__name__}: {clip(str(exc))}); finished shards are kept: start the server again "
               f"and rerun (only unfinished shards are computed); this flow run stays Running on the server "
               f"until `prefect flow-run cancel {run_id}`")
    if os.environ.get("PREFECT__FLOW_RUN_ID") and not _LINE_PRINTED:  # once: the run's end and the watch's
        _LINE_PRINTED.append(message)
        sys.stderr.write(f"error: {message}\n")  # not print(): a flow's log_prints makes that an INFO record
        sys.stderr.flush()
    return PrefectApiLost(message)


_LINE_PRINTED: list[str] = []


def is_api_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the Prefect client failing to reach its API."""
    import httpx

    return any(isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) for e in causes(exc))
