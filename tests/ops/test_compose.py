"""The self-hosted stack (docker-compose.yml + Dockerfile) is valid, pinned and health-checked."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _one_shot_services(services: dict) -> set[str]:
    """Services others wait on to *finish* (bucket creation, deployment registration)."""
    return {
        dep
        for svc in services.values()
        for dep, cond in (svc.get("depends_on") or {}).items()
        if isinstance(cond, dict) and cond.get("condition") == "service_completed_successfully"
    }


def _image_is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name_and_tag = image.rsplit("/", 1)[-1]
    if ":" not in name_and_tag:
        return False
    tag = name_and_tag.rsplit(":", 1)[1]
    return bool(tag) and tag != "latest"


def test_docker_compose_config_validates():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("`docker-compose` is not installed; install Debian's package: "
                    "`apt-get install -y docker-compose` (it validates without a Docker engine)")
    done = subprocess.run([exe, "-f", str(COMPOSE), "config", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"docker-compose config -q failed:\n{done.stdout}{done.stderr}"


def test_expected_services_exist(services):
    assert {"postgres", "prefect-server", "minio", "minio-init", "worker", "dask-scheduler",
            "dask-worker"} <= set(services)


def test_every_long_running_service_has_a_healthcheck(services):
    one_shot = _one_shot_services(services)
    assert {"minio-init", "deploy"} <= one_shot
    for name in one_shot:
        assert services[name].get("restart") == "no", f"one-shot {name} must not restart"
    for name, svc in services.items():
        if name in one_shot:
            continue
        check = svc.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_health_checks_use_the_right_endpoints(services):
    def joined(name: str) -> str:
        test = services[name]["healthcheck"]["test"]
        return " ".join(test) if isinstance(test, list) else test

    assert "/api/health" in joined("prefect-server")
    assert "pg_isready" in joined("postgres")
    assert "mc ready local" in joined("minio") or "/minio/health/live" in joined("minio")
    assert "/health" in joined("worker")
    assert "127.0.0.1:8787/health" in joined("dask-scheduler")
    assert "/health" in joined("dask-worker")


def test_images_are_pinned_to_explicit_tags(services):
    for name, svc in services.items():
        image = svc.get("image")
        if image is None:
            assert "build" in svc, f"{name} has neither image nor build"
            continue
        assert _image_is_pinned(image), f"{name}: image {image!r} is not pinned to a tag"
    assert services["prefect-server"]["image"] == "prefecthq/prefect:3.8.8-python3.11"
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["minio"]["image"].startswith("minio/minio:RELEASE.")


def test_dependencies_wait_for_health_or_completion(services):
    one_shot = _one_shot_services(services)
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on must name a condition"
        for dep, cond in deps.items():
            condition = (cond or {}).get("condition")
            assert condition in {"service_healthy", "service_completed_successfully"}, \
                f"{name} -> {dep}: condition {condition!r}"
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has none"
            else:
                assert dep in one_shot
    assert services["prefect-server"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert set(services["worker"]["depends_on"]) >= {"prefect-server", "minio-init"}


def test_state_lives_in_named_volumes(compose, services):
    declared = set(compose.get("volumes") or {})
    for name in ("postgres", "minio"):
        mounts = [v.split(":", 1)[0] for v in services[name].get("volumes", [])]
        assert mounts and all(m in declared for m in mounts), f"{name}: {mounts} not named volumes"


def test_credentials_come_from_the_environment(services):
    secret_key = re.compile(r"PASSWORD|SECRET|CONNECTION_URL")
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if secret_key.search(key):
                assert "${" in str(value), f"{name}.{key} is a literal; use ${{VAR:-default}}"


def test_prefect_server_uses_postgres_and_listens_on_all_interfaces(services):
    env = services["prefect-server"]["environment"]
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in env["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert env["PREFECT_SERVER_API_HOST"] == "0.0.0.0"


def test_worker_runs_the_process_pool_with_s3_settings(services):
    worker = services["worker"]
    assert "build" in worker
    command = " ".join(worker["command"])
    assert "worker start --pool espnet3 --type process" in command
    env = worker["environment"]
    for key in ("PREFECT_API_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_ENDPOINT_URL_S3"):
        assert key in env, f"worker lacks {key}"
    assert env["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert "worker-data:/data" in worker["volumes"] and env["ESPNET3_FLOWS_WORKDIR"] == "/data"  # runs' relative paths
    assert worker.get("stop_signal") == "SIGINT"


def test_dockerfile_installs_the_project_with_constraints():
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert base and base.group(1).startswith("python:3.11") and "slim" in base.group(1)
    assert _image_is_pinned(base.group(1))
    assert "-c constraints.txt" in text
    assert re.search(r"^WORKDIR\s+/\S+", text, re.MULTILINE)
    assert re.search(r"^USER\s+(?!root)\S+", text, re.MULTILINE), "worker must not run as root"


def test_dockerignore_keeps_the_context_small_but_buildable():
    patterns = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= patterns
    for needed in ("pyproject.toml", "constraints.txt", "README.md", "espnet3_flows", "flows",
                   "deployments"):
        assert needed not in patterns, f".dockerignore excludes {needed}, which the image needs"


def test_dask_cluster_runs_the_project_image(services):
    """`parallel.env: address` deployments run their shards on this long-running cluster: its
    processes must import the project (same image and build as the Prefect worker), see the same
    data volume, and reach the Prefect API and MinIO."""
    worker, scheduler, dask_worker = services["worker"], services["dask-scheduler"], services["dask-worker"]
    for svc in (scheduler, dask_worker):
        assert svc["image"] == worker["image"] and svc["build"] == worker["build"]
    assert scheduler["command"][:2] == ["dask", "scheduler"]
    assert "8786" in scheduler["command"] and ":8787" in scheduler["command"]
    assert any(p.endswith(":8786") for p in scheduler["ports"]) and any(p.endswith(":8787") for p in scheduler["ports"])
    assert all(p.startswith("127.0.0.1:") for p in scheduler["ports"]), "an open scheduler runs anyone's code"
    command = dask_worker["command"]
    assert command[:3] == ["dask", "worker", "tcp://dask-scheduler:8786"]
    assert "--nworkers" in command and command[command.index("--nthreads") + 1] == "1"
    assert dask_worker["depends_on"]["dask-scheduler"]["condition"] == "service_healthy"
    assert set(dask_worker["volumes"]) == set(worker["volumes"])
    env = dask_worker["environment"]
    assert env["PREFECT_API_URL"] == worker["environment"]["PREFECT_API_URL"]
    assert env["AWS_ENDPOINT_URL_S3"] == worker["environment"]["AWS_ENDPOINT_URL_S3"]
    assert worker["environment"]["DASK_SCHEDULER_ADDRESS"] == "tcp://dask-scheduler:8786"


def test_standing_scheduler_settings_are_the_documented_ones(services):
    """The standing scheduler keeps a bounded debug log of its messages to workers (the soak
    benchmark measured what the default costs over nights): compose, the docs and the soak agree."""
    from benchmarks.bench_soak import SCHEDULER_SETTINGS

    docs = (ROOT / "docs" / "deployments.md").read_text()
    for name, value in SCHEDULER_SETTINGS.items():
        assert services["dask-scheduler"]["environment"][name] == value
        assert f"{name}={value} dask scheduler" in docs


def test_dask_scheduler_address_override_resolves_from_the_worker_environment(monkeypatch):
    """The override the compose file documents for deployments resolves when the run starts."""
    from espnet3_flows.config import load_config
    from espnet3_flows.parallel.parallel_config import ParallelConfig

    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://dask-scheduler:8786")
    assert "parallel.options.address=${oc.env:DASK_SCHEDULER_ADDRESS}" in COMPOSE.read_text()
    cfg = load_config(ParallelConfig, overrides=["env=address", "options.address=${oc.env:DASK_SCHEDULER_ADDRESS}"])
    assert cfg.placement_options.address == "tcp://dask-scheduler:8786"
    old = load_config(ParallelConfig, overrides=["env=address", "address=${oc.env:DASK_SCHEDULER_ADDRESS}"])
    assert old.placement_options.address == "tcp://dask-scheduler:8786"  # the spelling before it moved
