"""The private one-run Prefect API server: its environment and its start."""

from __future__ import annotations

from pathlib import Path

from espnet3_flows.orchestration.local_server import SERVER_BATCHING, server_environment
from tests.support.prefect_db import seed_home

ROOT = Path(__file__).resolve().parents[2]


def test_unused_services_off_recording_on_and_user_choice_kept(monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "true")  # the user wants automations
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    env = server_environment()
    for service in ("SCHEDULER", "LATE_RUNS", "FOREMAN", "REPOSSESSOR", "DB_VACUUM", "EVENT_PERSISTER"):
        assert env[f"PREFECT_SERVER_SERVICES_{service}_ENABLED"] == "false"
    assert env["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"].lower() == "true"  # Prefect re-serializes it as "True"
    # what the run's flow and task runs are recorded by stays on
    assert "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED" not in env
    assert "PREFECT_API_URL" not in env and env["PREFECT_UI_ENABLED"] == "0"
    assert env["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"] == "false"  # the one-run server registers no blocks
    monkeypatch.setenv("PREFECT_SERVER_REGISTER_BLOCKS_ON_START", "true")
    assert server_environment()["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"].lower() == "true"


def test_event_consumers_batched_here_in_make_serve_and_in_compose(monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE", "7")  # a user's own choice wins
    env = server_environment()
    assert env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "200"
    assert env["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE"] == "7"
    from prefect.settings import Settings

    monkeypatch.delenv("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE")
    for key, value in SERVER_BATCHING.items():
        monkeypatch.setenv(key, value)
    services = Settings().server.services  # the names are Prefect's: its settings read them
    assert (services.task_run_recorder.batch_size, services.event_persister.batch_size) == (200, 200)
    assert (services.task_run_recorder.flush_interval, services.event_persister.flush_interval) == (1, 1)
    stack = (ROOT / "deployments" / "local-stack.sh").read_text()
    compose = (ROOT / "docker-compose.yml").read_text()
    for key, value in SERVER_BATCHING.items():
        assert f"{key}={value}" in stack and f'{key}: "{value}"' in compose, key


def test_while_starting_runs_with_the_url_exported_before_the_server_answers(monkeypatch, tmp_path):
    """The CLI overlaps the workers' imports (forkserver) with the private server's start."""
    import os

    import httpx
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from espnet3_flows.orchestration.local_server import prefect_api

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    seen = []

    def during() -> None:
        url = os.environ["PREFECT_API_URL"]
        try:
            up = httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            up = False
        seen.append((url, up))

    with temporary_settings(restore_defaults={PREFECT_API_URL}, updates={PREFECT_HOME: str(seed_home(tmp_path))}), \
            prefect_api(needs_server=True, while_starting=during) as url:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert seen == [(url, False)]
    assert "PREFECT_API_URL" not in os.environ


def test_configured_api_url_reads_the_variable_then_the_active_profile(monkeypatch, tmp_path):
    from espnet3_flows.orchestration.local_server import configured_api_url

    for key in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    assert configured_api_url() == ""  # no profiles file
    (tmp_path / "profiles.toml").write_text(
        'active = "lab"\n[profiles.lab]\nPREFECT_API_URL = "http://lab:4200/api"\n[profiles.ephemeral]\n')
    assert configured_api_url() == "http://lab:4200/api"
    monkeypatch.setenv("PREFECT_PROFILE", "ephemeral")  # the variable picks another profile: none configured
    assert configured_api_url() == ""
    monkeypatch.setenv("PREFECT_API_URL", "http://env:4200/api")
    assert configured_api_url() == "http://env:4200/api"
    monkeypatch.delenv("PREFECT_API_URL")
    other = tmp_path / "elsewhere.toml"
    other.write_text("not = [toml")  # a broken file configures nothing (Prefect reports it itself)
    monkeypatch.setenv("PREFECT_PROFILES_PATH", str(other))
    assert configured_api_url() == ""


def test_an_early_server_is_taken_over_or_stopped(monkeypatch, tmp_path):
    """``launch_private_server`` starts the server before the CLI's imports; ``prefect_api`` is
    handed it and takes it over when it needs one, and stops it when an API is configured after all."""
    import httpx
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from espnet3_flows.orchestration import local_server

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert local_server.launch_private_server() is None  # an API is configured: nothing launched
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_HOME", str(seed_home(tmp_path)))
    with temporary_settings(restore_defaults={PREFECT_API_URL}, updates={PREFECT_HOME: str(tmp_path)}):
        early = local_server.launch_private_server()
        assert early is not None and early.process is not None
        with local_server.prefect_api(needs_server=True, server=early) as url:
            assert url == early.api_url and httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert early.process is None  # stopped with the run

        early = local_server.launch_private_server()
        process = early.process
        with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}), \
                local_server.prefect_api(needs_server=True, server=early) as url:
            assert url == "http://127.0.0.1:9/api"
        assert early.process is None and process.poll() is not None  # a configured API: the early one stopped


def test_servers_on_one_prefect_home_start_one_at_a_time(monkeypatch, tmp_path):
    """A new SQLite database's migrations take longer than a second server would wait for its
    write lock: the second start waits for the first server to answer."""
    import httpx

    from espnet3_flows.orchestration.local_server import LocalPrefectServer

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    first, second = LocalPrefectServer(), LocalPrefectServer()
    try:
        first.launch()
        second.launch()
        assert first.process is not None and second.process is None and second.launched  # its turn comes later
        second.wait_ready()  # after the first one answered
        first.wait_ready()
        for server in (first, second):
            assert httpx.get(f"{server.api_url}/health", timeout=5).status_code == 200
        waiting = LocalPrefectServer()
        blocker = LocalPrefectServer()
        blocker.launch()
        waiting.launch()
        waiting.stop()  # stopped while waiting for its turn: never started
        assert waiting.process is None
        blocker.stop()
    finally:
        for server in (first, second):
            server.stop()
