"""The private one-run Prefect API server's environment."""

from __future__ import annotations

from espnet3_flows.orchestration.local_server import server_environment


def test_unused_services_off_recording_on_and_user_choice_kept(monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "true")  # the user wants automations
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    env = server_environment()
    for service in ("SCHEDULER", "LATE_RUNS", "FOREMAN", "REPOSSESSOR", "DB_VACUUM"):
        assert env[f"PREFECT_SERVER_SERVICES_{service}_ENABLED"] == "false"
    assert env["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"] == "true"
    # what the run's pages are built from stays on
    assert "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED" not in env
    assert "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED" not in env
    assert "PREFECT_API_URL" not in env and env["PREFECT_UI_ENABLED"] == "0"
