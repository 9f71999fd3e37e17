"""The test-process helpers start real servers and leave no process behind when stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.support.servers import (
    ManagedProcess,
    MotoServer,
    PrefectServer,
    PrefectWorker,
    ProcessStartError,
    ephemeral_ports,
    free_port,
    port_taken,
    slurm_available,
)


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def _alive(pids) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_is_outside_the_kernels_ephemeral_range():
    """bind(0) (a Dask worker's listener) and outgoing connections take ports from that range; a
    port chosen there could be taken between free_port() and the server's bind, as once happened."""
    ports = {free_port() for _ in range(20)}
    assert not ports & set(ephemeral_ports())


@pytest.mark.s3
def test_a_server_whose_chosen_port_was_taken_starts_on_a_fresh_one(tmp_path, monkeypatch):
    """Another process takes the chosen port before the server binds it and answers in another
    protocol (as a Dask listener did): the probe is not fooled and the server moves to a new port."""
    import threading

    import tests.support.servers as servers

    squatter = socket.create_server(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]

    def answer_wrongly():
        while True:
            try:
                conn, _ = squatter.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"\x00\x01 not http\r\n\r\n")

    threading.Thread(target=answer_wrongly, daemon=True).start()
    choices = iter([taken])
    real_free_port = servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda host="127.0.0.1": next(choices, None) or real_free_port(host))
    try:
        with MotoServer(log_dir=tmp_path) as moto:
            assert moto.port != taken
            assert urllib.request.urlopen(moto.endpoint_url + "/", timeout=10).status == 200
        assert "Address already in use" in (tmp_path / "moto.log").read_text()
        assert port_taken(taken)
    finally:
        squatter.close()


