"""Prefect's API clients and prefect-dask's client: verified TLS contexts shared per CA file
(:func:`share_tls_contexts`), and Dask keys that are not a token of a task's arguments
(:func:`untokenized_task_keys`). Installed through :mod:`.gate`."""

from __future__ import annotations

import importlib
import os
import ssl
import threading
from typing import Any

from espnet3_flows.orchestration.prefect_private.gate import (
    VERIFIED_PREFECT_DASK,
    install_wrapper,
    unpatched_target,
)

_TARGET = "prefect.client.orchestration"


class _SharedContextSSL:
    """Stands in for the ``ssl`` module inside Prefect's client module: verified default contexts
    built once per ``(purpose, cafile, capath)`` and the files' size and mtime, then shared."""

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

    Prefect 3.8's ``PrefectClient`` and ``SyncPrefectClient`` build a fresh ``ssl.SSLContext`` from
    the CA bundle each time one is made (OpenSSL parses the whole bundle), and a task run on a Dask
    worker makes two (upstream: PrefectHQ/prefect#19106). Verification is unchanged: the shared
    context is the one Prefect would build, with certificate and hostname checks on, and Prefect
    never changes a verified context after making it. The unverified context of
    ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` (built without a CA file, then changed) is never
    shared; a changed CA file gets a new context.

    Returns:
        ``True`` if installed (or already), ``False`` if turned off, Prefect is not a verified
        version, or its client module does not use ``ssl`` the way this replaces.
    """
    module = importlib.import_module(_TARGET)
    ok, original = unpatched_target(module, "ssl", "share_tls_contexts")
    if original is None:
        return ok
    if original is not ssl:
        return False
    return install_wrapper(module, "ssl", _SharedContextSSL(), original)


def untokenized_task_keys() -> bool:
    """Give Prefect tasks submitted to Dask a random key instead of a token of their arguments
    (idempotent).

    prefect-dask 0.3's ``DaskTaskRunner.submit`` calls ``Client.submit`` with Dask's default
    ``pure=True``, so Dask names each task by ``tokenize``-ing its whole argument set: the task, its
    parameters and the serialized Prefect context (the settings included), a large share of the driver's
    CPU per shard task (figures: ``benchmarks/README.md``). The arguments hold
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
