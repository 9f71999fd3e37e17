"""The patches of Prefect's internals: verified for the pinned Prefect only, off for any other."""

from __future__ import annotations

import prefect
import prefect.flow_engine as flow_engine  # configures Prefect's logging: at import, not inside a test's caplog
import pytest

from espnet3_flows.orchestration.prefect_private import client as client_patches
from espnet3_flows.orchestration.prefect_private import contexts, events, gate, lifecycle
from espnet3_flows.patches import patches_enabled


def test_installed_prefect_is_the_verified_one():
    """Fails on purpose when the Prefect pin changes: read the patches' targets in the new
    version (prefect.client.orchestration's ssl use, SettingsContext.serialize,
    task_engine.hydrated_context), rerun their tests, then add the version to VERIFIED_PREFECT."""
    assert prefect.__version__ in gate.VERIFIED_PREFECT, (
        f"Prefect {prefect.__version__} is installed; espnet3_flows' patches of Prefect internals were verified "
        f"with {gate.VERIFIED_PREFECT}: verify them again (orchestration/prefect_private/)")


def test_an_unverified_prefect_gets_no_patch(monkeypatch, caplog):
    import importlib

    import prefect.task_engine as task_engine
    from prefect.context import SettingsContext

    monkeypatch.setattr(prefect, "__version__", "99.0.0")
    monkeypatch.setattr(gate, "_WARNED", [])
    from prefect_dask.client import PrefectDaskClient

    client_module = importlib.import_module("prefect.client.orchestration")
    before = (client_module.ssl, SettingsContext.__dict__["serialize"], task_engine.hydrated_context,
              PrefectDaskClient.__dict__["submit"], flow_engine._send_heartbeats)
    with caplog.at_level("WARNING"):
        assert not client_patches.share_tls_contexts()
        assert not contexts.cache_settings_serialization()
        assert not contexts.cache_settings_hydration()
        assert not client_patches.untokenized_task_keys()
        assert not lifecycle.prompt_heartbeat_stop()
        assert not events.skip_pending_events()
    assert (client_module.ssl, SettingsContext.__dict__["serialize"], task_engine.hydrated_context,
            PrefectDaskClient.__dict__["submit"], flow_engine._send_heartbeats) == before
    # one warning, not one per call (none with every patch switched off: the version is not looked at)
    assert sum("99.0.0" in r.getMessage() for r in caplog.records) == (1 if patches_enabled() else 0)


@pytest.mark.patch
@pytest.mark.dask
def test_prefect_tasks_on_dask_get_random_keys_other_functions_keep_theirs(prefect_harness):
    import re

    from distributed import LocalCluster
    from prefect import task
    from prefect_dask.client import PrefectDaskClient

    assert client_patches.untokenized_task_keys()

    @task
    def double(x: int) -> int:
        return 2 * x

    # a cluster of its own, and no default client left behind (it would take over later flows' tasks)
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0")
    client = PrefectDaskClient(cluster, set_as_default=False)
    try:
        future = client.submit(double, parameters={"x": 21}, return_type="result")
        assert re.fullmatch(r"double-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", future.key), future.key
        assert future.result() == 42
        a, b = client.submit(sum, [1, 2]), client.submit(sum, [1, 2])  # pure functions: Dask's token, one key
        assert a.key == b.key and a.result() == 3
    finally:
        client.close()
        cluster.close()


