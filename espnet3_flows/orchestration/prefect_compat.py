"""Every patch of Prefect's internals this project makes, in one place, each behind a version guard.

They are speed-ups, not fixes: with a Prefect version they were not verified against
(:data:`VERIFIED_PREFECT`), none is installed, a warning says so, and runs are correct but
slower. ``tests/orchestration/test_prefect_compat.py`` fails when the installed Prefect is not
a verified one, so that a pin change re-verifies them. ``ESPNET3_FLOWS_PATCHES=off`` in the
environment turns every one of them off (to tell whether one is behind a problem; runs stay
correct, with more overhead per shard task): a test runs a flow so.

**Shared TLS contexts.** One verified TLS context per CA file for Prefect's API clients in this process.

Prefect 3.8's ``PrefectClient`` and ``SyncPrefectClient`` build a fresh ``ssl.SSLContext``
from the CA bundle every time one is constructed (``ssl.create_default_context(cafile=...)``,
~20 ms of CPU: OpenSSL parses the whole bundle), and a task run on a Dask worker constructs
two of them. Over a few hundred shard tasks that is whole seconds of worker CPU taken from the
features. Upstream tracks this (PrefectHQ/prefect#14986 removed some clients; #19106 proposes
reusable contexts); until a release takes a context from settings, :func:`share_tls_contexts`
gives Prefect's client module an ``ssl`` whose verified contexts are built once per
``(purpose, cafile, capath)`` and then shared.

Verification is unchanged: the shared context is the one Prefect would have built (certificate
and hostname checks on), and Prefect never modifies a verified context after creating it. The
unverified context of ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` (built without a CA file and then
modified by Prefect) is never shared. A changed CA file (size or mtime) gets a new context.

**Settings serialized once.** Prefect's settings context serialized once per flow on the driver, and validated once per
worker, not once per task.

Prefect 3.8's ``DaskTaskRunner.submit`` ships the caller's context with every task
(``prefect.context.serialize_context``), and most of that is ``SettingsContext.serialize()``: a
pydantic dump of the whole settings model, ~30 ms of the driver's CPU per shard task
(``benchmarks/bench_overhead.py``). Every task of a flow run carries the same settings, so
:func:`cache_settings_serialization` keeps the last serialization and hands out copies of it
while the current settings context is the very same object (same profile and settings
objects). New settings (``temporary_settings``, another profile) are new objects, so they are
serialized afresh; the copies mean no caller can change what a later task receives.

**Heartbeats that stop at once.** :func:`prompt_heartbeat_stop`: a flow run's heartbeat thread
wakes when the run ends instead of finishing a one-second sleep (0–1 s at the end of every run).

**No draining into a dead server.** :func:`drop_undeliverable_api_work`: after the API server is
lost, Prefect's queued events and logs are dropped instead of drained at exit (~7 s each).
"""

from __future__ import annotations

import copy
import logging
import os
import ssl
import threading
from typing import Any, Callable

from espnet3_flows import patches

#: Prefect versions these patches were verified against (their targets read, tests run)
VERIFIED_PREFECT = ("3.8.8",)
#: prefect-dask versions :func:`untokenized_task_keys` was verified against
VERIFIED_PREFECT_DASK = ("0.3.7",)
#: ``off`` in this variable: no patch of Prefect is installed (nor of any library: :mod:`espnet3_flows.patches`)
PATCHES_ENV = patches.ENV
_LOG = logging.getLogger(__name__)
_WARNED: list[str] = []


def prefect_verified() -> bool:
    """Whether the patches may be installed: the installed Prefect is one they were verified
    against (warns once if not) and :data:`PATCHES_ENV` does not turn them off."""
    import prefect

    if not patches.patches_enabled():
        return False
    if prefect.__version__ in VERIFIED_PREFECT:
        return True
    if not _WARNED:
        _WARNED.append(prefect.__version__)
        _LOG.warning("Prefect %s is not one of %s, which espnet3_flows' speed-ups of Prefect's internals were "
                     "verified with: they are off (runs are correct, with more overhead per shard task)",
                     prefect.__version__, ", ".join(VERIFIED_PREFECT))
    return False


