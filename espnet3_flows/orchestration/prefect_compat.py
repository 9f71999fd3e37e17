"""Every patch of Prefect's internals this project makes, in one place, each behind a version guard.

They are speed-ups, not fixes: with a Prefect version they were not verified against
(:data:`VERIFIED_PREFECT`), none is installed, a warning says so, and runs are correct but
slower. ``tests/orchestration/test_prefect_compat.py`` fails when the installed Prefect is not
a verified one, so that a pin change re-verifies them.

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
"""

from __future__ import annotations

import copy
import logging
import os
import ssl
import threading
from typing import Any

#: Prefect versions these patches were verified against (their targets read, tests run)
VERIFIED_PREFECT = ("3.8.8",)
_LOG = logging.getLogger(__name__)
_WARNED: list[str] = []


def prefect_verified() -> bool:
    """Whether the installed Prefect is one the patches were verified against (warns once if not)."""
    import prefect

    if prefect.__version__ in VERIFIED_PREFECT:
        return True
    if not _WARNED:
        _WARNED.append(prefect.__version__)
        _LOG.warning("Prefect %s is not one of %s, which espnet3_flows' speed-ups of Prefect's internals were "
                     "verified with: they are off (runs are correct, with more overhead per shard task)",
                     prefect.__version__, ", ".join(VERIFIED_PREFECT))
    return False


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

    if not prefect_verified():
        return False
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

    if not prefect_verified():
        return False
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