@pytest.mark.patch
def test_flow_run_context_validated_once_per_thread_with_fresh_collections(prefect_harness):
    import prefect.task_engine as task_engine
    from prefect import flow
    from prefect.context import FlowRunContext, serialize_context

    assert contexts.cache_settings_hydration()

    @flow
    def ship(n: int) -> dict:
        return serialize_context()

    serialized = ship(3)
    seen = []
    for _ in range(2):  # two tasks of the same flow run on one worker thread
        with task_engine.hydrated_context(serialized):
            ctx = FlowRunContext.get()
            ctx.run_results[1] = "a task's result"  # what the task engine keeps per task
            seen.append((ctx, ctx.client, ctx.run_results, ctx.flow_run.id, ctx.parameters))
        assert FlowRunContext.get() is None
    (first, client1, results1, run1, params1), (second, client2, results2, run2, params2) = seen
    assert first is not second and results1 is not results2 and results2 == {1: "a task's result"}
    assert client1 is client2 and run1 == run2 and params1 == params2 == {"n": 3}
    assert second.detached and second.task_runner is not None
    other = ship(4)  # another flow run: validated afresh
    with task_engine.hydrated_context(other):
        assert FlowRunContext.get().parameters == {"n": 4} and FlowRunContext.get().flow_run.id != run1


@pytest.mark.patch
def test_the_cached_flow_run_context_has_every_field_as_prefect_builds_it(prefect_harness):
    """``hydrated_context``'s cache rebuilds Prefect's ``FlowRunContext`` from a template: every
    field of the model, Prefect's current ones and any a later version adds, must come out as
    Prefect's own ``hydrated_context`` makes it. What was shipped is equal; what the model
    makes per context (a default factory: run results, dynamic keys, the start time, ...) is a
    new object for each task; the API client is the thread's one. A field set some other way fails
    here, so a new Prefect needs a look before its version is added to VERIFIED_PREFECT."""
    import prefect.task_engine as task_engine
    from prefect import flow
    from prefect.context import FlowRunContext, serialize_context

    assert contexts.cache_settings_hydration()
    original = task_engine.hydrated_context.__wrapped__

    @flow
    def ship(n: int) -> dict:
        return serialize_context()

    serialized = ship(5)
    model = FlowRunContext.model_fields

    def fields(hydrate) -> dict:
        with hydrate(serialized):
            ctx = FlowRunContext.get()
            return {name: getattr(ctx, name) for name in model}

    prefects, ours, again = fields(original), fields(task_engine.hydrated_context), fields(task_engine.hydrated_context)
    shipped = set(serialized["flow_run_context"])
    for name in model:
        if name == "client":
            assert type(ours[name]) is type(prefects[name]) and ours[name] is again[name], name  # the thread's client
        elif model[name].default_factory is not None and name not in shipped:
            assert type(ours[name]) is type(prefects[name]) and ours[name] is not again[name], name  # new per task
        else:
            assert ours[name] == prefects[name], f"{name}: {ours[name]!r} != Prefect's {prefects[name]!r}"


@pytest.mark.patch
def test_heartbeats_still_sent_and_their_thread_ends_with_the_run(prefect_harness, monkeypatch):
    """The replacement sends the first heartbeat at once, like Prefect's, and the flow run does
    not wait for a one-second sleep to end."""
    import threading

    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    assert lifecycle.prompt_heartbeat_stop() and lifecycle.prompt_heartbeat_stop()  # idempotent
    sent = []
    original = flow_engine.FlowRunEngine._emit_flow_run_heartbeat

    def record(self, *args, **kwargs):
        sent.append(str(self.flow_run.id))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(flow_engine.FlowRunEngine, "_emit_flow_run_heartbeat", record)

    @flow
    def short() -> str:
        from prefect.runtime import flow_run

        return flow_run.id

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        run_id = short()
    assert sent == [run_id]  # one at the start; the next would be 30 s later
    assert not [t for t in threading.enumerate() if t.name == "flow-run-heartbeat"]


