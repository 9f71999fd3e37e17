"""Every patch of Prefect's internals this project makes, each behind a version guard: here, and the
context caches in :mod:`.prefect_context_cache` (which install through the guards below).

They are speed-ups, not fixes: with a Prefect version they were not verified against
(:data:`VERIFIED_PREFECT`), none is installed, a warning says so, and runs are correct but
slower. ``tests/orchestration/test_prefect_compat.py`` fails when the installed Prefect is not
a verified one, so that a pin change re-verifies them. ``ESPNET3_FLOWS_PATCHES=off`` in the
environment turns every one of them off (to tell whether one is behind a problem; runs stay
correct, with more overhead per shard task): a test runs a flow so.

**Shared TLS contexts.** One verified TLS context per CA file for Prefect's API clients in this process.

Prefect 3.8's ``PrefectClient`` and ``SyncPrefectClient`` build a fresh ``ssl.SSLContext``
from the CA bundle every time one is constructed (``ssl.create_default_context(cafile=...)``:
OpenSSL parses the whole bundle), and a task run on a Dask worker constructs two of them: worker
CPU taken from the features on every shard. Upstream tracks this (PrefectHQ/prefect#14986
removed some clients; #19106 proposes reusable contexts); until a release takes a context from
settings, :func:`share_tls_contexts` gives Prefect's client module an ``ssl`` whose verified
contexts are built once per ``(purpose, cafile, capath)`` and then shared.

Verification is unchanged: the shared context is the one Prefect would have built (certificate
and hostname checks on), and Prefect never modifies a verified context after creating it. The
unverified context of ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` (built without a CA file and then
modified by Prefect) is never shared. A changed CA file (size or mtime) gets a new context.

**Contexts serialized and validated once** (:mod:`.prefect_context_cache`): the settings and flow
run contexts Prefect ships with every task, dumped once per flow on the driver and validated once
per worker.

**Heartbeats that stop at once.** :func:`prompt_heartbeat_stop`: a flow run's heartbeat thread
wakes when the run ends instead of finishing a one-second sleep.

**Forked children that exit cleanly.** :func:`forked_children_exit_cleanly` (a fix, not a
speed-up): a process forked after a flow ran here (a torch ``DataLoader``'s workers) no longer
exits 1 on Prefect's inherited exit hook.

**No draining into a dead server.** :func:`drop_undeliverable_api_work`: after the API server is
lost, Prefect's queued events and logs are dropped instead of drained at exit, each into a
websocket that never connects.

**A failed run said once.** :func:`quiet_failed_run_exit` (a fix of the log, not a speed-up): a
deployment's run that failed on purpose is not logged again as an "unexpected exception".

What each buys is in ``benchmarks/README.md``, "Figures behind settings in the code".
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from typing import Any
from collections.abc import Callable

from espnet3_flows import patches

#: Prefect versions these patches were verified against (their targets read, tests run)
VERIFIED_PREFECT = ("3.8.8",)
#: prefect-dask versions :func:`untokenized_task_keys` was verified against
VERIFIED_PREFECT_DASK = ("0.3.7",)
#: ``off`` in this variable: no patch of Prefect is installed (nor of any library: :mod:`espnet3_flows.patches`)
PATCHES_VAR = patches.VAR
_LOG = logging.getLogger(__name__)
_WARNED: list[str] = []


def prefect_verified(patch: str | None = None) -> bool:
    """Whether the patches (or the one named ``patch``, of :data:`~espnet3_flows.patches.PATCHES`)
    may be installed: the installed Prefect is one they were verified against (warns once if not)
    and :data:`PATCHES_VAR` does not turn them off."""
    import prefect

    if not patches.patches_enabled(patch):
        return False
    if prefect.__version__ in VERIFIED_PREFECT:
        return True
    if not _WARNED:
        _WARNED.append(prefect.__version__)
        _LOG.warning("Prefect %s is not one of %s, which espnet3_flows' speed-ups of Prefect's internals were "
                     "verified with: they are off (runs are correct, with more overhead per shard task)",
                     prefect.__version__, ", ".join(VERIFIED_PREFECT))
    return False


def unpatched_target(owner: Any, name: str, patch: str, verified: bool = True) -> tuple[bool, Any]:
    """What the patch named ``patch`` wraps: ``(True, original)`` for ``owner``'s own ``name`` (in
    its ``__dict__``); ``(True, None)`` when our wrapper is there already; ``(False, None)`` when it
    cannot be installed: it is turned off, Prefect (or ``verified``, a further version check) is
    not a verified version, or ``owner`` has no such attribute."""
    if not verified or not prefect_verified(patch):
        return False, None
    original = vars(owner).get(name)
    if original is None:
        return False, None
    if getattr(original, _MARK, False):
        return True, None
    return True, original


_TARGET = "prefect.client.orchestration"


class _SharedContextSSL:
    """Stands in for the ``ssl`` module inside Prefect's client module."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[Any, ...], ssl.SSLContext] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)

    def create_default_context(self, purpose: Any = ssl.Purpose.SERVER_AUTH, *, cafile: str | None = None,
                               capath: str | None = None, cadata: Any = None) -> ssl.SSLContext:
        if cadata is not None or (cafile is None and capath is None):
            return ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
        key = (purpose, cafile, capath, _stamp(cafile), _stamp(capath))
        with self._lock:
            ctx = self._contexts.get(key)
            if ctx is None:
                ctx = self._contexts[key] = ssl.create_default_context(purpose, cafile=cafile, capath=capath)
            return ctx


