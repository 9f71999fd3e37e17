"""One verified TLS context per CA file for Prefect's API clients in this process.

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
"""

from __future__ import annotations

import os
import ssl
import threading
from typing import Any

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

    module = importlib.import_module(_TARGET)
    current = getattr(module, "ssl", None)
    if isinstance(current, _SharedContextSSL):
        return True
    if current is not ssl:
        return False
    module.ssl = _SharedContextSSL()  # type: ignore[attr-defined]
    return True


__all__ = ["share_tls_contexts"]
