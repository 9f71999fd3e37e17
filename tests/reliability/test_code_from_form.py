"""A deployment's form is data: run parameters that name code are refused before anything they name
is imported, through a real Prefect server and a real process worker.

Each hostile run tries to create a marker file the way a UI user could (Hydra's blocklist stops
none of these): ``sympy.sympify`` of a string, ``torch.load`` and ``numpy.load`` of a pickle,
``builtins.open``, a Dask ``preload`` script, and a config file of the user's choosing. Each must
fail naming the key, and no marker may exist. The operator's own values (the deployment's
parameters) and keys the deployment opens with its ``trust_code`` pull step still run.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.servers import PrefectServer, PrefectWorker

ROOT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
pytestmark = [pytest.mark.prefect_server, pytest.mark.slow]

SLOW_FRAMER = {"_target_": "tests.orchestration.slow_model.SlowFramer", "delay": 0.0}
POOL = {"name": "espnet3", "work_queue_name": "default"}


def _prefect_yaml() -> str:
    import yaml

    def deployment(name: str, job: str, parameters: dict, **extra) -> dict:
        return {"name": name, "entrypoint": f"espnet3_flows.flows.{job}", "work_pool": POOL,
                "parameters": {"output_dir": f"exp/{name}", **parameters}, **extra}

    workdir_step = {"espnet3_flows.orchestration.deploy_steps.working_directory": {}}
    return yaml.safe_dump({
        "name": "code-from-form", "prefect-version": "3.8.8", "pull": [workdir_step],
        "deployments": [
            deployment("plain", "collect_stats", {}),
            deployment("plain-xvectors", "extract_xvectors", {}),
            deployment("operator-model", "collect_stats", {"frontend": {"type": "model", "model": SLOW_FRAMER}}),
            deployment("trusted", "collect_stats", {}, pull=[
                workdir_step, {"espnet3_flows.orchestration.deploy_steps.trust_code": {"keys": ["frontend.model"]}}]),
        ]})


class _Payload:
    """A pickle that runs ``command`` when loaded."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _hostile_runs(tmp: Path, manifests: dict) -> dict[str, tuple[str, dict, str | tuple[str, ...]]]:
    """name → (deployment, parameters, the key(s) the refusal must name); each would create a
    marker in tmp (``preload`` the sympify run's second key's)."""
    (tmp / "evil.pkl").write_bytes(pickle.dumps(_Payload(f"touch {tmp / 'numpy_load'}")))
    (tmp / "evil.pt").write_bytes(pickle.dumps(_Payload(f"touch {tmp / 'torch_load'}")))
    (tmp / "evil.py").write_text(f"open({str(tmp / 'preload')!r}, 'w').close()\n")
    (tmp / "evil.yaml").write_text(
        "frontend:\n  type: model\n  model:\n    _target_: numpy.load\n"
        f"    _args_: [{tmp / 'evil.pkl'}]\n    allow_pickle: true\n")
    base = {"manifests": manifests, "parallel": {"env": "serial"}}
    return {
        # two keys of one run, each code: the refusal names both (a Dask preload script, too)
        "sympify": ("collect-stats/plain", {**base, "frontend": {"type": "model", "model": {
            "_target_": "sympy.sympify", "_args_": [f"__import__('os').system('touch {tmp / 'sympify'}')"]}},
            "parallel": {"env": "local", "n_workers": 1, "options": {"preload": [str(tmp / "evil.py")]}}},
            ("frontend.model", "parallel.options.preload")),
        "torch_load": ("extract-xvectors/plain-xvectors", {**base, "xvector": {"toolkit": "custom", "model": {
            "_target_": "torch.load", "_args_": [str(tmp / "evil.pt")], "weights_only": False}}}, "xvector.model"),
        "numpy_load": ("collect-stats/plain", {**base, "config": str(tmp / "evil.yaml")}, "frontend.model"),
        "open": ("collect-stats/plain", {**base, "overrides": [
            "frontend.type=model", "frontend.model._target_=builtins.open",
            f"frontend.model._args_=[{tmp / 'open'},w]"]}, "frontend.model"),
        "sympify_as_operator_elsewhere": ("collect-stats/operator-model", {**base, "frontend": {
            "type": "model", "model": {"_target_": "sympy.sympify", "_args_": [
                f"__import__('os').system('touch {tmp / 'sympify_as_operator_elsewhere'}')"]}}}, "frontend.model"),
    }


def _wait_final(client, run_ids: dict[str, object], timeout: float = 420) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        runs = {name: client.read_flow_run(run_id) for name, run_id in run_ids.items()}
        if all(r.state is not None and r.state.is_final() for r in runs.values()) or time.monotonic() > deadline:
            return runs
        time.sleep(2)


def test_form_parameters_that_name_code_are_refused(tmp_path, demo_corpus):
    deployer, workdir, markers = tmp_path / "deployer", tmp_path / "workdir", tmp_path / "markers"
    for d in (deployer, workdir, markers):
        d.mkdir()
    prefect_yaml = deployer / "prefect.yaml"
    prefect_yaml.write_text(_prefect_yaml())
    with PrefectServer(tmp_path / "home", log_dir=tmp_path / "logs") as server:
        for args in (("work-pool", "create", "espnet3", "--type", "process"), ("deploy", "--all")):
            done = subprocess.run([PREFECT, "--no-prompt", *args], cwd=deployer, env=server.env(),
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # the worker imports tests.orchestration.slow_model for the operator's own model
        env = server.env() | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "ESPNET3_FLOWS_WORKDIR": str(workdir)}
        manifests = {"valid": demo_corpus["valid"]}
        hostile = _hostile_runs(markers, manifests)
        allowed = {
            # the operator's value, as the form shows it, and a key the deployment opens
            "operator_value": ("collect-stats/operator-model", {"manifests": manifests, "parallel": {"env": "serial"},
                               "frontend": {"type": "model", "model": SLOW_FRAMER}}),
            "opened_key": ("collect-stats/trusted", {"manifests": manifests, "parallel": {"env": "serial"},
                           "frontend": {"type": "model", "model": SLOW_FRAMER}}),
        }
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with PrefectWorker("espnet3", env, workdir, log_dir=tmp_path / "logs"), \
                temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            ids = {name: run_deployment(deployment, parameters={**params, "output_dir": f"exp/{name}"}, timeout=0).id
                   for name, (deployment, params, *_) in {**hostile, **allowed}.items()}
            with get_client(sync_client=True) as client:
                runs = _wait_final(client, ids)
    assert sorted(p.name for p in markers.iterdir() if p.suffix == "") == [], "a form's parameter ran code"
    for name, (_, _, key) in hostile.items():
        state = runs[name].state
        assert state is not None and state.is_failed(), (name, state)
        keys = (key,) if isinstance(key, str) else key
        assert "name code, refused" in (state.message or ""), (name, state.message)
        assert all(k in state.message for k in keys), (name, state.message)
    for name in allowed:
        assert runs[name].state.is_completed(), (name, runs[name].state)