def _stamp(path: str | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def share_tls_contexts() -> bool:
    """Make Prefect's API clients in this process share verified TLS contexts (idempotent).

    Returns:
        ``True`` if installed (or already), ``False`` if this Prefect version does not build
        its contexts the way this works around (then nothing is changed).
    """
    import importlib

    if not prefect_verified("share_tls_contexts"):
        return False
    module = importlib.import_module(_TARGET)
    current = getattr(module, "ssl", None)
    if isinstance(current, _SharedContextSSL):
        return True
    if current is not ssl:
        return False
    module.ssl = _SharedContextSSL()  # type: ignore[attr-defined]
    return True


_MARK = "_espnet3_cached_serialization"


def install_wrapper(owner: Any, name: str, wrapper: Any, original: Any) -> bool:
    """Set ``owner.name = wrapper`` (a wrapper of ``original``, marked as ours so that installing it
    again is a no-op); returns ``True``."""
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)
    return True


def untokenized_task_keys() -> bool:
    """Give Prefect tasks submitted to Dask a random key instead of a token of their arguments
    (idempotent).

    prefect-dask 0.3's ``DaskTaskRunner.submit`` calls ``Client.submit`` with Dask's default
    ``pure=True``, so Dask names each task by ``tokenize``-ing its whole argument set: the task, its
    parameters and the serialized Prefect context (the settings included), ~10 ms of the driver's
    CPU per shard task (a py-spy profile of 600 tasks: 62 % of ``Task.submit``). The arguments hold
    a fresh task-run id every time, so the token is unique anyway and Dask can never reuse a
    result by it: ``pure=False`` (a ``uuid4`` key) means the same, without the hashing.

    Returns:
        Whether installed (``False`` with a prefect-dask version it was not verified against).
    """
    import prefect_dask
    from prefect.tasks import Task
    from prefect_dask.client import PrefectDaskClient

    ok, original = unpatched_target(PrefectDaskClient, "submit", "untokenized_task_keys",
                                    getattr(prefect_dask, "__version__", None) in VERIFIED_PREFECT_DASK)
    if original is None:
        return ok

    def submit(self: Any, func: Any, *args: Any, key: Any = None, pure: bool = True, **kwargs: Any) -> Any:
        if isinstance(func, Task) and key is None:
            pure = False
        return original(self, func, *args, key=key, pure=pure, **kwargs)

    return install_wrapper(PrefectDaskClient, "submit", submit, original)


