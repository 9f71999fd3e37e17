"""Prefect's settings context serialized once, not once per task submitted to Dask.

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
