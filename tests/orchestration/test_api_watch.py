"""The watch that declares a run's Prefect API lost (espnet3_flows.orchestration.api_watch): it must
see a server that goes away, and never declare lost an API this process cannot probe itself (behind
a proxy, or a port it could not open when the run started)."""

from __future__ import annotations

import socket
import time

import pytest

from espnet3_flows.orchestration import api_watch


@pytest.fixture
def quick_watch(monkeypatch):
    monkeypatch.setattr(api_watch, "LOST_AFTER_SECONDS", 0.5)
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)  # never end this process


def _watch_for(url: str, seconds: float, before_end=None) -> bool:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}), api_watch.watching_api(interval=0.1):
        if before_end is not None:
            before_end()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not api_watch.api_lost_now():
            time.sleep(0.1)
        return api_watch.api_lost_now()


def test_a_server_that_goes_away_is_declared_lost(quick_watch):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert _watch_for(f"http://127.0.0.1:{port}/api", 20, before_end=server.close)


def test_a_port_that_cannot_be_opened_when_the_run_starts_is_not_watched(quick_watch):
    from tests.support.servers import free_port

    assert not _watch_for(f"http://127.0.0.1:{free_port()}/api", 2)


def test_an_api_reached_through_a_proxy_is_not_watched(quick_watch, monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("no_proxy", "")
    assert not _watch_for(f"http://127.0.0.1:{port}/api", 2, before_end=server.close)


def test_a_loss_leaves_no_client_setting_changed_after_the_run(quick_watch):
    """The watch turns the client's retries off when the API is lost, in the run's settings and in
    the process's own: a process that goes on (a notebook, the test session) gets both back."""
    from prefect.settings import get_current_settings

    before = get_current_settings().client.max_retries
    server = socket.create_server(("127.0.0.1", 0))
    assert _watch_for(f"http://127.0.0.1:{server.getsockname()[1]}/api", 20, before_end=server.close)
    assert get_current_settings().client.max_retries == before != 0


def test_the_settings_serialized_for_workers_are_the_same_after_a_loss(quick_watch):
    """A field set once stays in every settings context serialized for Dask workers: after a loss,
    the process's settings serialize exactly as before."""
    from prefect.settings import get_current_settings

    before = get_current_settings().to_environment_variables(exclude_unset=True)
    server = socket.create_server(("127.0.0.1", 0))
    assert _watch_for(f"http://127.0.0.1:{server.getsockname()[1]}/api", 20, before_end=server.close)
    assert get_current_settings().to_environment_variables(exclude_unset=True) == before
