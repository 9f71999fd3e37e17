"""Local Dask workers forked from one preloaded server process instead of each spawning an interpreter.

A spawned worker starts a fresh interpreter and imports torch, lhotse and the rest itself (~3 s
of CPU per worker on the 2-core machine of ``benchmarks/``, all workers at once), and on close
runs the interpreter's full shutdown (~1 s). With Python's ``forkserver`` start method one server
process imports those modules once, in the background while the driver does other work, and
every worker is a fork of it: a worker starts in milliseconds once the server is ready, and
exits at once. The server lives until this process exits, so later runs in the same process
(a notebook or script calling ``run_job`` again, a test session) start their workers warm.
Prefect's process workers run each deployment run in a new process: those start cold.

A forked worker inherits the server's environment, not the driver's. To keep spawn's meaning
("workers see the driver's environment at cluster start"), the variables added or changed since
the server started are passed to the workers (Dask's ``Nanny(env=...)``); if one was removed,
the run falls back to ``spawn``.

The server imports the driver's script (:mod:`.forkserver_main`); one that starts workers or a
run when imported ends the run before any cluster, in one line naming the fix (:mod:`.main_guard`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import time
from typing import Any
from collections.abc import Iterator, Sequence

from espnet3_flows.parallel import main_guard

#: Preloaded first: imports the driver's main module once in the server (:mod:`.forkserver_main`;
#: not imported here, so that the package is whole before it runs the driver's script)
MAIN_PRELOAD = "espnet3_flows.parallel.forkserver_main"
#: Preloaded last: marks the server's imports done in the run's timeline (:mod:`.forkserver_ready`)
READY_PRELOAD = "espnet3_flows.parallel.forkserver_ready"
#: The environment variable naming the driver's main module to the forkserver: ``path:<file>``
#: (a script) or ``name:<module>`` (``python -m``)
MAIN_VAR = "ESPNET3_FLOWS_FORKSERVER_MAIN"

#: Dask's default ``MALLOC_TRIM_THRESHOLD_`` for the workers its nannies start
DASK_TRIM_DEFAULT = "65536"

_LOG = logging.getLogger(__name__)
#: How Dask's nannies start a worker process, read each time one starts (a restart too)
MP_METHOD_KEY = "distributed.worker.multiprocessing-method"

@dataclasses.dataclass(frozen=True)
class _Started:
    """What this process's forkserver was started with."""

    environ: dict[str, str]  # its environment (every worker forked from it inherits it)
    modules: tuple[str, ...]  # what it preloads
    imports_main: bool  # whether it imports the driver's main module (:mod:`.forkserver_main`)


#: The forkserver this process started (``None``: none, or one started by someone else). Python
#: keeps one forkserver per process (``multiprocessing.forkserver``); this is what it was started
#: with, kept beside it for as long as it runs, and read only by the functions of this module.
_STARTED: _Started | None = None


@contextlib.contextmanager
def without_inherited_trim_threshold() -> Iterator[None]:
    """Dask's ``MALLOC_TRIM_THRESHOLD_=65536`` out of this process's environment for the block
    (put back after it): a nanny started earlier in this process with Dask's defaults (a user's
    own LocalCluster) wrote it into ``os.environ`` for good, and worker processes (or the
    forkserver) started in the block would inherit it."""
    if os.environ.get("MALLOC_TRIM_THRESHOLD_") != DASK_TRIM_DEFAULT:
        yield
        return
    os.environ.pop("MALLOC_TRIM_THRESHOLD_")
    try:
        yield
    finally:
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", DASK_TRIM_DEFAULT)


def main_module_ref() -> str | None:
    """How a child of this process finds its main module again (the value of :data:`MAIN_VAR`),
    or ``None`` when children import none (an interactive session, ``python -c``, a package's
    ``__main__`` run with ``-m``)."""
    from multiprocessing import spawn

    data = spawn.get_preparation_data("ref")
    if data.get("init_main_from_path"):
        return f"path:{data['init_main_from_path']}"
    name = data.get("init_main_from_name")
    if name and name != "__main__" and not name.endswith(".__main__"):
        return f"name:{name}"
    return None


def _server_alive() -> bool:
    from espnet3_flows.parallel.multiprocessing_private import forkserver_pid

    pid = forkserver_pid()
    if pid is None:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def start_forkserver(modules: Sequence[str] = (), environ: dict[str, str] | None = None) -> bool:
    """Start the forkserver with ``distributed`` and ``modules`` imported; returns at once.

    The imports run in the server process, in the background; the first worker fork waits for
    them. The server also imports this process's main module (a script the workers would each
    import again: :mod:`.forkserver_main`). Idempotent: a server already running keeps its
    modules. Returns ``False`` when a forkserver was started in this process by someone else
    (its environment is unknown, so workers are spawned instead).

    Imports nothing heavy here (not even Dask): a command line starts it before its own imports.

    Args:
        modules: What the server imports (after ``distributed``).
        environ: Variables the server (and so every worker forked from it) sees on top of this
            process's environment, as if they were set here: e.g. the URL of an API server this
            process exports only later.

    Raises:
        UnguardedMainError: when called while a worker or the forkserver imports this script
            (:mod:`.main_guard`).
    """
    global _STARTED
    main_guard.refuse_while_importing_main("Dask workers")
    if _server_alive():
        return _STARTED is not None
    preload = list(dict.fromkeys(["distributed", *modules]))
    main = main_module_ref()
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [*([MAIN_PRELOAD] if main else []), *preload, READY_PRELOAD])
    main_guard.reset_status()
    with without_inherited_trim_threshold():
        _STARTED = _Started({**os.environ, **(environ or {})}, tuple(preload), bool(main))
        told = {MAIN_VAR: main, **main_guard.status_variables()} if main else {}
        with environment_set({**(environ or {}), **told}):
            multiprocessing.forkserver.ensure_running()
    _LOG.debug("forkserver started (preloading %s)", ", ".join(preload))
    return True


