"""Credentials never reach the Prefect server, from any section of a config (issue "Trust",
item 1; issue 45, item 3).

Real parts only: a `prefect server` (SQLite under its own PREFECT_HOME), moto's S3 server, the
CLI as a user runs it (credentials as `storage_options.*` overrides, and in the local workers'
environment, `parallel.options.env`, from a --config file and an override) and a deployment run
by a process worker whose environment carries the credentials (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL_S3). Afterwards everything the server hands out --
flow runs (parameters, states), task runs, block documents (client and raw HTTP), artifacts,
logs, events, deployments, work pools, variables -- and the bytes of its database must be free
of the secret and of the access key id, and so must the CLI's output and the worker's log. A
second deployment run, given a credential in its parameters, is refused naming the key paths.

One module-scoped scenario drives both paths once; each test checks one part of the result, so
a leak and a broken run are reported separately.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.prefect_readback import (columns_with, context, paths_containing, read_everything,
                                            wait_for_final_events)
from tests.support.servers import ManagedProcess, PrefectServer, PrefectWorker

ROOT = Path(__file__).resolve().parents[2]
# the module's scenario (server, CLI run, deploy, worker, two deployment runs) is set up by its
# first test: ~2 min on 2 cores
pytestmark = [pytest.mark.prefect_server, pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(420)]

SECRET = f"sEcReT-{uuid.uuid4().hex}-do-not-leak"
ACCESS_KEY = "AKIA" + uuid.uuid4().hex[:16].upper()
NEEDLES = {"secret": SECRET, "access key id": ACCESS_KEY}
#: A credential given to a deployment's run as a parameter: refused, but kept by Prefect (docs/credentials.md)
REFUSED = f"rEfUsEd-{uuid.uuid4().hex}"
POOL = "secrets-pool"
DEPLOYMENT = "collect-stats/secrets-test"


@dataclass
class Scenario:
    bucket: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # stage -> traceback
    cli_returncode: int | None = None
    cli_output: str = ""
    cli_published: bool = False
    deployed_run_id: str | None = None
    deployed_state: str | None = None
    deployed_published: bool = False
    refused_run_id: str | None = None
    refused_state: str | None = None
    api: dict[str, Any] | None = None
    db_files: dict[str, bytes] = field(default_factory=dict)
    db_columns_with_secret: list[str] = field(default_factory=list)
    worker_log: str = ""
    server_log: str = ""
    timings: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- helpers


def _without_aws(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("AWS_")}


def _prefect_cli(env: dict[str, str], *args: str) -> None:
    cli = Path(sys.executable).with_name("prefect")
    proc = subprocess.run([str(cli), "--no-prompt", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _s3_exists(endpoint: str, bucket: str, key: str) -> bool:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    listed = client.list_objects_v2(Bucket=bucket, Prefix=key)
    return any(obj["Key"] == key for obj in listed.get("Contents", []))


def _stage(sc: Scenario, name: str):
    """Context manager: record the stage's exception (with traceback) instead of raising."""

    class _Stage:
        def __enter__(self):
            self.start = time.monotonic()

        def __exit__(self, exc_type, exc, tb):
            sc.timings[name] = round(time.monotonic() - self.start, 1)
            if exc is not None and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
                sc.errors[name] = "".join(traceback.format_exception(exc_type, exc, tb))[-6000:]
                return True
            return False

    return _Stage()


