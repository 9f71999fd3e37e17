"""The events a task run sends (:mod:`espnet3_flows.orchestration.prefect_private.events`): no
Pending event at creation, the run still recorded by the API server from its Running event with
its states as the UI shows them."""

from __future__ import annotations

import time

import pytest

from espnet3_flows.orchestration.prefect_private import events, gate


def _states_of(task_run_id, final: int = 1, timeout: float = 60.0) -> list[str]:
    """The task run's states as the server recorded them, once ``final`` final ones are there."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            try:
                states = client.read_task_run_states(task_run_id)
            except Exception:  # noqa: BLE001 - not recorded yet (the recorder consumes events in batches)
                states = []
            names = [s.name for s in sorted(states, key=lambda s: s.timestamp)]
            if sum(s.is_final() for s in states) >= final or time.monotonic() > deadline:
                return names
            time.sleep(0.2)


@pytest.mark.patch
def test_a_task_run_sends_no_pending_event_and_the_server_records_it_running_then_completed(prefect_harness):
    from prefect import flow, task
    from prefect.context import TaskRunContext

    @task
    def shard(x: int) -> tuple[int, object]:
        return 2 * x, TaskRunContext.get().task_run.id

    @flow
    def run(n: int) -> list:
        with gate.patched_run():
            events.skip_pending_events()
            return [shard(i) for i in range(n)]

    results = run(3)
    assert [value for value, _ in results] == [0, 2, 4]
    for _, task_run_id in results:
        assert _states_of(task_run_id) == ["Running", "Completed"]
    assert "emit_task_run_state_change_event" not in " ".join(gate.installed_patches())  # put back with the run


@pytest.mark.patch
def test_a_retried_task_keeps_every_later_state(prefect_harness):
    """Only the event of the creation is left out: a retry's states are sent."""
    from prefect import flow, task
    from prefect.context import TaskRunContext

    seen = []

    @task(retries=1, retry_delay_seconds=0)
    def flaky() -> None:
        seen.append(TaskRunContext.get().task_run.id)
        if len(seen) == 1:
            raise RuntimeError("once")

    @flow
    def run() -> None:
        with gate.patched_run():
            events.skip_pending_events()
            flaky()

    run()
    assert _states_of(seen[0]) == ["Running", "Retrying", "Completed"]

