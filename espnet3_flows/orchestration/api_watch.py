"""Noticing that a flow run's Prefect API server is gone, so that a deployment's run ends in bounded
time: its remaining API calls give up at once, the storage work it can still do (a merge) is done,
and a worker's flow-run process exits with one ``error:`` line.

Prefect 3.8's client retries a refused connection 5 times (2, 4, 8, 16, 32 s: about a minute per
call, ``PREFECT_CLIENT_MAX_RETRIES``) once it has connected before, and a run makes calls one after
another (progress artifacts, reports, its subflow's and its own final state): a deployment's run
whose server was killed took ~6 minutes to end, and never merged, although the merge is storage
work only. So while a job's flow runs, a thread connects to the API's port every second; refused
(or unreachable) for :data:`LOST_AFTER_SECONDS` in a row, the API is declared lost: the client's
retries drop to 0 (each call in progress fails at its next try), queued events and logs are dropped,
artifact calls are skipped (:func:`api_call`), no further shard is awaited, merges under way finish,
and a worker's flow-run process (``PREFECT__FLOW_RUN_ID``) ends :data:`EXIT_GRACE_SECONDS` after
that at the latest. A server that answers slowly (a busy database) is not lost: only a refused or
unreachable port counts. No Prefect internals are patched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from typing import Any
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

#: How long the API's port must refuse connections before the API is declared lost (a server
#: restarted on an existing database answers again in ~5-8 s)
LOST_AFTER_SECONDS = 10.0
#: After the loss (and any merge under way), how long a worker's flow-run process may take to end
EXIT_GRACE_SECONDS = 15.0
#: How long a worker's flow-run process that lost its API waits for merges under way at most
MERGE_WAIT_SECONDS = 600.0
_lost = threading.Event()  # the watched API is declared lost
_watching = threading.Event()  # a run of this process watches its API
_merging = [0]  # merges under way (hold_while)
_lock = threading.Lock()


def api_lost_now() -> bool:
    """Whether this process's run declared its Prefect API lost."""
    return _lost.is_set()


def lost_error() -> BaseException:
    """An error that :func:`~.deploy_steps.is_api_lost` recognizes, for a run stopped by the watch."""
    import httpx

    return httpx.ConnectError(f"the API's port refused connections for {LOST_AFTER_SECONDS:.0f} s")


