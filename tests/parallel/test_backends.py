"""Cluster backends as a registry: every env one declaration, a new one one registration,
``cluster_class`` running a factory defined here, ``ssh`` end to end against a real sshd on the
loopback (engine, CLI and Prefect flow), ``kube`` as far as this machine allows (the resource
dask-kubernetes would submit; one error line without a Kubernetes API), and no Dask config or
environment left in the process after our clusters."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.job_config import EngineConfig
from espnet3_flows.parallel import backends
from espnet3_flows.parallel.backends import BUILTIN_ENVS, Backend, ScaledBackend, get_backend, register_backend
from espnet3_flows.parallel.backends.jobqueue import BatchJobs
from espnet3_flows.parallel.backends.cluster_setup import check_workers_import
from espnet3_flows.parallel.cluster import cluster_spec, make_cluster, with_worker_environ
from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.parallel.parallel_settings import ParallelSettings
from espnet3_flows.parallel.parallel import get_client, parallel_map
from tests.parallel.jobs_for_tests import ArrayProvider, ScaleSumRunner
from tests.support.servers import SshServer, cli_env

ROOT = Path(__file__).resolve().parents[2]
N = 24
EXPECTED = {"sum": 1.5 * sum(range(N)), "n": N}


def tiny_cluster(n_workers: int = 1, threads: int = 1):
    """A site's own cluster factory (``parallel.cluster_class`` calls it with n_workers and options)."""
    from distributed import LocalCluster

    return LocalCluster(n_workers=n_workers, threads_per_worker=threads, processes=True, dashboard_address=":0")


def _double(x):
    return 2 * x


def test_every_builtin_env_is_one_declaration_and_an_unknown_one_names_them():
    assert set(BUILTIN_ENVS) == {"serial", "local", "local_gpu", "slurm", "pbs", "sge", "lsf", "htcondor", "oar",
                                 "moab", "ssh", "kube", "address"}
    kinds = {e: type(get_backend(e)) for e in BUILTIN_ENVS}
    assert {e for e, k in kinds.items() if k is BatchJobs} == {"slurm", "pbs", "sge", "lsf", "htcondor", "oar", "moab"}
    # the two run modes are not cluster backends: nothing to build, and they say so
    assert [e for e in BUILTIN_ENVS if not isinstance(get_backend(e), Backend)] == ["serial", "address"]
    for env in ("serial", "address"):
        with pytest.raises(ConfigError, match=f"parallel.env={env}: no cluster to build"):
            cluster_spec(ParallelConfig(env=env, options={"address": "tcp://127.0.0.1:1"} if env == "address" else {}))
    with pytest.raises(ConfigError, match="unknown cluster backend 'kubernetes'") as err:
        ParallelConfig(env="kubernetes")
    assert all(e in str(err.value) for e in BUILTIN_ENVS)


def test_the_settings_placements_read_are_the_config_fields():
    """Placements type against :class:`ParallelSettings`, a protocol of the config's fields: the two
    lists stay the same (a new ``parallel:`` key is added to both)."""
    import dataclasses
    import typing

    fields = [f.name for f in dataclasses.fields(ParallelConfig)]
    config_hints = typing.get_type_hints(ParallelConfig)
    assert typing.get_type_hints(ParallelSettings) == {name: config_hints[name] for name in fields}
    assert list(ParallelSettings.__annotations__) == fields


