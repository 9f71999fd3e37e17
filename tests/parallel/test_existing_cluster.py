"""``parallel.env: address``: shards run on a Dask cluster someone else started, which keeps running.

The cluster is real: ``dask scheduler`` and ``dask worker`` processes started here, in their own
sessions, and always stopped (with everything they started) when the fixture ends.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.parallel import ParallelConfig, cluster_spec, get_client, make_cluster, plugin_for
from espnet3_flows.parallel.parallel_config import scheduler_address
from tests.parallel.jobs_for_tests import ArrayProvider, ScaleSumRunner
from tests.support.servers import ManagedProcess, ProcessStartError, free_port

ROOT = Path(__file__).resolve().parents[2]


# ---- a cluster started by someone else ------------------------------------------------------

def _dask_cli() -> list[str]:
    exe = Path(sys.executable).parent / "dask"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dask"]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class ExternalDaskCluster:
    """``dask scheduler --scheduler-file F`` and ``n_workers`` ``dask worker`` processes (one
    single-threaded worker each), with this checkout importable by the workers."""

    def __init__(self, log_dir: Path, n_workers: int = 2, extra_environ: dict[str, str] | None = None):
        self.log_dir = log_dir
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.scheduler_file = log_dir / "scheduler.json"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.environ = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
                        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(extra_environ or {})}
        self.scheduler = ManagedProcess(
            [*_dask_cli(), "scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--dashboard-address", ":0",
             "--scheduler-file", str(self.scheduler_file)],
            name="dask-scheduler", log_path=log_dir / "scheduler.log", env=self.environ, cwd=ROOT)
        self.workers = [ManagedProcess(
            [*_dask_cli(), "worker", self.address, "--host", "127.0.0.1", "--nthreads", "1", "--nworkers", "1"],
            name=f"dask-worker-{i}", log_path=log_dir / f"worker-{i}.log", env=self.environ, cwd=ROOT)
            for i in range(n_workers)]

    def start(self) -> ExternalDaskCluster:
        t0 = time.monotonic()
        try:
            self.scheduler.start()
            self.scheduler.wait_until(lambda: _port_open(self.port) and self.scheduler_file.exists(),
                                      timeout=60, what="listening")
            for worker in self.workers:
                worker.start()
            self.scheduler.wait_until(lambda: len(self.snapshot()) == len(self.workers), timeout=120,
                                      what=f"{len(self.workers)} workers joined", interval=1.0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for proc in (*self.workers, self.scheduler):
            proc.stop()

    def client(self):
        """A short-lived client that is nobody's default (the code under test opens its own)."""
        from distributed import Client

        return Client(self.address, set_as_default=False, timeout=10)

    def snapshot(self) -> dict[str, int]:
        """Worker address → worker process id, as the scheduler sees them."""
        return self.run(os.getpid)

    def alive(self) -> bool:
        return self.scheduler.running() and all(w.running() for w in self.workers)

    def run(self, func, *args):
        """``func(*args)`` on every worker. Dask pickles ``func`` by reference when it can, and
        the workers cannot import this test module (no ``__init__.py`` here): pass a lambda or
        a library function."""
        with self.client() as client:
            return client.run(func, *args)

    def computed_keys(self) -> set[str]:
        """Keys of every task the workers computed (their transition logs)."""
        logs = self.run(lambda dask_worker: [e[0] for e in dask_worker.state.log if len(e) > 2 and e[2] == "memory"])
        return {str(k) for keys in logs.values() for k in keys}

    def resource_tokens(self) -> dict[str, list[str]]:
        """The worker resources built by our worker plugins, per worker."""
        return self.run(lambda: sorted(importlib.import_module("espnet3_flows.parallel.worker_registry")._RESOURCES))

    def scheduler_plugins(self) -> list[str]:
        with self.client() as client:
            return client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.worker_plugins))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in (self.scheduler, *self.workers))