def prompt_heartbeat_stop() -> bool:
    """Let a flow run end as soon as its work does, not up to a second later (idempotent).

    Prefect 3.8 sends a flow run's heartbeats (every ``flows.heartbeat_frequency`` seconds, 180
    by default: the server's crash detection reads them) from a thread that sleeps one second at
    a time, and the flow engine joins that thread when the run ends: 0–1 s, ~0.5 s on average,
    added to every flow run after its last task (0.6 s in a profile of a 4-utterance run). This
    replaces ``flow_engine._send_heartbeats`` with the same heartbeats — the first at once, then
    one per interval, none after the run's state is final, failures logged at debug level —
    from a thread that waits on an event, so that ending the run wakes it at once.

    Returns:
        Whether installed (``False`` when Prefect's flow engine has no ``_send_heartbeats``).
    """
    import contextlib
    import contextvars

    import prefect.flow_engine as flow_engine

    ok, original = unpatched_target(flow_engine, "_send_heartbeats", "prompt_heartbeat_stop")
    if original is None:
        return ok
    least = getattr(flow_engine, "MINIMUM_HEARTBEAT_INTERVAL", 30)

    @contextlib.contextmanager
    def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Any:
        interval = engine.heartbeat_seconds
        if interval is None:
            yield
            return
        interval = max(interval, least)
        resource, related = engine._build_heartbeat_event_template()
        stop = threading.Event()

        def beat() -> None:
            while not stop.is_set():
                state = getattr(engine.flow_run, "state", None)
                if state is not None and state.is_final():
                    return
                try:
                    engine._emit_flow_run_heartbeat(resource, related)
                except Exception:  # as Prefect's: a missed heartbeat is not the run's failure
                    engine.logger.debug("Failed to emit heartbeat", exc_info=True)
                stop.wait(interval)

        # the thread sees this context's settings (the API URL), as Prefect's does
        thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), daemon=True,
                                  name="flow-run-heartbeat")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            if join_on_exit:
                thread.join(timeout=2)

    return install_wrapper(flow_engine, "_send_heartbeats", send_heartbeats, original)


def forked_children_exit_cleanly() -> bool:
    """Let a process forked from this one after a flow ran here exit 0, not 1 (idempotent).

    Prefect 3.8's log and event services register a ``threading`` exit hook that drains them. A
    forked child inherits the hook, and Prefect's after-fork handler resets the services
    (``_done_event = None``) but leaves the hook: at the child's exit ``drain`` fails an
    ``assert``, and ``multiprocessing``'s fork start method turns that into exit code 1 with no
    message. A torch ``DataLoader`` with workers (forked) then fails with "DataLoader worker
    exited unexpectedly" in any process that ran a flow before, e.g. a training script that
    collects its statistics first. This makes ``drain`` at exit a no-op for a service reset so
    (it has nothing of the parent's to send); every other drain is Prefect's own. A fix, not a
    speed-up: with the patches off the bug is back.

    Returns:
        Whether installed (``False`` with a Prefect version it was not verified against).
    """
    from prefect._internal.concurrency.services import _QueueServiceBase

    ok, original = unpatched_target(_QueueServiceBase, "drain", "forked_children_exit_cleanly")
    if original is None:
        return ok

    def drain(self: Any, at_exit: bool = False) -> Any:
        if at_exit and self._done_event is None:  # never started, or reset in a forked child
            return False
        return original(self, at_exit=at_exit)

    return install_wrapper(_QueueServiceBase, "drain", drain, original)


def install_run_patches() -> None:
    """What every flow run of this process needs installed before it starts (idempotent): shared
    TLS contexts, prompt heartbeat stops, and forked children that exit cleanly (before the run
    starts Prefect's services and their exit hooks)."""
    share_tls_contexts()
    prompt_heartbeat_stop()
    forked_children_exit_cleanly()