def test_managed_process_kills_stubborn_process_and_its_detached_grandchild(tmp_path):
    script = textwrap.dedent(f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        open({str(tmp_path / "child.pid")!r}, "w").write(str(child.pid))
        time.sleep(600)
    """)
    proc = ManagedProcess([sys.executable, "-c", script], name="stubborn",
                          log_path=tmp_path / "stubborn.log")
    proc.start()
    pid_file = tmp_path / "child.pid"
    proc.wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", timeout=30,
                    what="child started")
    child = int(pid_file.read_text())
    assert os.getsid(child) != os.getsid(proc.pid), "grandchild should be in its own session"
    assert {proc.pid, child} <= {p.pid for p in proc.family()}

    # The process ignores SIGTERM and sleeps 600 s: stop() must escalate to SIGKILL (a stop that
    # waited it out would hit the suite's timeout), and the detached grandchild must go too.
    proc.stop(signals=((signal.SIGTERM, 1.0),))
    assert not proc.running()
    assert _alive([proc.pid, child]) == []
    assert proc.family() == []


def test_startup_failure_reports_exit_code_and_log_tail(tmp_path):
    proc = ManagedProcess(
        [sys.executable, "-c", "print('boom: config is broken', flush=True); raise SystemExit(3)"],
        name="broken", log_path=tmp_path / "broken.log")
    proc.start()
    with pytest.raises(ProcessStartError) as err:
        proc.wait_until(lambda: False, timeout=30, what="ready")
    assert "code 3" in str(err.value)
    assert "boom: config is broken" in str(err.value)


def test_slurm_available_is_false_without_sinfo(tmp_path):
    assert slurm_available(env={"PATH": str(tmp_path)}) is False


@pytest.mark.slurm
def test_slurm_available_with_running_cluster():
    assert slurm_available() is True


@pytest.mark.s3
def test_moto_server_roundtrip_stop_and_restart_on_same_port():
    s3fs = pytest.importorskip("s3fs")
    with MotoServer() as moto:
        port = moto.port
        assert moto.endpoint_url == f"http://127.0.0.1:{port}"
        moto.make_bucket("espnet3-test")
        fs = s3fs.S3FileSystem(**moto.storage_options())
        fs.pipe("espnet3-test/dir/a.txt", b"hello shard")
        assert fs.cat("espnet3-test/dir/a.txt") == b"hello shard"
        assert fs.ls("espnet3-test/dir") == ["espnet3-test/dir/a.txt"]

        pids = [p.pid for p in moto.process.family()]
        assert moto.pid in pids
        moto.stop()
        assert not moto.running()
        assert not _port_open(port)
        assert _alive(pids) == []
        from botocore.exceptions import EndpointConnectionError

        down = s3fs.S3FileSystem(**moto.storage_options(), skip_instance_cache=True,
                                 config_kwargs={"retries": {"max_attempts": 1}})
        with pytest.raises(EndpointConnectionError):
            down.ls("espnet3-test")

        moto.start()
        assert moto.port == port and _port_open(port)
        fs = s3fs.S3FileSystem(**moto.storage_options(), skip_instance_cache=True)
        assert fs.ls("") == [], "moto keeps state in memory: a restart starts empty"
        moto.make_bucket("espnet3-test")
        fs.pipe("espnet3-test/b.txt", b"after outage")
        assert fs.cat("espnet3-test/b.txt") == b"after outage"
        second_pid = moto.pid
    assert _alive([second_pid]) == []
    assert not _port_open(port)


@pytest.mark.s3
def test_moto_server_on_busy_port_fails_with_log_tail(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = MotoServer(port=port, startup_timeout=30, log_dir=tmp_path)
        with pytest.raises(ProcessStartError) as err:
            server.start()
        assert "moto" in str(err.value)
        assert "Address already in use" in str(err.value)
        assert not server.running()
        assert _alive([server.pid]) == []


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server


def _prefect_cli(server: PrefectServer, *args: str) -> subprocess.CompletedProcess:
    prefect = Path(sys.executable).parent / "prefect"
    return subprocess.run([str(prefect), "--no-prompt", *args], env=server.env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.prefect_server
def test_prefect_server_is_healthy_and_env_points_at_it(prefect_server):
    with urllib.request.urlopen(prefect_server.api_url + "/health", timeout=5) as response:
        assert response.status == 200
        assert json.loads(response.read()) is True
    assert prefect_server.api_url == f"http://127.0.0.1:{prefect_server.port}/api"
    env = prefect_server.env()
    assert env["PREFECT_API_URL"] == prefect_server.api_url
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert (prefect_server.home / "prefect.db").exists()
    assert prefect_server.env(full=False) == {k: v for k, v in env.items()
                                               if k.startswith("PREFECT_")}


SLEEPY_FLOW = """
import os, time
from prefect import flow

@flow
def sleepy(marker: str):
    with open(marker, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
"""

DEPLOY_AND_RUN = """
import asyncio, sys
from prefect.client.orchestration import get_client

async def main(project, pool):
    async with get_client() as client:
        flow_id = await client.create_flow_from_name("sleepy")
        deployment_id = await client.create_deployment(
            flow_id=flow_id, name="sleepy", entrypoint="sleepy.py:sleepy", work_pool_name=pool,
            path=project, job_variables={"working_dir": project})
        run = await client.create_flow_run_from_deployment(
            deployment_id, parameters={"marker": project + "/flow.pid"})
        print(run.id)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.prefect_server
def test_prefect_worker_registers_runs_a_flow_and_stops_without_orphans(prefect_server, tmp_path):
    pool = "test-process-pool"
    created = _prefect_cli(prefect_server, "work-pool", "create", pool, "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    inspected = _prefect_cli(prefect_server, "work-pool", "inspect", pool)
    assert inspected.returncode == 0 and "process" in inspected.stdout

    project = tmp_path / "project"
    project.mkdir()
    (project / "sleepy.py").write_text(SLEEPY_FLOW)
    deployed = subprocess.run([sys.executable, "-c", DEPLOY_AND_RUN, str(project), pool],
                              env=prefect_server.env(), capture_output=True, text=True,
                              timeout=120)
    assert deployed.returncode == 0, deployed.stderr

    with PrefectWorker(pool, prefect_server.env(), cwd=project) as worker:
        assert worker.registered_workers().get(worker.worker_name) == "ONLINE"
        pid_file = project / "flow.pid"
        flow_pid = int(_wait_for(lambda: pid_file.exists() and pid_file.read_text(), 120,
                                 "the flow run to start"))
        family = {p.pid for p in worker.process.family()}
        assert {worker.pid, flow_pid} <= family, "flow-run process must be found for teardown"
        worker.stop()
        assert not worker.running()
        assert _alive(family) == [], f"left running after worker stop: {_alive(family)}"
    assert prefect_server.health_ok(), "stopping the worker must not touch the server"


@pytest.mark.prefect_server
def test_prefect_server_stop_leaves_no_process(prefect_server):
    """Stops the module's server (the tests above have used it: a server that served a flow run
    and a worker), so it runs last here; the fixture's own stop afterwards finds nothing to do."""
    server = prefect_server
    assert server.health_ok()
    pids = {p.pid for p in server.process.family()}
    assert server.pid in pids
    port = server.port
    server.stop()
    assert not server.running()
    assert not server.health_ok()
    assert not _port_open(port)
    assert _alive(pids) == []
    assert server.process.family() == []
    assert f"PREFECT_API_URL={server.api_url}" in (server.log_dir / "prefect-server.log").read_text()


def test_the_session_harness_server_batches_and_the_tests_settings_do_not(prefect_harness):
    """conftest gives the session server's process (the run's shared one, or this process's own
    harness) the private server's batching; the settings this process's tests see (and hand to the
    private servers they start) stay without it."""
    from prefect.settings import get_current_settings

    from espnet3_flows.orchestration.local_server import SERVER_BATCHING, SERVER_START_SETTINGS

    server = psutil.Process(prefect_harness["pid"])
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    with open(f"/proc/{prefect_harness['pid']}/environ", "rb") as fh:
        launched = dict(item.decode().split("=", 1) for item in fh.read().split(b"\0") if b"=" in item)
    wanted = {**SERVER_BATCHING, **SERVER_START_SETTINGS}
    assert {k: launched.get(k) for k in wanted} == {k: os.environ.get(k, v) for k, v in wanted.items()}
    mine = get_current_settings().to_environment_variables(exclude_unset=True)
    assert not set(wanted) & set(mine), sorted(set(wanted) & set(mine))
