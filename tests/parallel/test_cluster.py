"""ParallelConfig, cluster construction, get_client with a worker plugin, parallel_map."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import distributed
import pytest

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.parallel import (
    ParallelConfig,
    cluster_spec,
    get_client,
    parallel_map,
    plugin_for,
    set_parallel,
)
from espnet3_flows.parallel.worker_registry import worker_resources
from tests.parallel.jobs_for_tests import ArrayProvider


def test_unknown_env_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"parallel.env.*'slurmm'.*did you mean 'slurm'"):
        ParallelConfig(env="slurmm")


def test_unknown_cluster_option_fails_at_construction():
    with pytest.raises(ConfigError, match=r"parallel.options.queu: not an option of dask_jobqueue.SLURMCluster.*'queue'"):
        ParallelConfig(env="slurm", options={"queu": "debug"})
    with pytest.raises(ConfigError, match="n_workers"):
        load_config(ParallelConfig, overrides=["n_workers=-1"])


def test_cluster_specs():
    from espnet3_flows.parallel.backends.jobqueue import BatchJobs

    local = cluster_spec(ParallelConfig(env="local", n_workers=3))
    assert local.class_path == "distributed.LocalCluster" and local.kwargs["n_workers"] == 3
    assert local.kwargs["processes"] is True and local.kwargs["threads_per_worker"] == 1
    assert cluster_spec(ParallelConfig(env="local")).kwargs["n_workers"] == os.cpu_count()
    slurm = cluster_spec(ParallelConfig(env="slurm", n_workers=4, options={"queue": "debug", "walltime": "01:00:00"}))
    assert isinstance(slurm.backend, BatchJobs) and slurm.n_workers == 4 and slurm.kwargs["queue"] == "debug"
    assert cluster_spec(ParallelConfig(env="pbs", adapt={"minimum": 0, "maximum": 8})).adapt == {"minimum": 0, "maximum": 8}
    with pytest.raises(ConfigError, match="adapt"):
        ParallelConfig(env="slurm", adapt={"max": 3})


def test_local_gpu_without_dask_cuda_is_clear():
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="dask_cuda"):
            ParallelConfig(env="local_gpu")
    else:
        assert cluster_spec(ParallelConfig(env="local_gpu")).class_path == "dask_cuda.LocalCUDACluster"


def _env_pid_and_size(_: int) -> tuple[int, int]:
    from distributed import get_worker  # noqa: F401 - runs on a worker

    resources = worker_resources(ArrayProvider({"n": 7}))
    return resources["pid"], len(resources["data"])


@pytest.mark.dask
def test_get_client_plugin_builds_env_once_per_worker():
    set_parallel({"env": "local", "n_workers": 2})
    try:
        with get_client(plugin_for(ArrayProvider({"n": 7})), wait_for_workers=2) as client:
            out = parallel_map(_env_pid_and_size, range(20), client=client)
            setup_pids = {pid for pid, _ in out}
            worker_pids = set(client.run(os.getpid).values())
    finally:
        set_parallel(None)
    assert setup_pids <= worker_pids and all(size == 7 for _, size in out)


def test_parallel_map_in_process_keeps_order():
    set_parallel({"env": "serial"})
    try:
        assert parallel_map(lambda x: x * x, range(10)) == [x * x for x in range(10)]
    finally:
        set_parallel(None)


def _trim_env(_: int) -> str | None:
    return os.environ.get("MALLOC_TRIM_THRESHOLD_")


@pytest.mark.dask
@pytest.mark.parametrize("trim", [False, True])
def test_worker_malloc_trim_setting(trim):
    cfg = ParallelConfig(env="local", n_workers=1, options={"trim_worker_memory": trim})
    with get_client(config=cfg) as client:
        seen = client.submit(_trim_env, 0, pure=False).result()
    assert seen == ("65536" if trim else None)


@pytest.mark.dask
def test_the_scheduler_keeps_few_messages_per_worker():
    """Each scheduler → worker stream keeps its last messages for debugging, and every message
    holds whole task specs (~100 KB each for a Prefect shard task): Dask's 1,000 per worker kept
    ~100 MB per worker on the driver during a long run; ours keep LOW_LEVEL_LOG_LENGTH."""
    from espnet3_flows.parallel.cluster import make_cluster
    from espnet3_flows.parallel.dask_plugins import LOW_LEVEL_LOG_LENGTH

    cfg = ParallelConfig(env="local", n_workers=1, allowed_failures=5)
    cluster = make_cluster(cfg)
    try:
        with distributed.Client(cluster) as client:
            client.wait_for_workers(1)
            cfg.backend.prepare(client, cfg)
            assert cluster.scheduler.allowed_failures == 5
            assert client.gather(client.map(_square, range(3 * LOW_LEVEL_LOG_LENGTH), pure=False))[-1] > 0
            streams = list(cluster.scheduler.stream_comms.values())
            assert streams and all(s.recent_message_log.maxlen == LOW_LEVEL_LOG_LENGTH for s in streams)
            assert all(len(s.recent_message_log) <= LOW_LEVEL_LOG_LENGTH for s in streams)
            assert cluster.scheduler.transition_log.maxlen == LOW_LEVEL_LOG_LENGTH
    finally:
        cluster.close()


def _square(x: int) -> int:
    return x * x


@pytest.mark.dask
def test_untrimmed_workers_after_a_dask_default_cluster_in_the_same_process(monkeypatch):
    """A user's own LocalCluster (Dask's defaults) leaves MALLOC_TRIM_THRESHOLD_ in os.environ;
    our next cluster's workers must still run without it."""
    import dask
    from distributed import Client, LocalCluster

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_", raising=False)
    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": 65536}), \
            LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        assert c.submit(_trim_env, 0, pure=False).result() == "65536"
    assert os.environ.get("MALLOC_TRIM_THRESHOLD_") == "65536"  # what Dask's nanny leaves behind
    with get_client(config=ParallelConfig(env="local", n_workers=1)) as client:
        assert client.submit(_trim_env, 0, pure=False).result() is None
    assert os.environ.get("MALLOC_TRIM_THRESHOLD_") == "65536"  # put back: this process's environment is the user's