def api_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, an API call the run can do without (an artifact): skipped once the
    API is lost, abandoned (``None``) if the loss is declared while it waits in Prefect's retries,
    and any failure of it after the loss ignored."""
    if _lost.is_set() or not _watching.is_set():
        return None if _lost.is_set() else fn(*args, **kwargs)
    thread = _Call(fn, args, kwargs)
    thread.start()
    while thread.is_alive() and not _lost.is_set():
        thread.join(0.2)
    if thread.is_alive() or (thread.error and _lost.is_set()):
        return None
    if thread.error:
        raise thread.error[0]
    return thread.result[0] if thread.result else None


def api_call_soon(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> _Call | None:
    """Start ``fn(*args, **kwargs)`` (as :func:`api_call`) in a thread of its own and return that
    thread without waiting: a progress update never holds the run up, even in Prefect's retries.
    Without a watch (the command line) ``fn`` is called here, and ``None`` returned."""
    if _lost.is_set() or not _watching.is_set():
        api_call(fn, *args, **kwargs)
        return None
    thread = _Call(fn, args, kwargs)
    thread.start()
    return thread


class _Call(threading.Thread):
    """An API call in a daemon thread, in the caller's context (its settings, its flow run)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        import contextvars

        super().__init__(daemon=True, name="api-call")
        self.call = (contextvars.copy_context(), fn, args, kwargs)
        self.result: list[Any] = []
        self.error: list[BaseException] = []

    def run(self) -> None:
        context, fn, args, kwargs = self.call
        try:
            self.result.append(context.run(fn, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller (api_call)
            self.error.append(exc)


def hold_while(future: Any) -> Any:
    """Keep a lost API's flow-run process alive until ``future`` (a merge: storage work) is done."""
    with _lock:
        _merging[0] += 1

    def release(_: Any) -> None:
        with _lock:
            _merging[0] -= 1

    future.add_done_callback(release)
    return future


@contextlib.contextmanager
def watching_api(interval: float = 1.0) -> Iterator[None]:
    """Watch the configured Prefect API while the block runs (nothing without a configured URL)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = str(settings.api.url or "")
    parts = urlsplit(url)
    if not parts.hostname or _watching.is_set():
        yield
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if _through_proxy(url) or _refused((parts.hostname, port), timeout=2.0):
        # the client reaches the API through a proxy, or this process cannot open its port itself
        # (a firewall that lets only the proxy out): a refused probe would say nothing of the API
        yield
        return
    stop = threading.Event()
    changed: list[Callable[[], None]] = []  # what puts the client settings back
    thread = threading.Thread(target=_watch, args=((parts.hostname, port), interval, stop, settings, changed),
                              daemon=True, name="prefect-api-watch")
    _watching.set()
    thread.start()
    try:
        yield
    finally:  # a process that goes on (a script, a notebook) gets its client back as it was
        stop.set()
        thread.join(timeout=interval * 2 + 3.5)  # a probe in progress ends; no loss is declared after this
        _watching.clear()
        _lost.clear()
        for undo in changed:  # the run's settings and the process's own
            undo()


def stop_client_retries(settings: Any) -> Callable[[], None]:
    """Turn off the retries of Prefect's client under ``settings`` (each call in progress fails at
    its next try) and return what puts them back exactly: the value, and the field left unset if it
    was (a field once set is serialized into every later settings context a worker gets)."""
    client = settings.client
    retries, was_set = client.max_retries, "max_retries" in client.model_fields_set
    client.max_retries = 0

    def undo() -> None:
        client.max_retries = retries
        if not was_set:
            client.model_fields_set.discard("max_retries")

    return undo


def _through_proxy(url: str) -> bool:
    """Whether an HTTP client of this process (httpx, as Prefect's) reaches ``url`` through a proxy
    (``HTTPS_PROXY``/``HTTP_PROXY``/``ALL_PROXY``, unless ``NO_PROXY`` names its host)."""
    import urllib.request

    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def _refused(address: tuple[str, int], timeout: float) -> bool:
    try:
        socket.create_connection(address, timeout=timeout).close()
        return False
    except OSError:  # refused, unreachable, or no answer to connect within the timeout
        return True


def _watch(address: tuple[str, int], interval: float, stop: threading.Event, settings: Any,
           changed: list[Callable[[], None]]) -> None:
    since = None
    while not stop.wait(interval):
        if not _refused(address, timeout=min(interval * 2, 3.0)):
            since = None
            continue
        since = since or time.monotonic()
        if time.monotonic() - since >= LOST_AFTER_SECONDS and not stop.is_set():
            _declare_lost(settings, changed)
            return


def _declare_lost(settings: Any, changed: list[Callable[[], None]]) -> None:
    """The API is gone: every further client call fails at once, nothing queued is drained into it,
    and a worker's flow-run process ends once its merges are done."""
    from prefect.settings import get_current_settings

    from espnet3_flows.orchestration.prefect_private.lifecycle import drop_undeliverable_api_work, quiet_shipper_failures

    _lost.set()
    for each in {id(settings): settings, id(s := get_current_settings()): s}.values():  # the run's, this thread's
        changed.append(stop_client_retries(each))  # put back when the watched block ends
    changed.append(quiet_shipper_failures())
    drop_undeliverable_api_work()
    if os.environ.get("PREFECT__FLOW_RUN_ID"):  # a worker's flow-run process: nothing else runs in it
        threading.Thread(target=_end_after_merges, name="end-after-lost-api", daemon=True).start()


def _end_after_merges() -> None:
    waited = time.monotonic() + MERGE_WAIT_SECONDS
    while _merging[0] > 0 and time.monotonic() < waited:
        time.sleep(0.2)
    time.sleep(EXIT_GRACE_SECONDS)  # time for the run to unwind (its cluster closed) and exit itself
    end_flow_run_process(lost_error())


def end_flow_run_process(exc: BaseException) -> None:
    """End a worker's flow-run process whose API is lost: its one ``error:`` line (printed once,
    :func:`~.deploy_steps.api_lost`), streams flushed, exit status 1. Nothing after this could
    reach the server (its state, its events); what the run wrote to storage is written."""
    from espnet3_flows.orchestration.deploy_steps import api_lost

    api_lost(exc)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)
