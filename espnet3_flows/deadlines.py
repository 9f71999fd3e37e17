"""Deadlines of object-store calls: no storage call waits forever on an endpoint that stalls.

What the libraries do on their own (s3fs 2026.9, aiobotocore 3.10, aiohttp 3.14, read in their
source): botocore's ``connect_timeout`` and ``read_timeout`` become aiohttp's ``sock_connect`` and
``sock_read``; ``sock_read`` is an inactivity deadline (no byte for that long), armed once a request
is sent. aiohttp arms nothing while it sends a request body, and botocore's PUTs wait for
``100 Continue``: an upload to an endpoint that accepts connections and never answers (a paused
server, a stuck proxy) waits forever. And each timeout is retried by botocore (``retries``) inside
s3fs's own retries (``retries=5``), which multiplies every wait.

So every fsspec call this package makes to S3 gets :func:`with_deadlines` options (botocore's
``config_kwargs`` ``connect_timeout``, ``read_timeout`` and ``retries``, each where the user set
none), and every blocking call through :class:`DeadlineFileSystem` (what
:class:`~espnet3_flows.storage.Storage` uses) that is not a download has a ceiling,
``attempts × (connect_timeout + read_timeout) + bytes sent / MIN_UPLOAD_RATE``: it scales with the
size of an upload, so a large file on a slow link is not cut, while a stalled endpoint fails the
call within the ceiling as :class:`StorageTimeout`, which names the endpoint; for one ceiling
after that, this process's calls to that endpoint fail at once with the same error (the shards
queued behind fail fast and the run ends, instead of each waiting out the deadline). Downloads and
listings keep ``read_timeout`` as their deadline (it never fires while bytes arrive): on a stalled
endpoint one fails after ``attempts × (connect_timeout + read_timeout)`` (through ``Storage``,
where s3fs's own retries are set to one try; elsewhere s3fs's 5 tries multiply it).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any
from collections.abc import Callable, Mapping

from fsspec.asyn import AsyncFileSystem

from espnet3_flows.errors import Espnet3FlowsError, causes, clip

#: Seconds to open a connection (botocore ``connect_timeout``), when storage_options set none
CONNECT_TIMEOUT = 10.0
#: Seconds without a byte of a response before a request fails (botocore ``read_timeout``)
READ_TIMEOUT = 30.0
#: Attempts of one request, the first included (botocore ``retries: {total_max_attempts, mode: standard}``)
MAX_ATTEMPTS = 3
#: s3fs's own tries around botocore's attempts (its class default is 5, which multiplies every
#: deadline by 5); set on the file systems :class:`~espnet3_flows.storage.Storage` uses
S3FS_RETRIES = 1
#: Bytes per second an upload is allowed at least (256 KiB/s, 2 Mbit/s: 68 min for 1 GB)
MIN_UPLOAD_RATE = 256 * 1024
#: Protocols given the defaults above (botocore's keys)
S3_PROTOCOLS = ("s3", "s3a")
#: Blocking calls whose only deadline is ``read_timeout``: their responses (a download, a listing
#: of many pages) may be large, and aiohttp's read timer is armed for them as they send no body
_READS = frozenset({"cat", "cat_file", "cat_ranges", "get", "get_file", "open", "read_block", "ls", "find", "glob",
                    "walk", "du", "expand_path"})
#: Calls that send data, and how many bytes: ``(args, kwargs) -> bytes``
_UPLOADS: dict[str, Callable[[tuple, dict], int]] = {
    "pipe_file": lambda a, k: len(a[1] if len(a) > 1 else k.get("value", b"")),
    "put_file": lambda a, k: os.path.getsize(a[0] if a else k["lpath"]),
}


#: botocore's errors of a request that timed out (connecting, or waiting for response bytes)
_CLIENT_TIMEOUTS = ("ConnectTimeoutError", "ReadTimeoutError")


#: endpoint → (monotonic time until which its calls fail at once, the message of its timeout)
_DOWN: dict[str, tuple[float, str]] = {}


class StorageTimeout(Espnet3FlowsError, TimeoutError):
    """A storage endpoint did not answer a call within its deadline (an outage: the shard fails
    and is retried, never a bad item); the message names the endpoint and the deadlines."""


def _protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def with_deadlines(options: Mapping[str, Any] | None, url: str) -> dict[str, Any]:
    """fsspec ``storage_options`` for ``url`` with the deadline defaults of this module filled in
    where they are not set (S3 only; other protocols' options are returned as they are)."""
    out = dict(options or {})
    if _protocol(url) not in S3_PROTOCOLS:
        return out
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT)
    config.setdefault("read_timeout", READ_TIMEOUT)
    # a copy: botocore rewrites the dict it is given (max_attempts becomes total_max_attempts)
    config["retries"] = dict(config.get("retries") or {"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"})
    out["config_kwargs"] = config
    return out


