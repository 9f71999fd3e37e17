"""Prefect's contexts serialized once per flow on the driver and validated once per worker, not once
per task (:func:`cache_settings_serialization`, :func:`cache_settings_hydration`). Installed through
:mod:`.gate`.

Prefect 3.8's ``DaskTaskRunner.submit`` ships the caller's context with every task
(``prefect.context.serialize_context``), most of it ``SettingsContext.serialize()``, a pydantic dump
of the whole settings model; its task engine rebuilds that context for every task it runs. Every
task of a flow run carries the same settings and the same flow run. (The flow run's context is
still dumped on every submit: caching that dump bought too little to keep; ``benchmarks/README.md``.)
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from espnet3_flows.orchestration.prefect_private.gate import install_wrapper, unpatched_target


def cache_settings_serialization() -> bool:
    """Make ``SettingsContext.serialize`` reuse its last result for the same context (idempotent).

    The result is reused while the settings context is the very same object, with the same profile
    and settings objects; new settings (``temporary_settings``, another profile) are new objects,
    serialized afresh. Callers get copies, so none can change what a later task receives.

    Returns:
        Whether the cache is installed (``False`` if Prefect's class has no ``serialize``).
    """
    from prefect.context import SettingsContext

    ok, original = unpatched_target(SettingsContext, "serialize", "cache_settings_serialization")
    if original is None:
        return ok
    lock = threading.Lock()
    last: dict[str, Any] = {}

    def serialize(self: Any, include_secrets: bool = True) -> dict[str, Any]:
        key = (self, self.profile, self.settings, include_secrets)  # the same objects: compared by identity
        with lock:
            hit = last.get("key")
            if hit is not None and all(a is b for a, b in zip(hit, key, strict=True)):
                return copy.deepcopy(last["value"])
        value = original(self, include_secrets=include_secrets)
        with lock:
            last.update(key=key, value=value)
        return copy.deepcopy(value)

    return install_wrapper(SettingsContext, "serialize", serialize, original)


def cache_settings_hydration() -> bool:
    """On a worker: validate each distinct serialized settings context once, not once per task,
    and each flow run's context once per worker thread.

    Prefect 3.8's task engine rebuilds the caller's context for every task it runs
    (``prefect.context.hydrated_context``), and ``SettingsContext(**serialized)`` makes
    pydantic-settings build a whole ``Settings`` again: read the environment, the profiles and
    the TOML files. Every task of a flow carries the same settings, so this keeps the
    validated settings per serialized form (its JSON text) and enters a fresh context built from
    them for each task; different settings are validated afresh.

    The flow run's context is the same for every task of a flow run too, but Prefect validates it
    again for each (``FlowRunContext(**serialized)``, with a new API client and a copy of the
    flow's task runner). This validates it once per worker thread and flow run, and enters a copy of
    it for each task whose per-run collections (results, dynamic keys, assets) are new, as
    Prefect's would be. Idempotent.

    Returns:
        Whether the cache is installed (``False`` when Prefect's task engine has no
        ``hydrated_context`` to wrap).
    """
    import prefect.task_engine as task_engine

    ok, original = unpatched_target(task_engine, "hydrated_context", "cache_settings_hydration")
    if original is None:
        return ok
    cache = _HydrationCache(original)

    def hydrated_context(serialized_context: dict[str, Any] | None = None, client: Any = None) -> Any:
        return cache.hydrated_context(serialized_context, client)

    return install_wrapper(task_engine, "hydrated_context", hydrated_context, original)


class _HydrationCache:
    """The state of :func:`cache_settings_hydration`'s wrapper of ``hydrated_context``: validated
    settings by their JSON text (the last few), and per worker thread the last flow run's context."""

    def __init__(self, original: Callable[..., Any]):
        self.original = original
        self.lock = threading.Lock()
        self.validated: OrderedDict[str, Any] = OrderedDict()
        self.per_thread = threading.local()

    def settings(self, serialized: dict[str, Any]) -> tuple[str, Any]:
        """``(key, validated SettingsContext)``: validated once per distinct settings."""
        from prefect.context import SettingsContext

        key = json.dumps(serialized, sort_keys=True, default=str)
        with self.lock:
            ctx = self.validated.get(key)
        if ctx is None:
            ctx = SettingsContext(**serialized)
            with self.lock:
                self.validated[key] = ctx
                while len(self.validated) > 4:
                    self.validated.popitem(last=False)
        return key, ctx

    def flow_run_context(self, serialized: dict[str, Any], key: str, client: Any) -> tuple[Any, Any] | None:
        """(API client, validated flow run context) for this thread, built once per flow run."""
        from prefect.context import FlowRunContext

        flow_run = serialized.get("flow_run")
        run_id = flow_run.get("id") if isinstance(flow_run, dict) else getattr(flow_run, "id", None)
        if run_id is None or "flow" not in serialized:
            return None
        cached = getattr(self.per_thread, "flow_run", None)
        if cached is None or cached[0] != (str(run_id), key):
            from prefect._internal.result_records import ResultRecordMetadata
            from prefect.client.orchestration import get_client
            from prefect.flows import Flow
            from prefect.tasks import Task

            FlowRunContext.model_rebuild(_types_namespace={"Flow": Flow, "Task": Task,
                                                           "ResultRecordMetadata": ResultRecordMetadata})
            client = client or get_client(sync_client=True)
            task_runner = serialized["flow"].task_runner.duplicate().__enter__()  # kept for the thread's tasks
            template = FlowRunContext(**serialized, client=client, task_runner=task_runner, detached=True)
            cached = self.per_thread.flow_run = ((str(run_id), key), client, template)
        return cached[1], cached[2]

    @staticmethod
    def fresh_copy(template: Any, serialized: dict[str, Any]) -> Any:
        """The context Prefect would build: the validated fields, new per-run collections."""
        new = {name: field.default_factory() for name, field in type(template).model_fields.items()
               if field.default_factory is not None and name not in serialized}
        return template.model_copy(update=new)

    @contextlib.contextmanager
    def hydrated_context(self, serialized_context: dict[str, Any] | None = None, client: Any = None):
        """Prefect's ``hydrated_context``, with the settings and the flow run's context reused."""
        from prefect.context import SettingsContext

        settings = (serialized_context or {}).get("settings_context")
        if not settings:
            with self.original(serialized_context, client):
                yield
            return
        key, ctx = self.settings(settings)
        rest = {k: v for k, v in serialized_context.items() if k != "settings_context"}  # type: ignore[union-attr]
        with SettingsContext.model_construct(profile=ctx.profile, settings=ctx.settings):  # a fresh context object
            serialized_flow = rest.get("flow_run_context")
            cached = self.flow_run_context(serialized_flow, key, client) if serialized_flow else None
            if cached is None:
                with self.original(rest, client):
                    yield
                return
            cached_client, template = cached
            rest.pop("flow_run_context")
            with self.fresh_copy(template, serialized_flow), self.original(rest, cached_client):
                yield
