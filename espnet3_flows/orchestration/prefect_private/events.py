"""The events a task run sends: one fewer per task (:func:`skip_pending_events`). Installed through
:mod:`.gate`."""

from __future__ import annotations

from typing import Any

from espnet3_flows.orchestration.prefect_private.gate import install_wrapper, unpatched_target


def skip_pending_events() -> bool:
    """Send a task run's state events from Running on: no event for the Pending state it is
    created in (idempotent).

    Prefect 3.8's task engine creates each task run on the worker that runs it and sends an event
    per state: Pending at creation, at once Running, then the final state. The server records
    each event on its own (a task-run row upserted from the event, a state row inserted), and
    every event is built, sent and received: a third of that work per shard task is the Pending
    event of a run that starts the same moment. The Running event says where it came from (its
    ``initial_state`` is the Pending state), carries the whole task run as Pending's does, and the
    server creates the run from it: the UI shows the run Running, then its final state. Only the
    event of the creation is left out (the one with no initial state): every later state, a
    retry's included, is sent as before.

    Returns:
        Whether installed (``False`` when turned off or Prefect's engine has no such function).
    """
    import prefect.task_engine as task_engine

    ok, original = unpatched_target(task_engine, "emit_task_run_state_change_event", "skip_pending_events")
    if original is None:
        return ok

    def emit_task_run_state_change_event(task_run: Any, initial_state: Any, validated_state: Any,
                                         *args: Any, **kwargs: Any) -> Any:
        if initial_state is None and validated_state is not None and validated_state.is_pending():
            return None
        return original(task_run, initial_state, validated_state, *args, **kwargs)

    return install_wrapper(task_engine, "emit_task_run_state_change_event", emit_task_run_state_change_event, original)