def endpoint_of(options: Mapping[str, Any] | None, url: str) -> str:
    """The endpoint a store's calls go to, for messages: ``client_kwargs.endpoint_url``,
    ``endpoint_url``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else the protocol's default."""
    opts = options or {}
    found = (opts.get("client_kwargs") or {}).get("endpoint_url") or opts.get("endpoint_url")
    if not found and _protocol(url) in S3_PROTOCOLS:
        found = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    return str(found or _protocol(url))


class DeadlineFileSystem:
    """An fsspec file system whose blocking calls each end by a deadline (see the module's
    docstring); everything else passes through to the wrapped ``fs`` (``fs.fs``)."""

    def __init__(self, fs: AsyncFileSystem, options: Mapping[str, Any], url: str):
        self.fs = fs
        config = with_deadlines(options, url).get("config_kwargs") or {}
        self.connect = float(config.get("connect_timeout", CONNECT_TIMEOUT))
        self.read = float(config.get("read_timeout", READ_TIMEOUT))
        retries = config.get("retries") or {}
        # botocore: ``max_attempts`` counts retries, ``total_max_attempts`` the first try too
        self.attempts = max(1, int(retries["total_max_attempts"]) if "total_max_attempts" in retries
                            else int(retries.get("max_attempts", MAX_ATTEMPTS - 1)) + 1)
        self.endpoint = endpoint_of(options, url)

    def __repr__(self) -> str:
        return f"DeadlineFileSystem({self.fs!r}, endpoint={self.endpoint!r})"

    def ceiling(self, sent: int = 0) -> float:
        """Seconds a call that sends ``sent`` bytes may take, retries included."""
        return self.attempts * (self.connect + self.read) + sent / MIN_UPLOAD_RATE

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fs, name)
        # the blocking twins of the async methods take ``timeout``: fsspec's ``sync`` cancels the
        # coroutine (its connections too) when it passes
        if name.startswith("_") or not callable(attr) \
                or not asyncio.iscoroutinefunction(getattr(self.fs, f"_{name}", None)):
            return attr
        return functools.partial(self._call, name, attr)

    def _call(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        down = _DOWN.get(self.endpoint)
        if down is not None and time.monotonic() < down[0]:
            # it timed out moments ago: the shards queued behind that one fail at once, not each
            # after the whole deadline, and the run ends; the hold passes, and a call tries again
            raise StorageTimeout(f"{down[1]} (calls to it fail at once for {self.ceiling():.0f} s after that)")
        seconds = None if name in _READS else self.ceiling(_UPLOADS[name](args, kwargs) if name in _UPLOADS else 0)
        try:
            result = method(*args, timeout=seconds, **kwargs)
        except Exception as exc:
            # fsspec's FSTimeoutError (our ceiling) or botocore's own timeouts: the same outage
            if not isinstance(exc, asyncio.TimeoutError) and type(exc).__name__ not in _CLIENT_TIMEOUTS:
                raise
            within = f"within {seconds:.0f} s" if seconds else "in time"
            target = clip(str(args[0])) if args else ""
            message = (f"storage endpoint {self.endpoint} did not answer {within} ({name} {target}); "
                       f"deadlines from storage_options.config_kwargs: connect_timeout={self.connect:g}, "
                       f"read_timeout={self.read:g}, retries.total_max_attempts={self.attempts}")
            _DOWN[self.endpoint] = (time.monotonic() + self.ceiling(), message)
            raise StorageTimeout(message) from exc
        _DOWN.pop(self.endpoint, None)
        return result


def bounded_filesystem(fs: Any, options: Mapping[str, Any] | None, url: str) -> Any:
    """``fs`` with deadlines on its blocking calls (:class:`DeadlineFileSystem`) when it is an
    asynchronous (network) file system used from blocking code; otherwise ``fs`` itself."""
    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
        if _protocol(url) in S3_PROTOCOLS:
            fs.retries = S3FS_RETRIES  # an instance attribute over s3fs's class default
        return DeadlineFileSystem(fs, options or {}, url)
    return fs


def is_outage(exc: BaseException | None) -> bool:
    """Whether ``exc`` or one of its causes is a storage endpoint not answering in time
    (:class:`StorageTimeout`, or botocore's connect or read timeout)."""
    return any(isinstance(e, StorageTimeout) or type(e).__name__ in _CLIENT_TIMEOUTS for e in causes(exc))


def is_unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc`` or one of its causes is a connection that could not be made (a store down
    or not listening: an outage, not a wrong setting), as opposed to a store that answered no."""
    return any(isinstance(e, ConnectionError) or type(e).__name__ in ("EndpointConnectionError", "ClientConnectorError")
               for e in causes(exc))