#: Prefect's loggers of its log and event shippers (disabled, not levelled: they ignore levels)
SHIPPER_LOGGERS = ("prefect._internal.concurrency", "prefect.events.clients", "EventsWorker", "APILogWorker")


def quiet_shipper_failures() -> Callable[[], None]:
    """Keep the failures of what Prefect's shippers still have in flight for a lost API server off
    the console, after the run's one error line: ``logging.raiseExceptions`` off (the log shipper
    writes its own failures unless it is) and :data:`SHIPPER_LOGGERS` disabled. With the patches
    off (``ESPNET3_FLOWS_PATCHES=off``) nothing changes.

    Returns:
        What puts both back as they were (a command line that exits next need not call it).
    """
    if not patches.patches_enabled("quiet_shipper_failures"):
        return lambda: None
    raised, loggers = logging.raiseExceptions, [logging.getLogger(name) for name in SHIPPER_LOGGERS]
    disabled = [logger.disabled for logger in loggers]
    logging.raiseExceptions = False
    for logger in loggers:
        logger.disabled = True

    def restore() -> None:
        logging.raiseExceptions = raised
        for logger, was in zip(loggers, disabled, strict=True):
            logger.disabled = was

    return restore


#: what Prefect 3.8's flow-run process logs (``prefect.engine`` → ``run_flow(error_logger=...)``),
#: with the traceback of the ``FailedRun`` that reading the result raises, for every run whose final
#: state is Failed
ENGINE_EXIT_RECORD = "Engine execution exited with unexpected exception"


class _FailedRunExitFilter(logging.Filter):
    """Drops :data:`ENGINE_EXIT_RECORD` for a run that failed on purpose: its ``FailedRun`` says the
    run's ``error:`` line, which the run's log and final state hold already."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.exceptions import FailedRun

        exc = record.exc_info[1] if record.exc_info else None
        return not (record.msg == ENGINE_EXIT_RECORD and isinstance(exc, FailedRun)
                    and str(exc).startswith("error: "))


def quiet_failed_run_exit() -> bool:
    """Keep a deployment's run that ended Failed on purpose (the state a job flow returns, its
    message the ``error:`` line) from being logged once more by the flow-run process as an
    "unexpected exception" with ~40 lines of traceback; any other exception keeps its record
    (idempotent). Nothing changes with the patches off or another Prefect (returns False then)."""
    if not prefect_verified("quiet_failed_run_exit"):
        return False
    logger = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, _FailedRunExitFilter) for f in logger.filters):
        logger.addFilter(_FailedRunExitFilter())
    return True


def drop_undeliverable_api_work() -> int:
    """Discard the events and log records Prefect still queues for an API server that is gone, so
    that the process exits at once instead of draining them (idempotent; the count discarded).

    Prefect 3.8 drains its ``EventsWorker`` and ``APILogWorker`` queues at interpreter exit, one
    item at a time; against a dead server each event waits ~7 s for a websocket that never
    connects: a run that failed on a lost API then stayed alive ~7 s per task-run event (minutes
    for dozens of shards, hours for thousands). Nothing queued can reach the server, so nothing is
    lost by dropping it; the item a worker is handling now still finishes its own attempt, and
    that failure is no longer printed after the run's error line.
    """
    if not prefect_verified("drop_undeliverable_api_work"):
        return 0
    from prefect._internal.concurrency.services import _QueueServiceBase

    dropped = 0
    for service in list(getattr(_QueueServiceBase, "_instances", {}).values()):
        pending = getattr(service, "_queue", None)
        while pending is not None:
            try:
                item = pending.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty: nothing left
                break
            pending.task_done()
            if item is None:  # the stop sentinel stays: the service must still end
                pending.put_nowait(None)
                break
            dropped += 1
    return dropped