def test_every_placement_gives_its_own_client_and_task_runner(tmp_path):
    """The engine's client and the flows' task runner come from the placement itself, the same
    cluster for both: a run mode says what it has (a running scheduler's address, read from its
    file when the run starts) or, in one line, what it has not; callers never ask which env it is."""
    serial = ParallelConfig(env="serial")
    for method in ("connect", "dask_runner_options", "spec", "scheduler_address"):
        with pytest.raises(ConfigError, match="parallel.env=serial"):
            getattr(serial.backend, method)(serial)
    assert not serial.backend.uses_workers and not serial.backend.leaves_running and not serial.backend.owns_cluster

    info = tmp_path / "scheduler.json"
    info.write_text(json.dumps({"address": "tcp://10.0.0.5:8786"}))
    running = ParallelConfig(env="address", options={"scheduler_file": str(info)})
    assert running.backend.dask_runner_options(running) == {"address": "tcp://10.0.0.5:8786"}
    info.write_text(json.dumps({"address": "tcp://10.0.0.6:8786"}))  # the scheduler restarted elsewhere
    assert running.backend.scheduler_address(running) == "tcp://10.0.0.6:8786"
    assert running.backend.leaves_running and running.backend.uses_workers and not running.backend.owns_cluster
    with pytest.raises(ConfigError, match="parallel.env=address: no cluster to build"):
        running.backend.spec(running)

    local = ParallelConfig(env="local", n_workers=2)
    for env in set(BUILTIN_ENVS) - {"serial", "address"}:  # (some need packages this machine lacks to be configured)
        backend = get_backend(env)
        assert backend.owns_cluster and backend.uses_workers and not backend.leaves_running, env
        with pytest.raises(ConfigError, match=f"parallel.env={env} has no running scheduler"):
            backend.scheduler_address(local)
    options = local.backend.dask_runner_options(local)
    assert options["cluster_kwargs"] == {"cfg": local} and options["cluster_class"] == local.backend.make_cluster
    with pytest.raises(ConfigError, match="parallel.options.n_wrkers"):  # checked when the runner is made
        bad = ParallelConfig(env="local")
        bad.options["n_wrkers"] = 2
        bad.backend.dask_runner_options(bad)


def test_every_builtin_env_is_a_class_in_a_module_of_its_own():
    modules = {env: type(get_backend(env)).__module__.rpartition(".")[2] for env in BUILTIN_ENVS}
    # one module per kind (the seven dask-jobqueue schedulers share theirs)
    assert modules == {**{e: e for e in ("serial", "local", "local_gpu", "ssh", "kube", "address")},
                       **{e: "jobqueue" for e in ("slurm", "pbs", "sge", "lsf", "htcondor", "oar", "moab")}}
    # a class per module: what differs between them is in its methods
    assert len({type(get_backend(e)) for e in BUILTIN_ENVS}) == len(set(modules.values())) == 7


@pytest.mark.dask
def test_a_scaled_backend_starts_empty_and_scales(tmp_path):
    """A subclass that overrides only how n_workers becomes workers: constructed without workers,
    then ``cluster.scale(n)`` (or ``adapt``), as the dask-jobqueue backends are."""
    register_backend(ScaledBackend("tiny_scaled", "tests.parallel.test_backends.tiny_cluster"))
    try:
        cfg = ParallelConfig(env="tiny_scaled", n_workers=2, options={"n_workers": 0})
        spec = cluster_spec(cfg)
        assert (spec.kwargs, spec.n_workers, spec.adapt) == ({"n_workers": 0}, 2, {})
        assert spec.describe().endswith(", scaled to 2 worker(s)")
        cluster = make_cluster(cfg)
        try:
            deadline = time.monotonic() + 60
            while len(cluster.scheduler_info["workers"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(cluster.scheduler_info["workers"]) == 2
        finally:
            cluster.close()
        adaptive = cluster_spec(ParallelConfig(env="tiny_scaled", adapt={"minimum": 0, "maximum": 3}))
        assert adaptive.n_workers == 0 and adaptive.adapt == {"minimum": 0, "maximum": 3}
    finally:
        backends.BACKENDS.unregister("tiny_scaled")


def test_every_builtin_env_is_documented_in_the_generated_table():
    from espnet3_flows.config_docs import backends_table

    table = backends_table()
    for env in BUILTIN_ENVS:
        assert get_backend(env).doc.endswith("."), env
        assert f"| `{env}` | {get_backend(env).doc.replace('``', '`')} |" in table


def test_ssh_and_kube_options_are_checked_when_the_config_is():
    with pytest.raises(ConfigError, match="needs parallel.options.hosts"):
        ParallelConfig(env="ssh")
    with pytest.raises(ConfigError, match="at least two host names"):
        ParallelConfig(env="ssh", options={"hosts": ["onlyone"]})
    with pytest.raises(ConfigError, match="did you mean 'connect_options'"):
        ParallelConfig(env="ssh", options={"hosts": ["a", "b"], "conect_options": {}})
    with pytest.raises(ConfigError, match="did you mean 'image'"):
        ParallelConfig(env="kube", options={"imagee": "x"})
    spec = cluster_spec(ParallelConfig(env="ssh", n_workers=3, options={"hosts": ["a", "b"], "worker_options": {"nthreads": 1}}))
    assert spec.kwargs["worker_options"] == {"nthreads": 1, "n_workers": 3}  # processes per host
    assert spec.kwargs["remote_python"] == sys.executable and "jobqueue" not in spec.describe()


@pytest.mark.dask
def test_a_new_backend_is_one_registration(tmp_path):
    register_backend(Backend("tiny", "tests.parallel.test_backends.tiny_cluster"))
    try:
        cfg = ParallelConfig(env="tiny", n_workers=2, options={"threads": 1})
        assert cluster_spec(cfg).kwargs == {"threads": 1, "n_workers": 2}
        out = ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path), shard_size=4).run(
            range(N), parallel=cfg, progress=False)
        assert out.merged == EXPECTED
        with pytest.raises(ConfigError, match="not an option of tests.parallel.test_backends.tiny_cluster"):
            ParallelConfig(env="tiny", options={"thread": 2})
        register_backend(Backend("needs-missing", "json.dumps", requires="not_a_module_here", extra="nothing"))
        with pytest.raises(ConfigError, match=r"needs not_a_module_here.*pip install 'espnet3-flows\[nothing\]'"):
            ParallelConfig(env="needs-missing")
    finally:
        backends.BACKENDS.unregister("tiny")
        backends.BACKENDS.unregister("needs-missing")


