"""An operator's path against a real Prefect server: deploy, start a worker, trigger, schedule."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import kaldiio
import pytest
import yaml

from tests.support.servers import PrefectServer, PrefectWorker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]


def _prefect(server: PrefectServer, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).with_name("prefect")
    proc = subprocess.run([str(cli), "--no-prompt", *args], cwd=cwd, env=server.env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_prefect_yaml_declares_the_deployments():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    names = {d["name"]: d for d in spec["deployments"]}
    assert {"collect-stats", "extract-xvectors", "extract-features", "collect-stats-nightly"} <= set(names)
    assert all(d["enforce_parameter_schema"] for d in names.values())
    assert names["collect-stats-nightly"]["schedules"][0]["cron"] == "0 3 * * *"
    assert "definitions" in spec
    # module entrypoints of the installed package and a pull step: no checkout path anywhere
    assert all(d["entrypoint"].startswith("espnet3_flows.flows.") for d in names.values())
    assert spec["pull"] == [{"espnet3_flows.orchestration.deploy_steps.working_directory": {}}]


def test_deploy_trigger_and_schedule(tmp_path, demo_corpus):
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    model = build_random_ecapa_dir(tmp_path / "ecapa")
    # the scheduler service looks for new schedules every 2 s instead of 60 s
    fast_scheduler = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    deployer, elsewhere, workdir = (tmp_path / d for d in ("deployer", "elsewhere", "workdir"))
    deployer.mkdir()
    elsewhere.mkdir()
    with PrefectServer(tmp_path / "home", log_dir=tmp_path / "logs", extra_env=fast_scheduler) as server:
        _prefect(server, "work-pool", "create", "espnet3", "--type", "process")
        # deployed from a directory that is not the checkout, run by a worker started in a third
        # one, with no PYTHONPATH: the installed package is all the worker needs
        # the operator names the x-vector model in the deployment (a model directory is code for
        # speechbrain: a run's form may pass the deployment's value, not another one)
        spec = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
        for deployment in spec["deployments"]:
            if deployment["name"] == "extract-xvectors":
                deployment["parameters"]["xvector"] = {"pretrained_model": str(model)}
        (deployer / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        _prefect(server, "deploy", "--all", "--prefect-file", str(deployer / "prefect.yaml"), cwd=deployer)
        env = {k: v for k, v in server.env().items() if k != "PYTHONPATH"}
        env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1",
                "ESPNET3_FLOWS_WORKDIR": str(workdir)}
        with PrefectWorker("espnet3", env, elsewhere, log_dir=tmp_path / "logs"):
            os.environ["PREFECT_API_URL"] = server.api_url
            try:
                from prefect.client.orchestration import get_client
                from prefect.deployments import run_deployment
                from prefect.settings import PREFECT_API_URL, temporary_settings

                out = workdir / "exp" / "stats"  # a relative output_dir, in the worker's working directory
                with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                    run = run_deployment(
                        "collect-stats/collect-stats", timeout=300,
                        parameters={"manifests": {"valid": demo_corpus["valid"]}, "output_dir": "exp/stats",
                                    "shard_size": 4, "parallel": {"env": "serial"}})
                    assert run.state is not None and run.state.is_completed(), run.state
                    xvectors = run_deployment(
                        "extract-xvectors/extract-xvectors", timeout=300,
                        parameters={"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / "xv"),
                                    "xvector": {"pretrained_model": str(model)}, "shard_size": 6,
                                    "parallel": {"env": "serial"}})
                    assert xvectors.state is not None and xvectors.state.is_completed(), xvectors.state
                    features = run_deployment(  # a job that only declares itself: its flow is generated
                        "extract-features/extract-features", timeout=300,
                        parameters={"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / "xf"),
                                    "shard_size": 4, "parallel": {"env": "serial"}})
                    assert features.state is not None and features.state.is_completed(), features.state

                    async def read_nightly():
                        async with get_client() as client:
                            return await client.read_deployment_by_name("collect-stats/collect-stats-nightly")

                    # shipped inactive (its manifests are placeholders); resumed as the README says
                    shipped = asyncio.run(read_nightly())
                    assert shipped.schedules and not shipped.schedules[0].active
                    _prefect(server, "deployment", "schedule", "resume", "collect-stats/collect-stats-nightly",
                             str(shipped.schedules[0].id))

                    async def inspect():
                        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

                        async with get_client() as client:
                            nightly = await client.read_deployment_by_name("collect-stats/collect-stats-nightly")
                            flt = DeploymentFilter(id=DeploymentFilterId(any_=[nightly.id]))
                            for _ in range(60):  # the scheduler service runs every 2 s
                                scheduled = [r for r in await client.read_flow_runs(deployment_filter=flt)
                                             if r.state_type and r.state_type.value == "SCHEDULED"]
                                if scheduled:
                                    break
                                await asyncio.sleep(1)
                            arts = await client.read_artifacts()
                            return nightly, scheduled, arts

                    nightly, scheduled, arts = asyncio.run(inspect())
            finally:
                os.environ.pop("PREFECT_API_URL", None)
    assert (out / "valid" / "feats_stats.npz").is_file() and (out / "valid" / "summary.json").is_file()
    assert len(kaldiio.load_scp(str(tmp_path / "xv" / "xvector" / "valid" / "xvector.scp"))) == 12
    assert (tmp_path / "xf" / "valid" / "cuts.jsonl.gz").is_file() and (tmp_path / "xf" / "valid" / "summary.json").is_file()
    assert any(a.key == "collect-stats-valid-report" for a in arts)
    assert nightly.schedules and nightly.schedules[0].active
    assert nightly.schedules[0].schedule.cron == "0 3 * * *"
    assert scheduled, "the nightly deployment has no scheduled run"
    assert all(r.expected_start_time.hour == 3 and r.expected_start_time.minute == 0 for r in scheduled)