def test_site_jobqueue_yaml_is_not_overridden(tmp_path):
    """A site's jobqueue.yaml (here: a real DASK_CONFIG file read by dask in a fresh process)
    sizes the jobs; our fallbacks fill in only what neither it nor parallel.options gives."""
    import subprocess
    import sys

    (tmp_path / "jobqueue.yaml").write_text(
        "jobqueue:\n  slurm:\n    cores: 8\n    memory: 64GB\n    queue: site-default\n"
        "    job_extra_directives: ['--account=speech']\n")
    code = (
        "import dask_jobqueue, json\n"
        "from espnet3_flows.parallel.cluster import cluster_spec\n"
        "from espnet3_flows.parallel.parallel_config import ParallelConfig\n"
        "site = cluster_spec(ParallelConfig(env='slurm'))\n"
        "mine = cluster_spec(ParallelConfig(env='slurm', options={'cores': 2}))\n"
        "pbs = cluster_spec(ParallelConfig(env='pbs'))\n"
        "c = dask_jobqueue.SLURMCluster(**site.kwargs)\n"
        "print(json.dumps([site.kwargs, mine.kwargs, pbs.kwargs, c.job_script()]))\n"
        "c.close()\n")
    env = {**os.environ, "DASK_CONFIG": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site, mine, pbs, script = json.loads(proc.stdout.splitlines()[-1])
    assert "cores" not in site and "memory" not in site, site   # left to jobqueue.yaml
    assert site.get("processes") == 1                              # the site set none
    assert mine["cores"] == 2                                      # parallel.options wins
    assert pbs["cores"] == 1 and pbs["memory"] == "2GB"            # no site config for pbs: fallbacks
    assert "#SBATCH --cpus-per-task=8" in script and "#SBATCH --mem=60G" in script, script
    assert "#SBATCH -p site-default" in script and "#SBATCH --account=speech" in script, script


def _pids(client: distributed.Client) -> dict[str, int]:
    return client.run(os.getpid)


def _the_only_worker(client: distributed.Client, cluster: Any) -> tuple[str, int]:
    """The address and pid of a one-worker cluster's worker. Where the cluster closed the nanny
    meanwhile (what the test below checks) the call to the worker can fail on its closed
    connection: that is the AssertionError it is, not an error of the test."""
    try:
        pids = _pids(client)
    except OSError:   # distributed's CommClosedError among them
        assert len(cluster.workers) == 1, "the cluster closed the nanny of a killed worker"
        raise
    assert len(pids) == 1 and len(cluster.workers) == 1, f"the cluster closed the nanny of a killed worker: {pids}"
    (address, pid), = pids.items()
    return address, pid


@pytest.mark.patch
@pytest.mark.dask
def test_a_local_worker_killed_again_and_again_keeps_its_nanny():
    """Dask's SpecCluster closes a nanny whose worker is not back when lost-worker-timeout (15 s)
    ends; with a shard killing every worker it runs on, the check fell between a death and the
    restart and the cluster ran out of workers (the run then hung). Ours are restarted for good:
    here with the timeout far below a restart's time."""
    import signal
    import time

    import dask

    from espnet3_flows.parallel.cluster import make_cluster

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "10ms"}):
        cluster = make_cluster(ParallelConfig(env="local", n_workers=1))
        try:
            with distributed.Client(cluster) as client:
                client.wait_for_workers(1, timeout=60)
                for _ in range(2):
                    address, pid = _the_only_worker(client, cluster)
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 60
                    while set(client.scheduler_info()["workers"]) in (set(), {address}):
                        assert len(cluster.workers) == 1, "the cluster closed the nanny of a killed worker"
                        assert time.monotonic() < deadline, "the killed worker never came back"
                        time.sleep(0.05)
                # the kills' lost-worker timers (10 ms) fire in this window: the nanny stays throughout
                # (what the scheduler lists may blink meanwhile on a loaded machine; a worker is back after)
                window = time.monotonic() + 0.5
                while time.monotonic() < window:
                    assert len(cluster.workers) == 1, "the cluster closed the nanny of a killed worker"
                    time.sleep(0.02)
                client.wait_for_workers(1, timeout=60)
                assert len(cluster.workers) == 1
                assert client.submit(_square, 3, pure=False).result(timeout=60) == 9
        finally:
            cluster.close()


