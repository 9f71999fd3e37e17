"""Local workers forked from the preloaded forkserver: what they import, which environment they see, when they spawn."""

from __future__ import annotations

import multiprocessing.forkserver
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel import ParallelConfig, get_client
from espnet3_flows.parallel.forkserver import (
    local_worker_start,
    preloaded_modules,
    start_forkserver,
    stop_forkserver,
)

PRELOAD = "colorsys"  # a stdlib module nothing else here imports


def _worker_view(_: int) -> tuple[bool, str | None, int]:
    return PRELOAD in sys.modules, os.environ.get("ESPNET3_FORKSERVER_TEST"), os.getppid()


@pytest.fixture
def fresh_forkserver(monkeypatch):
    stop_forkserver()
    monkeypatch.delenv("ESPNET3_FORKSERVER_TEST", raising=False)
    sys.modules.pop(PRELOAD, None)
    yield
    stop_forkserver()


@pytest.mark.patch
@pytest.mark.dask
def test_workers_are_forked_preloaded_and_see_later_environment(fresh_forkserver, monkeypatch, tmp_path):
    monkeypatch.setenv("ESPNET3_FLOWS_TIMELINE", str(tmp_path / "timeline.jsonl"))
    assert start_forkserver([PRELOAD])
    assert preloaded_modules() == ("distributed", PRELOAD)
    assert PRELOAD not in sys.modules  # imported by the server process, not here
    monkeypatch.setenv("ESPNET3_FORKSERVER_TEST", "set after the server started")
    with get_client(config=ParallelConfig(env="local", n_workers=2), wait_for_workers=2) as client:
        seen = client.run(_worker_view, 0)
    server_pid = multiprocessing.forkserver._forkserver._forkserver_pid
    assert len(seen) == 2
    for preloaded, env_value, parent in seen.values():
        assert preloaded and env_value == "set after the server started" and parent == server_pid
    # the server's imports done, marked once by the server itself in the run's timeline
    events = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert [(e["event"], e["pid"]) for e in events] == [("forkserver_ready", server_pid)]


@pytest.mark.patch
@pytest.mark.dask
def test_a_killed_worker_is_restarted_from_the_forkserver(fresh_forkserver):
    """Its nanny (:class:`~espnet3_flows.parallel.forking_nanny.ForkingNanny`) forks it again, not
    Dask's default outside the cluster's start: a spawned interpreter of this process."""
    assert start_forkserver([PRELOAD])
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with get_client(config=ParallelConfig(env="local", n_workers=1), wait_for_workers=1) as client:
        [first] = client.run(os.getpid).values()
        [(preloaded, _, parent)] = client.run(_worker_view, 0).values()
        assert parent == server and preloaded
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:  # the nanny restarts it; the scheduler may still list the dead one a moment
            with contextlib.suppress(Exception):
                pids = list(client.run(os.getpid).values())
                if pids and pids[0] != first:
                    break
            assert time.monotonic() < deadline, "the killed worker was not restarted in 90 s"
            time.sleep(0.2)
        [(preloaded, _, parent)] = client.run(_worker_view, 0).values()
    # forked by the same server, its imports already done
    assert parent == server and preloaded, (pids, parent, os.getpid())


@pytest.mark.dask
def test_a_variable_removed_since_the_server_started_means_spawn(fresh_forkserver, monkeypatch):
    monkeypatch.setenv("ESPNET3_FORKSERVER_TEST", "removed later")
    assert start_forkserver([PRELOAD])
    monkeypatch.delenv("ESPNET3_FORKSERVER_TEST")
    cfg = ParallelConfig(env="local", n_workers=1)
    assert local_worker_start({"n_workers": 1})[0] == "spawn"
    with get_client(config=cfg) as client:
        preloaded, env_value, parent = client.submit(_worker_view, 0, pure=False).result()
    assert env_value is None and not preloaded and parent == os.getpid()  # spawned by the nanny here


@pytest.mark.patch
def test_user_env_option_wins_over_the_forwarded_environment(fresh_forkserver, monkeypatch):
    start_forkserver()
    monkeypatch.setenv("ESPNET3_FORKSERVER_TEST", "driver")
    cfg = ParallelConfig(env="local")
    assert cfg.backend.forks_workers(cfg)  # (the local cluster's decision; with the patches off it spawns)
    method, kwargs = local_worker_start({"env": {"ESPNET3_FORKSERVER_TEST": "option"}})
    assert method == "forkserver" and kwargs["env"]["ESPNET3_FORKSERVER_TEST"] == "option"


