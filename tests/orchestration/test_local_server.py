"""The private one-run Prefect API server: its environment and its start."""

from __future__ import annotations

from espnet3_flows.orchestration.local_server import server_environment


def test_unused_services_off_recording_on_and_user_choice_kept(monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "true")  # the user wants automations
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    env = server_environment()
    for service in ("SCHEDULER", "LATE_RUNS", "FOREMAN", "REPOSSESSOR", "DB_VACUUM"):
        assert env[f"PREFECT_SERVER_SERVICES_{service}_ENABLED"] == "false"
    assert env["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"].lower() == "true"  # Prefect re-serializes it as "True"
    # what the run's pages are built from stays on
    assert "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED" not in env
    assert "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED" not in env
    assert "PREFECT_API_URL" not in env and env["PREFECT_UI_ENABLED"] == "0"


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

    with temporary_settings(restore_defaults={PREFECT_API_URL}, updates={PREFECT_HOME: str(tmp_path)}):
        with prefect_api(needs_server=True, while_starting=during) as url:
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert seen == [(url, False)]
    assert "PREFECT_API_URL" not in os.environ