def test_one_switch_turns_every_patch_off(monkeypatch):
    import importlib

    import prefect.task_engine as task_engine
    from prefect.context import SettingsContext
    from prefect_dask.client import PrefectDaskClient

    monkeypatch.setenv(gate.PATCHES_VAR, "off")
    client_module = importlib.import_module("prefect.client.orchestration")
    targets = [(client_module, "ssl"), (SettingsContext, "serialize"), (task_engine, "hydrated_context"),
               (PrefectDaskClient, "submit"), (flow_engine, "_send_heartbeats")]
    saved = [vars(owner).get(name) for owner, name in targets]
    try:  # (undo the patches other tests of this session installed, so that this sees a pristine Prefect)
        for (owner, name), value in zip(targets, saved, strict=True):
            setattr(owner, name, getattr(value, "__wrapped__", value) if name != "ssl" else __import__("ssl"))
        before = [vars(owner).get(name) for owner, name in targets]
        assert not any([client_patches.share_tls_contexts(), contexts.cache_settings_serialization(),
                        contexts.cache_settings_hydration(),
                        client_patches.untokenized_task_keys(), lifecycle.prompt_heartbeat_stop()])
        assert [vars(owner).get(name) for owner, name in targets] == before
    finally:
        for (owner, name), value in zip(targets, saved, strict=True):
            setattr(owner, name, value)


def _shipper_logging() -> tuple[bool, list[bool]]:
    import logging

    return logging.raiseExceptions, [logging.getLogger(n).disabled for n in lifecycle.SHIPPER_LOGGERS]


def test_quiet_shippers_are_put_back_and_stay_loud_with_the_patches_off(monkeypatch):
    """The logging switches a lost API server turns (its shippers' last failures kept off the
    console) are put back by what :func:`quiet_shipper_failures` returns, and not turned at all
    with every patch off."""
    monkeypatch.delenv(gate.PATCHES_VAR, raising=False)  # on first, whatever the suite's switch
    before = _shipper_logging()
    assert before[0] is True and not any(before[1])
    restore = lifecycle.quiet_shipper_failures()
    try:
        assert _shipper_logging() == (False, [True] * len(lifecycle.SHIPPER_LOGGERS))
    finally:
        restore()
    assert _shipper_logging() == before
    monkeypatch.setenv(gate.PATCHES_VAR, "off")
    lifecycle.quiet_shipper_failures()
    assert _shipper_logging() == before


def test_a_run_failed_on_purpose_is_not_logged_again_as_an_unexpected_exception(monkeypatch):
    """The flow-run process's record of a Failed final state (Prefect's own text, still in its
    run_flow) is dropped when the run failed on purpose (its FailedRun says the error line), kept
    for anything else, and kept by everything with the patches off."""
    import inspect
    import logging

    from prefect.exceptions import FailedRun

    assert lifecycle.ENGINE_EXIT_RECORD in inspect.getsource(flow_engine.run_flow)
    logger = logging.getLogger("prefect.flow_runs")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.getMessage()}: {record.exc_info[1]}")

    def log(exc: Exception) -> None:
        try:
            raise exc
        except Exception:
            logger.error(lifecycle.ENGINE_EXIT_RECORD, exc_info=True)

    handler, filters = Keep(), list(logger.filters)
    logger.addHandler(handler)
    try:
        monkeypatch.setenv(gate.PATCHES_VAR, "off")
        assert lifecycle.quiet_failed_run_exit() is False
        log(FailedRun("error: ConfigError: bad"))
        monkeypatch.delenv(gate.PATCHES_VAR)
        assert lifecycle.quiet_failed_run_exit() is True and lifecycle.quiet_failed_run_exit() is True
        log(FailedRun("error: ConfigError: bad"))  # dropped
        log(FailedRun("Flow run encountered an exception"))
        log(RuntimeError("a bug"))
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = filters
    assert seen == [f"{lifecycle.ENGINE_EXIT_RECORD}: error: ConfigError: bad",
                    f"{lifecycle.ENGINE_EXIT_RECORD}: Flow run encountered an exception",
                    f"{lifecycle.ENGINE_EXIT_RECORD}: a bug"]


def _exit_at_once() -> None:
    """A forked child's whole work: none (its exit is what is checked)."""