@contextlib.contextmanager
def _prepared_cluster(cfg: ParallelConfig) -> Iterator[tuple[Any, distributed.Client]]:
    """A cluster made and prepared as a run makes it, with a client; closed after."""
    from espnet3_flows.parallel.cluster import make_cluster

    cluster = make_cluster(cfg)
    try:
        with distributed.Client(cluster) as client:
            client.wait_for_workers(1, timeout=60)
            cfg.backend.prepare(client, cfg)
            yield cluster, client
    finally:
        cluster.close()


@pytest.mark.dask
def test_a_shard_with_no_worker_left_fails_rather_than_waits(monkeypatch):
    """A local cluster that has no worker for LOCAL_NO_WORKERS_TIMEOUT fails what waits on it
    (Dask's own ``no-workers-timeout`` wins where the user set it)."""
    import time

    import dask

    from espnet3_flows.parallel.backends.local import OnThisMachine

    monkeypatch.setattr(OnThisMachine, "no_workers_timeout", 0.5)
    cfg = ParallelConfig(env="local", n_workers=1)
    with _prepared_cluster(cfg) as (cluster, client):
        assert cluster.scheduler.no_workers_timeout == 0.5
        cluster.scale(0)
        while client.scheduler_info()["workers"]:
            time.sleep(0.05)
        error = client.submit(_square, 3, pure=False).exception(timeout=60)
        assert "without any running workers" in str(error), error
    with dask.config.set({"distributed.scheduler.no-workers-timeout": "7s"}), _prepared_cluster(cfg) as (cluster, _):
        assert cluster.scheduler.no_workers_timeout == 7