def _unpatched(owner: Any, name: str, verified: bool = True) -> tuple[bool, Any]:
    """What a patch wraps: ``(True, original)`` for ``owner``'s own ``name`` (in its ``__dict__``);
    ``(True, None)`` when our wrapper is there already; ``(False, None)`` when it cannot be
    installed: Prefect (or ``verified``, a further version check) is not a verified version, or
    ``owner`` has no such attribute."""
    if not verified or not prefect_verified():
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

    if not prefect_verified():
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


def cache_settings_serialization() -> bool:
    """Make ``SettingsContext.serialize`` reuse its last result for the same context (idempotent).

    Returns:
        Whether the cache is installed (``False`` if Prefect's class has no ``serialize``).
    """
    from prefect.context import SettingsContext

    return _memoize_serialize(SettingsContext,
                              lambda self, secrets: (self, self.profile, self.settings, secrets), copy.deepcopy)


def _memoize_serialize(cls: type, key_of: Callable[[Any, bool], tuple[Any, ...]],
                       copy_of: Callable[[dict[str, Any]], dict[str, Any]]) -> bool:
    """Make ``cls.serialize`` return a copy (``copy_of``) of its last result while ``key_of(self,
    include_secrets)`` holds the same objects (compared by identity); idempotent. ``False`` when
    Prefect is not a verified version or ``cls`` has no ``serialize`` of its own."""
    ok, original = _unpatched(cls, "serialize")
    if original is None:
        return ok
    lock = threading.Lock()
    last: dict[str, Any] = {}

    def serialize(self: Any, include_secrets: bool = True) -> dict[str, Any]:
        key = key_of(self, include_secrets)
        with lock:
            hit = last.get("key")
            if hit is not None and len(hit) == len(key) and all(a is b for a, b in zip(hit, key)):
                return copy_of(last["value"])
        value = original(self, include_secrets=include_secrets)
        with lock:
            last.update(key=key, value=value)
        return copy_of(value)

    return _patch(cls, "serialize", serialize, original)


def _patch(owner: Any, name: str, wrapper: Any, original: Any) -> bool:
    """Set ``owner.name = wrapper`` (a wrapper of ``original``, marked as ours so that installing it
    again is a no-op); returns ``True``."""
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)
    return True


