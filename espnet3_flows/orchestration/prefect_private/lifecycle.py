"""What Prefect does around a run: heartbeats that stop with it (:func:`prompt_heartbeat_stop`),
processes forked after it that exit 0 (:func:`forked_children_exit_cleanly`), no drain into a lost
API server (:func:`drop_undeliverable_api_work`) and its shippers' failures kept off the console
(:func:`quiet_shipper_failures`), a run failed on purpose logged once (:func:`quiet_failed_run_exit`).
Installed through :mod:`.gate`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from espnet3_flows import patches
from espnet3_flows.orchestration.prefect_private.gate import install_wrapper, prefect_verified, unpatched_target


def prompt_heartbeat_stop() -> bool:
    """Let a flow run end as soon as its work does, not up to a second later (idempotent).

    Prefect 3.8 sends a flow run's heartbeats (every ``flows.heartbeat_frequency`` seconds, 180
    by default: the server's crash detection reads them) from a thread that sleeps one second at
    a time, and the flow engine joins that thread when the run ends: up to a second added to every
    flow run after its last task. This
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

    return install_wrapper(_QueueServiceBase, "drain", drain, original, outlives_run=True)


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
    item at a time; against a dead server each event waits seconds for a websocket that never
    connects: a run that failed on a lost API then stayed alive minutes for dozens of shards,
    hours for thousands. Nothing queued can reach the server, so nothing is
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