def _forks(cfg: ParallelConfig) -> bool:
    return cfg.backend.forks_workers(cfg)


@pytest.mark.patch
def test_which_configs_fork():
    assert _forks(ParallelConfig(env="local"))
    assert not _forks(ParallelConfig(env="local", options={"start_method": "spawn"}))
    assert not _forks(ParallelConfig(env="local", options={"trim_worker_memory": True}))  # glibc reads it at exec
    assert not _forks(ParallelConfig(env="slurm")) and not _forks(ParallelConfig(env="serial"))
    with pytest.raises(ConfigError, match="start_method"):
        ParallelConfig(options={"start_method": "fork"})


SCRIPT = '''
import os, sys
with open(os.environ["IMPORTS_LOG"], "a") as f:
    f.write(f"{__name__} {os.getpid()}\\n")
if __name__ == "__main__":
    from espnet3_flows.parallel import ParallelConfig, get_client
    from espnet3_flows.parallel.forkserver import start_forkserver
    import multiprocessing.forkserver

    assert start_forkserver(["colorsys"])
    with get_client(config=ParallelConfig(env="local", n_workers=2), wait_for_workers=2) as client:
        seen = client.run(lambda: (sys.modules["__main__"].__file__, "colorsys" in sys.modules, os.getppid()))
    print(multiprocessing.forkserver._forkserver._forkserver_pid, sorted(set(seen.values())))
    from espnet3_flows.parallel import main_guard
    print(main_guard.read_status())
'''


@pytest.mark.patch
@pytest.mark.dask
def test_the_driver_script_is_imported_once_by_the_forkserver_not_by_each_worker(tmp_path):
    """Python's spawn semantics import the main script in every child; the forkserver imports it
    once instead (Python 3.11's own ``'__main__'`` preload never receives the path)."""
    import subprocess

    script, log = tmp_path / "driver.py", tmp_path / "imports.log"
    script.write_text(SCRIPT)
    env = {**os.environ, "IMPORTS_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    env.pop("ESPNET3_FLOWS_FORKSERVER_MAIN", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    first, status = out.stdout.splitlines()
    assert status == "imported"  # what the server wrote for this process (guarded: no error to raise)
    server_pid, seen = first.split(" ", 1)
    imports = [line.split() for line in log.read_text().splitlines()]
    assert [name for name, _ in imports] == ["__main__", "__mp_main__"]  # the driver, then the forkserver only
    assert imports[1][1] == server_pid
    assert seen.strip() == repr([(str(script), True, int(server_pid))])  # forked workers: main module and preload there


def test_main_module_ref_names_a_script_by_path(monkeypatch, tmp_path):
    import types

    from espnet3_flows.parallel.forkserver import main_module_ref

    fake = types.ModuleType("__main__")
    fake.__file__ = str(tmp_path / "driver.py")
    fake.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert main_module_ref() == f"path:{tmp_path / 'driver.py'}"
    fake.__spec__ = types.SimpleNamespace(name="espnet3_flows.__main__")  # python -m: children import nothing
    assert main_module_ref() is None
    fake.__spec__ = types.SimpleNamespace(name="mypkg.driver")
    assert main_module_ref() == "name:mypkg.driver"


UNGUARDED = '''
from espnet3_flows.parallel import ParallelConfig, get_client
from espnet3_flows.parallel.forkserver import start_forkserver

start_forkserver()  # at import: the forkserver, importing this script, stops here
with get_client(config=ParallelConfig(env="local", n_workers=1)) as client:
    pass
'''


@pytest.mark.dask
def test_an_unguarded_driver_script_is_reported_by_the_forkserver_in_one_line(tmp_path):
    """The forkserver's import of a script that starts workers at import is recorded for the
    driver, which raises before it starts a cluster; nothing else is printed (the server's import,
    and the workers', end silently)."""
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    for key in ("ESPNET3_FLOWS_FORKSERVER_MAIN", "ESPNET3_FLOWS_MAIN_STATUS"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert (out.stdout + out.stderr).splitlines() == [
        'error: unguarded.py starts Dask workers when it is imported, and each Dask worker imports it: put that '
        'code under if __name__ == "__main__":']