@pytest.fixture(scope="module")
def external_cluster(tmp_path_factory, prefect_harness):
    """One running cluster for the module (a start is ~7 CPU-s): its workers have the session's
    Prefect API URL in their environment, as a deployment's would, for the flow tests. Each test
    compares the cluster with itself before and after (same processes, its own plugins gone)."""
    cluster = ExternalDaskCluster(tmp_path_factory.mktemp("dask-cluster"),
                                  extra_environ={"PREFECT_API_URL": prefect_harness["api_url"]})
    try:
        cluster.start()
    except ProcessStartError as exc:
        pytest.fail(f"the test's Dask cluster did not start: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


# ---- (a) configuration ----------------------------------------------------------------------

def test_address_needs_exactly_one_of_address_and_scheduler_file():
    needs = r"parallel.env=address needs exactly one of parallel.options.address .*parallel.options.scheduler_file"
    with pytest.raises(ConfigError, match=needs):
        ParallelConfig(env="address")
    with pytest.raises(ConfigError, match="both are set"):
        ParallelConfig(env="address", options={"address": "tcp://h:8786", "scheduler_file": "/tmp/s.json"})
    given = ParallelConfig(env="address", options={"address": "tcp://h:8786"}).placement_options
    assert given.address == "tcp://h:8786"
    later = ParallelConfig(env="address", options={"scheduler_file": "/not/yet/written.json"}).placement_options
    assert later.scheduler_file  # read at run time
    with pytest.raises(ConfigError, match=r"did you mean 'address'"):
        ParallelConfig(env="adress", options={"address": "tcp://h:8786"})


@pytest.mark.parametrize("key, value", [("n_workers", 2), ("options.memory_limit", "2GB"),
                                        ("adapt", {"maximum": 4}), ("options.trim_worker_memory", True)])
def test_address_rejects_settings_of_clusters_it_does_not_start(key, value):
    given = {"options": {"address": "tcp://h:8786"}}
    if key.startswith("options."):
        given["options"][key.split(".")[1]] = value
    else:
        given[key] = value
    with pytest.raises(ConfigError, match=rf"parallel.{key} cannot be set with parallel.env=address"):
        ParallelConfig(env="address", **given)


@pytest.mark.parametrize("env", ["serial", "local", "slurm"])
@pytest.mark.parametrize("key", ["address", "scheduler_file"])
def test_other_envs_reject_a_scheduler(env, key):
    only = rf"parallel.options.{key} .*only with parallel.env=address \(parallel.env is '{env}'\)"
    with pytest.raises(ConfigError, match=only):
        ParallelConfig(env=env, options={key: "tcp://h:8786"})
    with pytest.raises(ConfigError, match=rf"parallel.options.{key} .*only with parallel.env=address"):
        load_config(ParallelConfig, overrides=[f"env={env}", f"{key}=tcp://h:8786"])  # its old spelling


def test_address_is_checked_and_has_no_cluster_class():
    with pytest.raises(ConfigError, match=r"parallel.options.address: 'foo://h:1' is not a Dask scheduler address"):
        ParallelConfig(env="address", options={"address": "foo://h:1"})
    cfg = load_config(ParallelConfig, overrides=["env=address", "address=tcp://10.0.0.5:8786"])  # the old spelling
    assert scheduler_address(cfg) == "tcp://10.0.0.5:8786" and cfg.options == {"address": "tcp://10.0.0.5:8786"}
    with pytest.raises(ConfigError, match="no cluster to build"):
        cluster_spec(cfg)
    with pytest.raises(ConfigError, match="no cluster to build"):
        make_cluster(cfg)
    with pytest.raises(ConfigError, match="use parallel.env=address"):
        scheduler_address(ParallelConfig(env="local", n_workers=1))


def test_scheduler_file_errors_are_clear(tmp_path):
    def cfg(path: Path) -> ParallelConfig:
        return ParallelConfig(env="address", options={"scheduler_file": str(path)})

    cannot = r"parallel.options.scheduler_file: cannot read .*missing.json.*dask scheduler --scheduler-file"
    with pytest.raises(ConfigError, match=cannot):
        scheduler_address(cfg(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json is not JSON"):
        scheduler_address(cfg(tmp_path / "bad.json"))
    (tmp_path / "empty.json").write_text(json.dumps({"type": "Scheduler"}))
    with pytest.raises(ConfigError, match=r'empty.json has no "address" field'):
        scheduler_address(cfg(tmp_path / "empty.json"))
    (tmp_path / "ok.json").write_text(json.dumps({"type": "Scheduler", "address": "tcp://10.0.0.5:8786"}))
    assert scheduler_address(cfg(tmp_path / "ok.json")) == "tcp://10.0.0.5:8786"


def test_task_runner_connects_to_the_address_and_starts_nothing(tmp_path, monkeypatch):
    from prefect_dask import DaskTaskRunner

    from espnet3_flows.orchestration import task_runner

    monkeypatch.setattr(task_runner, "start_forkserver", lambda *a, **k: pytest.fail("forkserver started"))
    runner = task_runner.make_task_runner(ParallelConfig(env="address", options={"address": "tcp://10.0.0.5:8786"}))
    assert isinstance(runner, DaskTaskRunner)
    assert runner.address == "tcp://10.0.0.5:8786" and runner.cluster_class is None and not runner.adapt_kwargs
    task_runner.prestart_workers(ParallelConfig(env="address", options={"address": "tcp://10.0.0.5:8786"}), ["numpy"])

    info = tmp_path / "scheduler.json"
    with pytest.raises(ConfigError, match="parallel.options.scheduler_file: cannot read"):
        task_runner.make_task_runner(ParallelConfig(env="address", options={"scheduler_file": str(info)}))
    info.write_text(json.dumps({"address": "tcp://10.0.0.6:8786"}))
    runner = task_runner.make_task_runner(ParallelConfig(env="address", options={"scheduler_file": str(info)}))
    assert runner.address == "tcp://10.0.0.6:8786"


def test_get_client_names_an_unreachable_scheduler():
    import dask

    answers = r"parallel.env=address: no Dask scheduler answers at tcp://127.0.0.1:\d+"
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}), pytest.raises(OSError, match=answers), \
            get_client(config=ParallelConfig(env="address", options={"address": f"tcp://127.0.0.1:{free_port()}"})):
        pass


# ---- (b) the engine on a running cluster ----------------------------------------------------

def _shard_keys(outcome) -> set[str]:
    return {f"{s.name}-{s.hash[:12]}" for s in outcome.plan.shards}  # BaseRunner's Dask keys


@pytest.mark.dask
def test_engine_runs_twice_on_the_running_cluster_and_leaves_it_running(external_cluster, tmp_path):
    print(f"scheduler + {len(external_cluster.workers)} workers started in {external_cluster.startup_seconds:.1f} s")
    before = external_cluster.snapshot()
    cfg = ParallelConfig(env="address", options={"address": external_cluster.address})
    for run in (1, 2):  # a fresh output each time: a rerun into the same one needs no cluster
        t0 = time.perf_counter()
        runner = ScaleSumRunner(ArrayProvider({"n": 40}), output_dir=str(tmp_path / f"run{run}"), shard_size=5)
        outcome = runner.run(range(40), parallel=cfg, progress=False)
        print(f"engine run {run} on the running cluster: {time.perf_counter() - t0:.2f} s")
        assert outcome.merged == {"n": 40, "sum": pytest.approx(1.5 * sum(range(40)))}
        shards = len(outcome.plan.shards)
        assert shards > 1 and outcome.computed == shards
        assert _shard_keys(outcome) <= external_cluster.computed_keys()
        assert len(list((tmp_path / f"run{run}").glob("split.*/done"))) == shards
        assert external_cluster.alive(), external_cluster.logs()
        assert external_cluster.snapshot() == before  # the same workers, same processes
    # the runs' plugins went with their clients (the scheduler replays nothing of them); the workers
    # keep the one resources dict both runs shared, in their bounded registry, for the next run to reuse
    ours = ("espnet3-resources-", "espnet3-runner-")
    assert not [p for p in external_cluster.scheduler_plugins() if p.startswith(ours)]
    assert all(len(tokens) <= 1 for tokens in external_cluster.resource_tokens().values())


@pytest.mark.dask
def test_get_client_closes_only_its_client(external_cluster):
    before = external_cluster.snapshot()
    cfg = ParallelConfig(env="address", options={"address": external_cluster.address})
    with get_client(plugin_for(ArrayProvider({"n": 3})), cfg) as client:
        assert client.scheduler.address == external_cluster.address
        assert all(external_cluster.resource_tokens().values())  # the plugin built the resources on every worker
    assert client.status == "closed"
    assert external_cluster.alive() and external_cluster.snapshot() == before


# ---- (c) a scheduler file -------------------------------------------------------------------

@pytest.mark.dask
def test_scheduler_file_finds_the_running_cluster(external_cluster, tmp_path):
    before = external_cluster.snapshot()
    cfg = load_config(ParallelConfig, overrides=["env=address", f"scheduler_file={external_cluster.scheduler_file}"])
    assert scheduler_address(cfg) == external_cluster.address
    runner = ScaleSumRunner(ArrayProvider({"n": 12}), output_dir=str(tmp_path / "out"), shard_size=4)
    outcome = runner.run(range(12), parallel=cfg, progress=False)
    assert outcome.merged["n"] == 12 and _shard_keys(outcome) <= external_cluster.computed_keys()
    again = ScaleSumRunner(ArrayProvider({"n": 12}), output_dir=str(tmp_path / "out"), shard_size=4)
    rerun = again.run(range(12), parallel=cfg, progress=False)
    assert rerun.computed == 0 and rerun.cached == len(outcome.plan.shards)
    assert external_cluster.alive() and external_cluster.snapshot() == before


# ---- the Prefect flow on a running cluster --------------------------------------------------

@pytest.mark.prefect
@pytest.mark.dask
def test_flow_runs_twice_on_the_running_cluster(external_cluster, demo_corpus, tmp_path):
    """Workers get the harness's API URL in their environment, as a deployment's would."""
    from espnet3_flows.orchestration.flows import run_job

    cluster = external_cluster
    before = cluster.snapshot()
    for run in (1, 2):  # a fresh output each time: a rerun into the same one is all cache hits, no cluster
        cfg = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(tmp_path / f"out{run}"),
               "shard_size": 8, "parallel": {"env": "address", "address": cluster.address}}
        t0 = time.perf_counter()
        summary = run_job("collect_stats", cfg, progress=False)["valid"]
        print(f"flow run {run} on the running cluster: {time.perf_counter() - t0:.2f} s")
        assert summary["shards_computed"] == 2 and summary["utterances"] == 12
        assert (tmp_path / f"out{run}" / "valid" / "feats_stats.npz").is_file()
        assert cluster.alive(), cluster.logs()
        assert cluster.snapshot() == before
    # the shard tasks ran there (the flow's worker setup imports Prefect's task engine; the
    # engine's tests before this one run no Prefect)
    assert all(cluster.run(lambda: "prefect.task_engine" in sys.modules).values())
    print("worker plugins left on the scheduler after the flows:", cluster.scheduler_plugins())