@pytest.mark.patch
def test_a_process_forked_after_a_flow_exits_cleanly(prefect_harness, demo_corpus, tmp_path):
    """Before: Prefect's log and event services left their exit hook in a forked child, where it
    failed an ``assert`` after Prefect's own after-fork reset: the child exited 1 without a word,
    and a torch ``DataLoader`` with workers in a process that had run a flow failed with "worker
    exited unexpectedly" (found by the batching tests run after a flow test in one process)."""
    import multiprocessing

    import torch.utils.data

    from espnet3_flows.orchestration.flows import run_job

    run_job("collect_stats", {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / "out"),
                              "parallel": {"env": "serial"}}, progress=False)
    child = multiprocessing.get_context("fork").Process(target=_exit_at_once)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert sorted(int(x) for batch in loader for x in batch) == list(range(8))


def _prefect_targets() -> list[tuple[object, str]]:
    import importlib

    from prefect.context import SettingsContext

    return [(flow_engine, "_send_heartbeats"), (SettingsContext, "serialize"),
            (importlib.import_module("prefect.client.orchestration"), "ssl")]


@pytest.mark.patch
def test_patched_run_gives_prefect_its_own_back_when_the_last_run_of_the_process_ends():
    from prefect._internal.concurrency.services import _QueueServiceBase

    gate.restore_prefect(everything=True)  # Prefect as installed, whatever earlier tests left
    targets = _prefect_targets()
    own = [vars(owner)[name] for owner, name in targets]
    try:
        with gate.patched_run():
            lifecycle.prompt_heartbeat_stop()
            contexts.cache_settings_serialization()
            client_patches.share_tls_contexts()
            lifecycle.forked_children_exit_cleanly()
            with gate.patched_run():  # a second run of the process, ending first
                lifecycle.prompt_heartbeat_stop()
            installed = [vars(owner)[name] for owner, name in targets]
            assert all(now is not before for now, before in zip(installed, own, strict=True)), installed
        assert [vars(owner)[name] for owner, name in targets] == own
        # the exit hook Prefect's services leave registered after a run still needs its fix
        assert getattr(_QueueServiceBase.__dict__["drain"], "__wrapped__", None) is not None
        assert gate.installed_patches() == ["_QueueServiceBase.drain"]
    finally:
        gate.restore_prefect(everything=True)


@pytest.mark.patch
def test_after_a_run_prefect_is_as_installed(prefect_harness):
    """A run installs its patches (seen from inside it) and takes them away when it ends: a notebook's
    next flow runs on Prefect's own code."""
    from espnet3_flows.orchestration import runner_flow
    from tests.parallel.espnet3_runners import ListProvider, RecordsRunner

    gate.restore_prefect(everything=True)
    targets = _prefect_targets()
    own = [vars(owner)[name] for owner, name in targets]
    seen: list[list[str]] = []

    class Spy(RecordsRunner):
        @staticmethod
        def forward(idx, dataset, model, **env):
            seen.append(gate.installed_patches())
            return RecordsRunner.forward(idx, dataset, model, **env)

    out = runner_flow(Spy(ListProvider({"n": 4}), batch_size=2), range(4), parallel={"env": "serial"}, progress=False)
    assert len(out) == 2 and seen
    assert {"_send_heartbeats", "serialize", "ssl"} <= {name.rsplit(".", 1)[1] for name in seen[0]}, seen[0]
    assert [vars(owner)[name] for owner, name in targets] == own


def test_the_event_targets_are_where_prefect_calls_them():
    """``skip_pending_events`` wraps the task engine's module-level ``emit_task_run_state_change_event``,
    which the engine calls by that name with no initial state only when it creates a run."""
    import inspect

    import prefect.task_engine as task_engine

    engine = inspect.getsource(task_engine.SyncTaskRunEngine)
    assert engine.count("initial_state=None") == 1 and "_create_task_run_locally" in engine
    assert "emit_task_run_state_change_event(" in inspect.getsource(task_engine.SyncTaskRunEngine.set_state)