@pytest.mark.dask
@pytest.mark.prefect
def test_cluster_class_runs_a_factory_defined_here(tmp_path, prefect_harness):
    from espnet3_flows.orchestration import runner_flow

    cfg = {"env": "tests.parallel.test_backends.tiny_cluster", "n_workers": 2, "options": {"threads": 1}}
    engine = ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path / "engine"), shard_size=4)
    assert engine.run(range(N), parallel=cfg, progress=False).merged == EXPECTED
    old = {"cluster_class": "tests.parallel.test_backends.tiny_cluster", "n_workers": 2, "options": {"threads": 1}}
    flow = ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path / "flow"), shard_size=4)
    assert runner_flow(flow, range(N), parallel=old, progress=False) == EXPECTED  # its old spelling
    with pytest.raises(ConfigError, match="parallel.env and parallel.cluster_class are the same key"):
        load_config(EngineConfig, base={"parallel": {"env": "slurm", "cluster_class": old["cluster_class"]}})
    with pytest.raises(ConfigError, match="parallel.env=no_such_site.Cluster needs no_such_site, which is not"):
        ParallelConfig(env="no_such_site.Cluster")


def _dask_config() -> dict:
    """This process's Dask config, less the scheduler's HTTP routes: Dask appends a route there
    each time any scheduler starts without bokeh (its own, for every cluster)."""
    import dask

    config = copy.deepcopy(dask.config.config)
    config["distributed"]["scheduler"].get("http", {}).pop("routes", None)
    return config


@pytest.mark.dask
def test_our_clusters_leave_no_dask_config_or_environment_behind(tmp_path):
    import dask
    from distributed import Client, LocalCluster

    # Dask itself changes the process on a cluster's first start (its nannies export thread limits
    # and a hash seed, its scheduler notes a missing bokeh): a plain cluster first, to compare
    # with what Dask does on its own
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0"):
        pass
    config, environ = _dask_config(), dict(os.environ)
    cfg = ParallelConfig(env="local", n_workers=1, allowed_failures=7)
    with get_client(cfg) as client:
        assert client.cluster.scheduler.allowed_failures == 7
        assert parallel_map(_double, [1, 2], client=client) == [2, 4]
    ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path), shard_size=4).run(range(N), parallel=cfg,
                                                                                     progress=False)
    assert _dask_config() == config
    assert dict(os.environ) == environ
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as plain, Client(plain) as client:
        assert plain.scheduler.allowed_failures == dask.config.get("distributed.scheduler.allowed-failures") == 3
        client.wait_for_workers(1)
        streams = list(plain.scheduler.stream_comms.values())
        assert streams and all(s.recent_message_log.maxlen == 1000 for s in streams)  # Dask's own
        assert client.submit(os.environ.get, "MALLOC_TRIM_THRESHOLD_", pure=False).result() == "65536"