def _short_wavs(root: Path, n_files: int = 8) -> list[Path]:
    import numpy as np
    import soundfile as sf

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n_files):
        p = root / f"w{i}.wav"
        sf.write(p, (0.1 * rng.standard_normal(1600 + 160 * i)).astype("float32"), 16000)
        paths.append(p)
    return paths


def _rss(pids) -> int:
    import psutil

    return sum(psutil.Process(p).memory_info().rss for p in pids)


@pytest.mark.prefect
@pytest.mark.dask
@pytest.mark.slow
def test_only_pending_shards_run_as_tasks_on_warm_workers_with_flat_memory(external_cluster, tmp_path):
    """600 one-utterance shards after 20 done ones: 580 shard task runs (no Cached ones), envs built once
    per worker across runs, no plugin left behind, driver and worker memory flat; a third run submits nothing."""
    import psutil

    from espnet3_flows.orchestration.flows import run_job
    from tests.support.prefect_readback import runs_writing, task_run_states

    wavs = _short_wavs(tmp_path / "wav")
    lines = [f"utt{i:05d}\t{wavs[i % len(wavs)]}\n" for i in range(600)]
    manifest = tmp_path / "train.tsv"
    cluster = external_cluster
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "shard_size": 1,
           "frontend": {"type": "none"}, "parallel": {"env": "address", "address": cluster.address}}
    manifest.write_text("".join(lines[:20]))
    first = run_job("collect_stats", cfg, progress=False)["train"]
    assert (first["shards"], first["shards_computed"]) == (20, 20)
    workers = list(cluster.snapshot().values())
    tokens = cluster.resource_tokens()
    built = cluster.run(lambda: sorted(id(e) for e in importlib.import_module(
        "espnet3_flows.parallel.worker_registry")._RESOURCES.values()))
    workers_before, driver_before = _rss(workers), psutil.Process().memory_info().rss

    manifest.write_text("".join(lines))
    second = run_job("collect_stats", cfg, progress=False)["train"]
    assert (second["shards"], second["shards_computed"], second["shards_cached"]) == (600, 580, 20)
    states = task_run_states("collect-stats-shards", tmp_path / "out", expected=581)
    shard_runs = [name for name in states if name.startswith("train/split.")]
    assert len(shard_runs) == 580 and len(states) == 581, len(states)  # + the merge
    assert set(states.values()) == {"COMPLETED"}  # no Cached task run for a done shard
    assert cluster.resource_tokens() == tokens and cluster.run(lambda: sorted(id(e) for e in importlib.import_module(
        "espnet3_flows.parallel.worker_registry")._RESOURCES.values())) == built, "resources were built twice"
    assert not [p for p in cluster.scheduler_plugins() if p.startswith("espnet3-runner-")]
    growth_workers = _rss(workers) - workers_before
    growth_driver = psutil.Process().memory_info().rss - driver_before
    print(f"580 shard tasks: worker RSS +{growth_workers / 2**20:.0f} MB, driver +{growth_driver / 2**20:.0f} MB")
    assert growth_workers < 300 * 2**20 and growth_driver < 300 * 2**20  # generous; benchmarks/ hold the targets

    runs_before = len(runs_writing("collect-stats-shards", tmp_path / "out"))
    third = run_job("collect_stats", cfg, progress=False)["train"]
    assert (third["shards_computed"], third["shards_cached"]) == (0, 600)
    assert len(runs_writing("collect-stats-shards", tmp_path / "out")) == runs_before, "a no-op run started a flow"
    assert cluster.alive() and list(cluster.snapshot().values()) == workers

