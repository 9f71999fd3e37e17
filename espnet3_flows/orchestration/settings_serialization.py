"""Prefect's settings context serialized once per flow on the driver, and validated once per
worker, not once per task.

Prefect 3.8's ``DaskTaskRunner.submit`` ships the caller's context with every task
(``prefect.context.serialize_context``), and most of that is ``SettingsContext.serialize()``: a
pydantic dump of the whole settings model, ~30 ms of the driver's CPU per shard task
(``benchmarks/bench_overhead.py``). Every task of a flow run carries the same settings, so
:func:`cache_settings_serialization` keeps the last serialization and hands out copies of it
while the current settings context is the very same object (same profile and settings
objects). New settings (``temporary_settings``, another profile) are new objects, so they are
serialized afresh; the copies mean no caller can change what a later task receives.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

_MARK = "_espnet3_cached_serialization"


def cache_settings_serialization() -> bool:
    """Make ``SettingsContext.serialize`` reuse its last result for the same context (idempotent).

    Returns:
        Whether the cache is installed (``False`` if Prefect's class has no ``serialize``).
    """
    from prefect.context import SettingsContext

    original = SettingsContext.__dict__.get("serialize")
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    lock = threading.Lock()
    last: dict[str, Any] = {}

    def serialize(self: Any, include_secrets: bool = True) -> dict[str, Any]:
        key = (self, self.profile, self.settings, include_secrets)
        with lock:
            hit = last.get("key")
            if hit is not None and all(a is b for a, b in zip(hit, key)):
                return copy.deepcopy(last["value"])
        value = original(self, include_secrets=include_secrets)
        with lock:
            last.update(key=key, value=value)
        return copy.deepcopy(value)

    serialize.__doc__ = original.__doc__
    serialize.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(serialize, _MARK, True)
    SettingsContext.serialize = serialize  # type: ignore[method-assign]
    return True


def cache_settings_hydration() -> bool:
    """On a worker: validate each distinct serialized settings context once, not once per task.

    Prefect 3.8's task engine rebuilds the caller's context for every task it runs
    (``prefect.context.hydrated_context``), and ``SettingsContext(**serialized)`` makes
    pydantic-settings build a whole ``Settings`` again: read the environment, the profiles and
    the TOML files. In a profile of a collect-stats flow that was 38 % of a worker's CPU
    (``py-spy``, 400 shards). Every task of a flow carries the same settings, so this keeps the
    validated settings per serialized form (its JSON text) and enters a fresh context built from
    them for each task; different settings are validated afresh. Idempotent.

    Returns:
        Whether the cache is installed (``False`` when Prefect's task engine has no
        ``hydrated_context`` to wrap).
    """
    import contextlib
    import json
    from collections import OrderedDict

    import prefect.task_engine as task_engine
    from prefect.context import SettingsContext

    original = getattr(task_engine, "hydrated_context", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    lock = threading.Lock()
    validated: OrderedDict[str, Any] = OrderedDict()

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
            with original(rest, client):
                yield

    hydrated_context.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(hydrated_context, _MARK, True)
    task_engine.hydrated_context = hydrated_context  # type: ignore[attr-defined]
    return True