@pytest.mark.dask
def test_a_worker_without_the_project_is_named():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        check_workers_import(client)  # this project is there
        (address,) = client.scheduler_info()["workers"]
        with pytest.raises(ConfigError, match="espnet3_flows_elsewhere cannot be imported on host") as err:
            check_workers_import(client, "espnet3_flows_elsewhere")
        assert address in str(err.value) and "remote_python" in str(err.value)


class _OldHookBackend(Backend):
    """A plugin written before the hook was renamed: it overrides ``with_worker_env``."""

    def with_worker_env(self, cfg, variables):
        import dataclasses

        return dataclasses.replace(cfg, n_workers=len(variables))  # what it was told, where the test can see it


def test_a_plugin_overriding_the_hook_s_earlier_name_is_still_asked():
    old = _OldHookBackend("old_hook", "tests.parallel.test_backends.tiny_cluster")
    register_backend(old)
    try:
        cfg = ParallelConfig(env="old_hook")
        assert with_worker_environ(cfg, {"A": "1", "B": "2"}).n_workers == 2
        assert with_worker_environ(ParallelConfig(env="slurm"), {"A": "1"}) == ParallelConfig(env="slurm")
    finally:
        backends.BACKENDS.unregister("old_hook")


# ---- kube: what can be checked without a Kubernetes API -------------------------------------
def test_kube_resource_carries_our_image_command_env_and_resources():
    from espnet3_flows.parallel.kube import WORKER_COMMAND, kube_cluster_spec

    resources = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "6Gi"}}
    cfg = ParallelConfig(env="kube", n_workers=3, options={"image": "registry.lab/espnet3-flows:0.1.0",
                                                           "resources": resources, "env": {"AWS_REGION": "eu"}})
    spec = cluster_spec(with_worker_environ(cfg, {"PREFECT_API_URL": "http://prefect.lab/api"}))
    kwargs = {k: spec.kwargs[k] for k in ("image", "n_workers", "resources", "env")}
    resource = kube_cluster_spec(**kwargs)  # dask-kubernetes' own make_cluster_spec
    assert resource["kind"] == "DaskCluster" and resource["spec"]["worker"]["replicas"] == 3
    for role in ("worker", "scheduler"):
        (container,) = resource["spec"][role]["spec"]["containers"]
        assert container["image"] == "registry.lab/espnet3-flows:0.1.0"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["PREFECT_API_URL"] == "http://prefect.lab/api" and env["AWS_REGION"] == "eu"
        assert container["resources"] == resources
    (worker,) = resource["spec"]["worker"]["spec"]["containers"]
    assert worker["args"][:len(WORKER_COMMAND.split())] == WORKER_COMMAND.split()