# ----------------------------------------------------------------------------- the scenario


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, moto_server, demo_corpus) -> Scenario:
    root = tmp_path_factory.mktemp("secrets")
    sc = Scenario(bucket=f"secrets-{uuid.uuid4().hex[:12]}")
    moto_server.make_bucket(sc.bucket)
    endpoint = moto_server.endpoint_url
    logs = root / "logs"
    server = PrefectServer(root / "server-home", log_dir=logs)
    worker: PrefectWorker | None = None
    cli: ManagedProcess | None = None
    t0 = time.monotonic()
    try:
        with _stage(sc, "server start"):
            server.start()
        if "server start" in sc.errors:
            return sc
        # clients (CLI, prefect deploy, worker) keep their own PREFECT_HOME: the server's home holds
        # only its database, and no client file can be mistaken for it
        client_env = _without_aws(server.env()) | {
            "PREFECT_HOME": str(root / "client-home"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

        # 1. the CLI, credentials as storage_options overrides and in the local workers' environment
        #    (parallel.options.env: from a --config file and an override)
        with _stage(sc, "cli run"):
            config = root / "cli.yaml"
            config.write_text(json.dumps({"parallel": {"env": "local", "n_workers": 1, "options": {
                "env": {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}}}}))  # JSON is YAML
            argv = [sys.executable, "flows/collect_stats.py", "--config", str(config),
                    f"manifests.valid={demo_corpus['valid']}",
                    f"output_dir=s3://{sc.bucket}/cli", f"storage_options.key={ACCESS_KEY}",
                    f"storage_options.secret={SECRET}", f"storage_options.client_kwargs.endpoint_url={endpoint}",
                    f"parallel.options.env.HF_TOKEN={SECRET}", "shard_size=4"]
            cli = ManagedProcess(argv, name="cli", log_path=logs / "cli.log", env=client_env, cwd=ROOT)
            cli.start()
            try:
                sc.cli_returncode = cli.popen.wait(timeout=480)
            finally:
                cli.stop()
                # the log starts with ManagedProcess's own "===== cli: <argv>" line: not the CLI's output
                sc.cli_output = "\n".join(line for line in cli.log_path.read_text(errors="replace").splitlines()
                                          if not line.startswith("===== cli: "))
            assert sc.cli_returncode == 0, f"CLI exited {sc.cli_returncode}:\n{sc.cli_output[-6000:]}"
        with _stage(sc, "cli outputs"):
            sc.cli_published = _s3_exists(endpoint, sc.bucket, "cli/valid/summary.json")

        # 2. a deployment, run by a process worker that has the credentials in its environment
        with _stage(sc, "deploy"):
            spec = {
                "name": "secrets-test", "prefect-version": "3.8.8",
                "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
                "deployments": [{
                    "name": "secrets-test", "entrypoint": "flows/collect_stats.py:collect_stats",
                    "enforce_parameter_schema": True,
                    "work_pool": {"name": POOL, "work_queue_name": "default"},
                }],
            }
            prefect_file = root / "prefect.yaml"
            prefect_file.write_text(json.dumps(spec, indent=2))  # JSON is YAML
            _prefect_cli(client_env, "work-pool", "create", POOL, "--type", "process")
            _prefect_cli(client_env, "deploy", "--all", "--prefect-file", str(prefect_file))
        if "deploy" not in sc.errors:
            with _stage(sc, "deployment run"):
                worker_environ = client_env | {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                                           "AWS_ENDPOINT_URL_S3": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
                worker = PrefectWorker(POOL, worker_environ, ROOT, log_dir=logs)
                worker.start()
                sc.deployed_run_id, sc.deployed_state = asyncio.run(_trigger_and_wait(
                    server.api_url, worker, timeout=420, parameters={
                        "manifests": {"valid": demo_corpus["valid"]}, "output_dir": f"s3://{sc.bucket}/deployed",
                        "shard_size": 4, "parallel": {"env": "serial"}}))
                # let the flow-run process exit (its last logs are sent on exit); Prefect 3.8's worker
                # logs no "exited" line to wait for (a wait for one took its full 30 s, twice)
                worker.wait_idle(30)
                assert sc.deployed_state == "COMPLETED", (
                    f"deployment run ended {sc.deployed_state}; worker log:\n{worker.log_tail(80)}")
            with _stage(sc, "deployment outputs"):
                sc.deployed_published = _s3_exists(endpoint, sc.bucket, "deployed/valid/summary.json")
            # a credential in a deployment run's parameters and overrides: refused, naming its keys
            with _stage(sc, "refused run"):
                sc.refused_run_id, sc.refused_state = asyncio.run(_trigger_and_wait(
                    server.api_url, worker, timeout=300, parameters={
                        "manifests": {"valid": demo_corpus["valid"]}, "output_dir": f"s3://{sc.bucket}/refused",
                        "parallel": {"env": "serial", "options": {"env": {"AWS_SECRET_ACCESS_KEY": REFUSED}}},
                        "overrides": [f"parallel.options.connect_options.password={REFUSED}"]}))
                worker.wait_idle(30)

        # 3. read everything back through the API
        with _stage(sc, "api read"):
            asyncio.run(wait_for_final_events(server.api_url))  # events are persisted in batches
            sc.api = asyncio.run(read_everything(server.api_url, POOL))
    finally:
        if worker is not None:
            with _stage(sc, "worker stop"):
                worker.stop()
            sc.worker_log = worker.log_tail(10**7)
        if cli is not None and cli.running():
            cli.stop()
        with _stage(sc, "server stop"):
            server.stop()
        sc.server_log = server.log_tail(10**7)
        sc.timings["total"] = round(time.monotonic() - t0, 1)

    # 4. the database files, read after the server stopped
    for path in sorted(server.home.glob("prefect.db*")):
        sc.db_files[path.name] = path.read_bytes()
    if any(SECRET.encode() in data for data in sc.db_files.values()):
        copy = root / "db-copy"
        copy.mkdir()
        for path in server.home.glob("prefect.db*"):
            shutil.copy2(path, copy / path.name)
        sc.db_columns_with_secret = columns_with(copy / "prefect.db", SECRET)
    print(f"\nsecrets scenario timings (s): {sc.timings}")
    return sc


async def _trigger_and_wait(api_url: str, worker: PrefectWorker, timeout: float,
                            parameters: dict[str, Any]) -> tuple[str, str | None]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        async with get_client() as client:
            deployment = await client.read_deployment_by_name(DEPLOYMENT)
            run = await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                run = await client.read_flow_run(run.id)
                if run.state is not None and run.state.is_final():
                    break
                if not worker.running():
                    break
                await asyncio.sleep(1)
            state = None if run.state is None else run.state.type.value
            if run.state is not None and not run.state.is_completed():
                state = f"{state}: {run.state.message}"
            return str(run.id), state


# ----------------------------------------------------------------------------- the checks


def _stage_errors(sc: Scenario, *stages: str) -> str:
    return "\n\n".join(f"[{s}]\n{sc.errors[s]}" for s in stages if s in sc.errors)


def test_cli_run_completes_and_publishes_to_s3(scenario):
    errors = _stage_errors(scenario, "server start", "cli run", "cli outputs")
    assert not errors, errors
    assert scenario.cli_returncode == 0
    assert scenario.cli_published, f"s3://{scenario.bucket}/cli/valid/summary.json is missing"


def test_deployment_run_completes_and_publishes_to_s3(scenario):
    errors = _stage_errors(scenario, "server start", "deploy", "deployment run", "deployment outputs")
    assert not errors, errors
    assert scenario.deployed_state == "COMPLETED"
    assert scenario.deployed_published, f"s3://{scenario.bucket}/deployed/valid/summary.json is missing"


def test_prefect_api_hands_out_no_credentials(scenario):
    errors = _stage_errors(scenario, "server start", "api read")
    assert not errors, errors
    api = scenario.api
    assert api is not None
    # not vacuous: the runs, their task runs, logs and events were read back
    counts = {k: len(v) for k, v in api.items()}
    print(f"\nread back through the API: {counts}")
    assert api["flow_runs"] and api["task_runs"] and api["logs"] and api["events"], counts
    if scenario.deployed_run_id:
        assert any(r["id"] == scenario.deployed_run_id for r in api["flow_runs"])
    if scenario.cli_returncode == 0 and scenario.deployed_run_id:
        top_level = [r for r in api["flow_runs"] if r["parent_task_run_id"] is None]
        assert len(top_level) >= 2, "expected the CLI's and the deployment's flow runs"
    leaks = []
    for what, needle in NEEDLES.items():
        for section, data in api.items():
            paths = paths_containing(data, needle)
            if paths:
                text = json.dumps(data, default=str)
                leaks.append(f"{what} in {section}: {len(paths)} place(s), e.g. {paths[:5]}\n"
                             f"    ...{context(text, needle)}...")
    assert not leaks, "credentials handed out by the Prefect API:\n" + "\n".join(leaks)


def test_prefect_database_holds_no_credentials(scenario):
    errors = _stage_errors(scenario, "server start", "server stop")
    assert not errors, errors
    assert "prefect.db" in scenario.db_files, sorted(scenario.db_files)
    everything = b"".join(scenario.db_files.values())
    # not vacuous: what the runs stored in clear is visible to this grep
    assert f"s3://{scenario.bucket}/deployed".encode() in everything or \
        f"s3://{scenario.bucket}/cli".encode() in everything, "no run parameters found in the database bytes"
    leaks = []
    for what, needle in NEEDLES.items():
        for name, data in scenario.db_files.items():
            count = data.count(needle.encode())
            if count:
                at = data.find(needle.encode())
                leaks.append(f"{what} in {name}: {count} time(s), e.g. ...{data[max(0, at - 200):at + 120]!r}...")
    assert not leaks, ("credentials stored in the Prefect database "
                       f"(columns: {scenario.db_columns_with_secret}):\n" + "\n".join(leaks))


def test_cli_output_and_process_logs_hold_no_credentials(scenario):
    assert scenario.cli_output or "cli run" in scenario.errors, "no CLI output captured"
    logs = {"CLI stdout/stderr": scenario.cli_output, "worker log": scenario.worker_log,
            "server log": scenario.server_log}
    leaks = [f"{what} in {name}: ...{context(text, needle)}..."
             for name, text in logs.items() for what, needle in NEEDLES.items() if needle in text]
    assert not leaks, "\n".join(leaks)


def test_cli_flow_parameters_show_every_credential_masked(scenario):
    """Not vacuous: the CLI's flow run was given the workers' credentials, and shows them masked."""
    errors = _stage_errors(scenario, "server start", "cli run", "api read")
    assert not errors, errors
    shown = [r["parameters"]["config"] for r in scenario.api["flow_runs"]
             if "config" in r["parameters"] and r["parameters"]["config"].get("output_dir", "").endswith("/cli")]
    assert shown, "the CLI's flow run was not read back"
    assert shown[0]["parallel"]["options"]["env"] == {"AWS_SECRET_ACCESS_KEY": "***", "AWS_DEFAULT_REGION": "us-east-1",
                                                      "HF_TOKEN": "***"}
    assert shown[0]["storage_options"]["key"] == shown[0]["storage_options"]["secret"] == "***"


def test_deployment_run_with_a_credential_is_refused_naming_its_keys(scenario):
    """A credential typed into a deployment run's parameters fails the run before it is used, one
    line naming the key paths. Prefect stored the parameters before the flow saw them (README,
    "Credentials"): the value is in that flow run's parameters, and nowhere the run wrote."""
    errors = _stage_errors(scenario, "server start", "deploy", "refused run", "api read")
    assert not errors, errors
    assert scenario.refused_state is not None and scenario.refused_state.startswith("FAILED"), scenario.refused_state
    assert ("flow parameters hold a credential (parallel.options.env.AWS_SECRET_ACCESS_KEY, "
            "parallel.options.connect_options.password (in overrides))") in scenario.refused_state
    assert REFUSED not in scenario.refused_state
    api = scenario.api
    (run,) = [r for r in api["flow_runs"] if r["id"] == scenario.refused_run_id]
    assert REFUSED in json.dumps(run["parameters"])  # what Prefect keeps regardless
    wrote = {"task_runs": api["task_runs"], "logs": api["logs"], "artifacts": api["artifacts"],
             "block_documents": api["block_documents_raw"], "variables": api["variables"],
             "states": api["flow_run_states"].get(scenario.refused_run_id), "worker log": scenario.worker_log}
    leaks = [f"{name}: {paths_containing(data, REFUSED)[:5]}" for name, data in wrote.items()
             if paths_containing(data, REFUSED)]
    assert not leaks, "the refused credential reached:\n" + "\n".join(leaks)
