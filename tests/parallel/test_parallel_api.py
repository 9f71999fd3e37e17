"""ESPnet3's parallel API on a real LocalCluster: get_client(config, setup_fn), parallel_map and
parallel_for with worker-env injection, build_client, the seed's get_client(plugin) form."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from distributed.diagnostics.plugin import WorkerPlugin

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.parallel import build_client, get_client, get_parallel_config, parallel_for, parallel_map
from espnet3_flows.parallel.parallel import set_parallel

pytestmark = pytest.mark.dask
LOCAL2 = {"env": "local", "n_workers": 2}
ROOT = Path(__file__).resolve().parents[2]


def setup_env():
    return {"bias": 5, "scale": 2, "pid": os.getpid()}


def add_bias(x, bias):
    return x + bias


def everything(x, **env):
    return sorted(env)


def slow_first(x, scale):
    time.sleep(0.3 if x < 2 else 0.0)  # the first items finish last
    return x * scale


def fails_on_3(x):
    if x == 3:
        raise KeyError("no item 3")
    time.sleep(0.05)
    return x


def writes_marker(x, bias, marker):
    Path(marker, str(x)).touch()
    return x + bias


def worker_pid(x, pid):
    return pid


@pytest.fixture(scope="module")
def client():
    with get_client(LOCAL2, setup_fn=setup_env) as c:
        yield c


def test_results_in_input_order_under_uneven_times(client):
    assert parallel_map(slow_first, range(6), client=client) == [2 * x for x in range(6)]


def test_env_reaches_func_by_name_unknown_keys_filtered_all_with_kwargs(client):
    assert parallel_map(add_bias, [10, 20, 30], client=client) == [15, 25, 35]  # scale and pid filtered out
    assert parallel_map(everything, [0, 1], client=client) == [["bias", "pid", "scale"]] * 2


def test_setup_fn_ran_on_the_workers(client):
    pids = set(parallel_map(worker_pid, range(20), client=client))
    assert pids <= set(client.run(os.getpid).values()) and os.getpid() not in pids


def test_a_key_given_twice_is_an_error_naming_it_before_anything_runs(client, tmp_path):
    with pytest.raises(ValueError, match="'bias'") as err:
        parallel_map(writes_marker, range(4), client=client, bias=1, marker=str(tmp_path))
    assert "setup_fn" in str(err.value)
    assert not list(tmp_path.iterdir())  # no item ran
    assert parallel_map(writes_marker, range(4), client=client, marker=str(tmp_path)) == [5, 6, 7, 8]


def test_parallel_for_yields_as_completed_and_raises_at_the_failure(client):
    got = sorted(parallel_for(slow_first, range(5), client=client))
    assert got == [0, 2, 4, 6, 8]
    seen = []
    with pytest.raises(KeyError, match="no item 3"):
        for y in parallel_for(fails_on_3, range(40), client=client):
            seen.append(y)
    assert 3 not in seen and len(seen) < 40


def test_setup_fn_returning_something_else_is_a_value_error():
    set_parallel({"env": "serial"})
    try:
        with pytest.raises(ValueError, match="must return a dict"):
            parallel_map(add_bias, [1], setup_fn=lambda: [("bias", 1)])
    finally:
        set_parallel(None)
    with pytest.raises(ValueError, match="must return a dict"), get_client(LOCAL2, setup_fn=lambda: "not a dict"):
        pass


def test_without_a_client_a_cluster_of_set_parallels_config_is_started_and_closed():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    set_parallel(LOCAL2)
    try:
        assert parallel_map(add_bias, [1, 2, 3], setup_fn=setup_env) == [6, 7, 8]
        assert sorted(parallel_for(slow_first, [1, 2], setup_fn=setup_env)) == [2, 4]
    finally:
        set_parallel(None)
    deadline = time.monotonic() + 10  # the workers exit on their own once the cluster is closed
    while (left := _new_children(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, [p.cmdline() for p in left]


def _new_children(before: set[int]) -> list[psutil.Process]:
    """This process's descendants not in ``before`` still alive (zombies count as gone), less the
    resource tracker and the forkserver, which live as long as this process."""
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid in before or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" not in " ".join(p.cmdline()) and "forkserver" not in " ".join(p.cmdline()):
                left.append(p)
        except psutil.NoSuchProcess:
            continue
    return left


def test_serial_runs_here_with_setup_fn_once():
    calls = []

    def setup():
        calls.append(1)
        return {"bias": 100}

    set_parallel({"env": "serial"})
    try:
        assert parallel_map(add_bias, [1, 2], setup_fn=setup) == [101, 102]
        assert list(parallel_for(add_bias, [3], setup_fn=setup)) == [103]
        assert get_parallel_config().env == "serial" and len(calls) == 2  # once per call
    finally:
        set_parallel(None)


def test_get_client_closes_the_cluster_it_started():
    with get_client(LOCAL2) as c:
        cluster = c.cluster
        assert parallel_map(add_bias, [1], client=c, bias=2) == [3]
    assert cluster.status.name == "closed" and c.status == "closed"


def test_build_client_unknown_env_names_the_known_ones():
    with pytest.raises(ValueError, match="local_gpu") as err:
        build_client({"env": "kubernetes-please"})
    assert "slurm" in str(err.value) and "serial" in str(err.value)
    with pytest.raises(ConfigError, match="serial runs in this process"):
        build_client({"env": "serial"})
    c = build_client(LOCAL2)
    try:
        assert parallel_map(add_bias, [1], client=c, bias=1) == [2]
    finally:
        c.close()
        c.cluster.close()


class _Counter(WorkerPlugin):
    name = "counter"

    def setup(self, worker):
        worker.counter = 41


def _counter(x, dask_worker=None):
    from distributed import get_worker

    return get_worker().counter + x


def test_the_seeds_get_client_plugin_form():
    set_parallel(LOCAL2)
    try:
        with get_client(_Counter()) as c:
            assert parallel_map(_counter, [1], client=c) == [42]
    finally:
        set_parallel(None)


def test_a_script_written_for_espnet3_runs_with_its_imports_changed(tmp_path):
    script = textwrap.dedent('''
        from omegaconf import OmegaConf
        from espnet3_flows.parallel.parallel import get_client, parallel_for, parallel_map, set_parallel

        def setup():
            return {"offset": 10}

        def score(x, offset):
            return x + offset

        if __name__ == "__main__":
            cfg = OmegaConf.create({"parallel": {"env": "local", "n_workers": 2, "options": {},
                                                 "allow_overwrite_lock": False}})
            set_parallel(cfg.parallel)
            with get_client(cfg.parallel, setup_fn=setup) as client:
                print(parallel_map(score, range(5), client=client))
            print(sorted(parallel_for(score, range(3), setup_fn=setup)))
    ''')
    path = tmp_path / "espnet3_style.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == ["[10, 11, 12, 13, 14]", "[10, 11, 12]"]