@contextlib.contextmanager
def environment_set(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block (the previous values put back)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_main_imported(timeout: float = 60.0) -> None:
    """Wait (at most ``timeout`` seconds) until the forkserver of ours has imported this process's
    main module, and raise the error it recorded if that script starts workers or a run when it is
    imported: before a flow, whose cluster would otherwise fail inside it, in a page of logs. Nothing
    without such a server (none running, or it imports no main module).

    Raises:
        UnguardedMainError: naming the script and the fix (:mod:`.main_guard`).
    """
    if _STARTED is None or not _STARTED.imports_main:
        return
    deadline = time.monotonic() + timeout
    while not main_guard.read_status() and time.monotonic() < deadline and _server_alive():
        time.sleep(0.01)
    error = main_guard.recorded_error()
    if error is not None:
        raise error


@contextlib.contextmanager
def main_import_checked(method: str) -> Iterator[None]:
    """For the block that starts local workers with ``method``: an unguarded main script (one that
    starts workers or a run when imported) raised as its one-line error, not as the cascade of
    workers dying while they import it (:mod:`.main_guard`).

    With ``forkserver``, the server imports the script before it forks any worker, and its later
    preloads take longer than a scheduler's start: the block is not entered for such a script.
    ``spawn``: each worker imports it and records there; the block's failure becomes that error.
    """
    if method == "forkserver":
        check_main_imported()
    with environment_set(main_guard.status_variables() if method == "spawn" else {}):
        try:
            yield
        except Exception:
            error = main_guard.recorded_error()
            if error is None:
                raise
            raise error from None  # the workers died importing this script: that, not Dask's cascade


def stop_forkserver() -> None:
    """Stop the forkserver (the next forked worker starts a new one): for benchmarks that
    measure a cold start, and tests."""
    global _STARTED
    from espnet3_flows.parallel.multiprocessing_private import stop_forkserver_process

    stop_forkserver_process()
    _STARTED = None


def preloaded_modules() -> tuple[str, ...]:
    """Modules the running forkserver was started with (empty when none of ours runs)."""
    return _STARTED.modules if _STARTED is not None and _server_alive() else ()


def worker_environment(given: dict[str, str] | None = None) -> dict[str, str] | None:
    """Variables a forked worker needs to see this process's environment and ``given`` (what the
    run's workers are started with) as a spawned one would: those added or changed since the
    forkserver started. ``None`` when a variable was removed since (a forked worker would still
    have it)."""
    if _STARTED is None:
        return None
    started = _STARTED.environ
    now = {**os.environ, **(given or {})}
    removed = [k for k in started if k not in now]
    if removed:
        _LOG.info("environment variables removed since the forkserver started (%s): spawning workers",
                  ", ".join(sorted(removed)))
        return None
    return {k: v for k, v in now.items() if started.get(k) != v}


def local_worker_start(cluster_kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The start method for the workers of a local cluster that forks them
    (:meth:`~espnet3_flows.parallel.backends.base.Placement.forks_workers`) and the cluster
    keyword arguments that go with it: ``spawn`` where the forkserver cannot start or the
    environment lost a variable it started with.

    Forked workers get the driver's changed variables as the nanny's ``env``, with the entries
    of ``cluster_kwargs``' own ``env`` (``parallel.options.env``, and what the run adds) on top.
    Starts the forkserver (``distributed`` preloaded) if nothing started it yet.
    """
    if not start_forkserver():
        return "spawn", cluster_kwargs
    from espnet3_flows.parallel.dask_private import keep_dask_preload

    keep_dask_preload()
    given = dict(cluster_kwargs.get("env") or {})
    environ = worker_environment(given)
    if environ is None:
        return "spawn", cluster_kwargs
    return "forkserver", {**cluster_kwargs, "env": {**environ, **given}}


@contextlib.contextmanager
def spawned_with(environ: dict[str, str] | None) -> Iterator[None]:
    """For the block that spawns local workers: ``environ`` (their nannies' ``env``) in this
    process's environment while they start, so that a spawned worker sees it from its
    interpreter's start (Dask's own logging level is read when it imports Dask, before the nanny
    applies its ``env``); put back after the block."""
    with environment_set(dict(environ or {})):
        yield


@contextlib.contextmanager
def worker_start_method(method: str) -> Iterator[None]:
    """Dask's ``distributed.worker.multiprocessing-method`` set to ``method`` for the block
    (nannies read it when they start their worker process)."""
    import dask

    with dask.config.set({MP_METHOD_KEY: method}):
        yield