def test_kube_without_a_kubernetes_api_is_one_error_line(tmp_path, demo_corpus, session_api_url):
    env = cli_env(tmp_path / "home", KUBECONFIG=str(tmp_path / "no-kubeconfig"), api_url=session_api_url)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.run([sys.executable, "flows/collect_stats.py", f"manifests.train={demo_corpus['valid']}",
                           f"output_dir={tmp_path / 'out'}", "parallel.env=kube"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Kubernetes API" in errors[0] and "KUBECONFIG" in errors[0], proc.stderr[-2000:]


# ---- ssh, against a real sshd on the loopback -------------------------------------------------
@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    with SshServer(tmp_path_factory.mktemp("sshd"), log_dir=tmp_path_factory.mktemp("sshd-logs")) as server:
        yield server


def _ssh_parallel(sshd: SshServer, **options) -> dict:
    return {"env": "ssh", "options": {"hosts": ["127.0.0.1", "localhost"], "connect_options": sshd.connect_options(),
                                      **options}}


def _dask_processes(wait: float = 20.0) -> list[psutil.Process]:
    """The ssh cluster's remote processes still alive after ``wait`` seconds (they exit when their
    SSH session closes, a moment after the cluster does)."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if "distributed.cli.dask_spec" in " ".join(p.info["cmdline"] or [])]
    _, alive = psutil.wait_procs(procs, timeout=wait)
    return alive


@pytest.mark.dask
def test_ssh_engine_runs_on_the_hosts_and_leaves_nothing(sshd, tmp_path):
    # the runner comes from this checkout's tests: the remote interpreter gets it on its path
    par = _ssh_parallel(sshd, remote_python=f"PYTHONPATH={ROOT} {sys.executable}")
    out = ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path), shard_size=4).run(
        range(N), parallel=par, progress=False)
    assert out.merged == EXPECTED and out.computed == len(out.plan.shards)
    assert not _dask_processes(), "the ssh cluster's processes outlived the run"


@pytest.mark.dask
@pytest.mark.timeout(180)
def test_ssh_starts_when_the_users_dask_logs_only_warnings(sshd, tmp_path):
    """SSHCluster finds its remote scheduler and workers by their INFO lines ("Scheduler at",
    "Start worker at") and hands the remote processes this process's Dask config: with a user's
    ``logging.distributed: warning`` (or ``DASK_LOGGING__DISTRIBUTED=warning``) those lines never
    came and the run waited forever."""
    import dask

    par = _ssh_parallel(sshd, remote_python=f"PYTHONPATH={ROOT} {sys.executable}")
    with dask.config.set({"logging": {**dask.config.get("logging", {}), "distributed": "warning"}}):
        out = ScaleSumRunner(ArrayProvider({"n": N}), output_dir=str(tmp_path), shard_size=4).run(
            range(N), parallel=par, progress=False)
        assert dask.config.get("logging")["distributed"] == "warning"  # the user's own config, as it was
    assert out.merged == EXPECTED and out.computed == len(out.plan.shards)
    assert not _dask_processes(), "the ssh cluster's processes outlived the run"


def _npz(path: Path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def serial_stats(demo_corpus, tmp_path_factory) -> dict:
    from espnet3_flows.config import load_config
    from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner

    out = tmp_path_factory.mktemp("serial") / "out"
    cfg = load_config(CollectStatsConfig, base={"manifests": {"train": demo_corpus["train"]}, "output_dir": str(out),
                                                "shard_size": 12, "parallel": {"env": "serial"}})
    CollectStatsRunner(cfg, "train").run(progress=False)
    return _npz(out / "train" / "feats_stats.npz")


def _same_stats(got: dict, want: dict) -> None:
    assert int(got["count"]) == int(want["count"])
    np.testing.assert_allclose(got["sum"], want["sum"], rtol=1e-12)
    np.testing.assert_allclose(got["sum_square"], want["sum_square"], rtol=1e-12)


@pytest.mark.slow
def test_ssh_through_the_cli_with_a_config_file(sshd, demo_corpus, serial_stats, tmp_path, session_api_url):
    config = tmp_path / "stats_ssh.yaml"
    config.write_text(yaml.safe_dump({"manifests": {"train": demo_corpus["train"]}, "output_dir": str(tmp_path / "out"),
                                      "shard_size": 12, "parallel": _ssh_parallel(sshd)}))
    env = cli_env(tmp_path / "home", api_url=session_api_url)
    dry = subprocess.run([sys.executable, "flows/collect_stats.py", "--config", str(config), "--dry-run"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0 and "  cluster: ssh: distributed.SSHCluster(" in dry.stdout, dry.stdout + dry.stderr
    proc = subprocess.run([sys.executable, "flows/collect_stats.py", "--config", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _same_stats(_npz(tmp_path / "out" / "train" / "feats_stats.npz"), serial_stats)
    summary = json.loads((tmp_path / "out" / "train" / "summary.json").read_text())
    assert summary["shards_computed"] == summary["shards"] > 1
    assert not _dask_processes(), "the ssh cluster's processes outlived the CLI"


@pytest.mark.prefect
@pytest.mark.slow
def test_ssh_through_a_prefect_flow(sshd, demo_corpus, serial_stats, tmp_path, prefect_harness):
    from espnet3_flows.orchestration.flows import run_job

    cfg = {"manifests": {"train": demo_corpus["train"]}, "output_dir": str(tmp_path / "out"), "shard_size": 12,
           "parallel": _ssh_parallel(sshd)}
    summary = run_job("collect_stats", cfg, progress=False)["train"]
    assert summary["shards_computed"] == summary["shards"] > 1
    _same_stats(_npz(tmp_path / "out" / "train" / "feats_stats.npz"), serial_stats)
    assert not _dask_processes(), "the ssh cluster's processes outlived the flow"