def cache_settings_hydration() -> bool:
    """On a worker: validate each distinct serialized settings context once, not once per task,
    and each flow run's context once per worker thread.

    Prefect 3.8's task engine rebuilds the caller's context for every task it runs
    (``prefect.context.hydrated_context``), and ``SettingsContext(**serialized)`` makes
    pydantic-settings build a whole ``Settings`` again: read the environment, the profiles and
    the TOML files. In a profile of a collect-stats flow that was 38 % of a worker's CPU
    (``py-spy``, 400 shards). Every task of a flow carries the same settings, so this keeps the
    validated settings per serialized form (its JSON text) and enters a fresh context built from
    them for each task; different settings are validated afresh.

    The flow run's context is the same for every task of a flow run too, but Prefect validates it
    again for each (``FlowRunContext(**serialized)``, with a new API client and a copy of the
    flow's task runner: ~1.8 ms of a worker's CPU per shard task, 13 % of Prefect's part, in a
    profile of 1,000). This validates it once per worker thread and flow run, and enters a copy of
    it for each task whose per-run collections (results, dynamic keys, assets) are new, as
    Prefect's would be. Idempotent.

    Returns:
        Whether the cache is installed (``False`` when Prefect's task engine has no
        ``hydrated_context`` to wrap).
    """
    import contextlib
    import json
    from collections import OrderedDict

    import prefect.task_engine as task_engine
    from prefect.context import FlowRunContext, SettingsContext

    ok, original = _unpatched(task_engine, "hydrated_context")
    if original is None:
        return ok
    lock = threading.Lock()
    validated: OrderedDict[str, Any] = OrderedDict()
    per_thread = threading.local()

    def flow_run_context(serialized: dict[str, Any], key: str, client: Any) -> tuple[Any, Any] | None:
        """(API client, validated flow run context) for this thread, built once per flow run."""
        flow_run = serialized.get("flow_run")
        run_id = flow_run.get("id") if isinstance(flow_run, dict) else getattr(flow_run, "id", None)
        if run_id is None or "flow" not in serialized:
            return None
        cached = getattr(per_thread, "flow_run", None)
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
            cached = per_thread.flow_run = ((str(run_id), key), client, template)
        return cached[1], cached[2]

    def fresh_copy(template: Any, serialized: dict[str, Any]) -> Any:
        """The context Prefect would build: the validated fields, new per-run collections."""
        new = {name: field.default_factory() for name, field in type(template).model_fields.items()
               if field.default_factory is not None and name not in serialized}
        return template.model_copy(update=new)

    @contextlib.contextmanager
    def hydrated_context(serialized_context: dict[str, Any] | None = None, client: Any = None):
        settings = (serialized_context or {}).get("settings_context")
        if not settings:
            with original(serialized_context, client):
                yield
            return
        key = json.dumps(settings, sort_keys=True, default=str)
        with lock:
            ctx = validated.get(key)
        if ctx is None:
            ctx = SettingsContext(**settings)  # validated once per distinct settings
            with lock:
                validated[key] = ctx
                while len(validated) > 4:
                    validated.popitem(last=False)
        rest = {k: v for k, v in serialized_context.items() if k != "settings_context"}  # type: ignore[union-attr]
        with SettingsContext.model_construct(profile=ctx.profile, settings=ctx.settings):  # a fresh context object
            serialized_flow = rest.get("flow_run_context")
            cached = flow_run_context(serialized_flow, key, client) if serialized_flow else None
            if cached is None:
                with original(rest, client):
                    yield
                return
            cached_client, template = cached
            rest.pop("flow_run_context")
            with fresh_copy(template, serialized_flow), original(rest, cached_client):
                yield

    return _patch(task_engine, "hydrated_context", hydrated_context, original)


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

    ok, original = _unpatched(PrefectDaskClient, "submit",
                              getattr(prefect_dask, "__version__", None) in VERIFIED_PREFECT_DASK)
    if original is None:
        return ok

    def submit(self: Any, func: Any, *args: Any, key: Any = None, pure: bool = True, **kwargs: Any) -> Any:
        if isinstance(func, Task) and key is None:
            pure = False
        return original(self, func, *args, key=key, pure=pure, **kwargs)

    return _patch(PrefectDaskClient, "submit", submit, original)


def cache_flow_context_serialization() -> bool:
    """Make ``EngineContext.serialize`` (the flow run's context, shipped with every task a
    ``DaskTaskRunner`` submits) reuse its last result while nothing it covers changed (idempotent).

    Prefect 3.8 dumps the flow run's context with pydantic on every submit (the flow run, the
    flow, its parameters, the result store), ~1.8 ms of the driver's CPU per shard task in a
    profile of 600. The cache is keyed by the identity of every field the dump covers and by the
    flow run's state, so a new flow run, new parameters or a state change dumps afresh; callers
    get a copy of the top-level dict (Dask pickles it at once).

    Returns:
        Whether installed (``False`` if Prefect's class has no ``serialize``).
    """
    from prefect.context import EngineContext

    fields = ("flow_run", "flow", "parameters", "log_prints", "start_time", "input_keyset", "persist_result",
              "result_store")

    def key_of(self: Any, include_secrets: bool) -> tuple[Any, ...]:
        run = getattr(self, "flow_run", None)
        return (self, include_secrets, getattr(run, "state_type", None), getattr(run, "state_name", None),
                *(getattr(self, f, None) for f in fields))

    return _memoize_serialize(EngineContext, key_of, dict)


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

    ok, original = _unpatched(flow_engine, "_send_heartbeats")
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
                except Exception:  # noqa: BLE001 - as Prefect's: a missed heartbeat is not the run's failure
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

    return _patch(flow_engine, "_send_heartbeats", send_heartbeats, original)


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
    # what is still in flight fails once more: not onto the console, after the run's error line
    logging.raiseExceptions = False  # Prefect's log shipper writes its failures unless this is off
    for name in ("prefect._internal.concurrency", "prefect.events.clients", "EventsWorker", "APILogWorker"):
        logging.getLogger(name).disabled = True  # not a level: Prefect's internal loggers ignore levels
    if not prefect_verified():
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
