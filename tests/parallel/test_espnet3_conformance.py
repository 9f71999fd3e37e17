"""ESPnet3's own tests as our conformance spec: one test per public behaviour that ESPnet3's
``test/espnet3/parallel/`` tests check (``test_base_runner_batch.py``, ``test_parallel.py``,
``test_inference_provider.py``, ``test_inference_runner.py``), in our words and fixtures, each naming
the ESPnet3 test it mirrors. Where we differ on purpose the test states what we do instead; the
table in ``docs/espnet3-conformance.md`` lists every ESPnet3 test, this file's counterpart, or the
existing test that already checks it. Collect-stats: ``test_espnet3_collect_stats.py``."""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel import ShardFailure, set_parallel
from espnet3_flows.parallel.base_runner import DONE, PLAN
from espnet3_flows.parallel.inference_provider import InferenceProvider
from espnet3_flows.parallel.parallel import (
    DictReturnWorkerPlugin,
    GpuClusterError,
    build_local_gpu_cluster,
    get_client,
    get_parallel_config,
    parallel_for,
    parallel_map,
)
from tests.parallel.espnet3_runners import (
    CallLogProvider,
    EnvEchoRunner,
    ForwardEnvProvider,
    RecordsFileRunner,
    logged_calls,
)

LOCAL2 = {"env": "local", "n_workers": 2}


@pytest.fixture(autouse=True)
def no_parallel_config():
    """ESPnet3's tests reset the process-wide config around each test (its private global); ours is
    ``set_parallel(None)``."""
    set_parallel(None)
    yield
    set_parallel(None)


def _runner(tmp_path: Path, n: int = 8, marker: Path | None = None, **kwargs) -> RecordsFileRunner:
    config = {"n": n, "log": str(tmp_path / "calls.log"), "fail_marker": str(marker) if marker else None}
    kwargs.setdefault("output_dir", str(tmp_path / "out"))
    return RecordsFileRunner(CallLogProvider(config), **kwargs)


def _calls(tmp_path: Path) -> list[tuple[int, object]]:
    return logged_calls(tmp_path / "calls.log")


def _plan(root: Path) -> list[dict]:
    return json.loads((root / PLAN).read_text())["shards"]


def _shard_items(shard: dict, items: list) -> list:
    """A planned shard's items: as the plan keeps them, or its ``start:stop`` slice of ``items``."""
    return shard["indices"] if "indices" in shard else items[shard["start"]:shard["stop"]]


def _shard_dir(root: Path, shard: dict) -> Path:
    return root / f"split.{shard['hash'][:16]}"


# ---- test_base_runner_batch.py ---------------------------------------------------------------------
def test_batch_size_lists_and_single_items_reach_forward_in_order(tmp_path):
    """Mirrors ``test_batch_size_chunks_indices``, ``test_forward_used_when_batch_size_set`` and
    ``test_forward_used_when_batch_size_is_none``: ``forward`` (env keys keyword-only) gets lists of
    ``batch_size`` items, the last one shorter, or single items; ``merge`` reads the writers' files in
    order; with no parallel config it all runs in this process (ESPnet3's ``_run_local``).
    Deliberate difference: ESPnet3 cuts the batches first and shards them; here shards are cut
    first and batched, so with several shards a batch may end short at a shard's end (a batch
    never spans shards in either)."""
    batched = _runner(tmp_path / "b", n=5, batch_size=2)(range(5))
    assert batched == {"records": [[0, 1], [2, 3], [4]]}
    assert _calls(tmp_path / "b") == [(os.getpid(), [0, 1]), (os.getpid(), [2, 3]), (os.getpid(), [4])]
    single = _runner(tmp_path / "s", n=3, batch_size=None)(range(3))
    assert single == {"records": [0, 1, 2]}
    assert _calls(tmp_path / "s") == [(os.getpid(), 0), (os.getpid(), 1), (os.getpid(), 2)]
    sharded = _runner(tmp_path / "m", n=20, batch_size=3, shard_size=4)(range(20))["records"]
    assert [i for batch in sharded for i in batch] == list(range(20)) and all(1 <= len(b) <= 3 for b in sharded)
    root = tmp_path / "m" / "out"
    shard_items = [_shard_items(s, list(range(20))) for s in _plan(root)]
    assert len(shard_items) > 1
    assert all(any(set(batch) <= set(items) for items in shard_items) for batch in sharded)


@pytest.mark.parametrize("bad", [0, -2])
def test_a_batch_size_below_one_is_refused(tmp_path, bad):
    """Mirrors ``test_batch_size_rejects_non_positive``: a ``ValueError`` saying "batch_size must be a
    positive integer". Deliberate difference: raised by the constructor, not by ``runner(indices)``."""
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        _runner(tmp_path, batch_size=bad)


def test_a_rerun_skips_done_shards_and_leaves_manifest_and_done_markers(tmp_path):
    """Mirrors ``test_resume_skips_completed_shards`` and ``test_resume_reuses_manifest_shard_plan``: a
    second runner over the same items computes nothing and returns the same value; ``manifest.json``
    and every shard's ``done`` are under ``output_dir/shard_subdir``. Deliberate difference: shard
    directories are ``split.<16 hex digits of the shard's content hash>``, not ``split.<shard_id>``."""
    first = _runner(tmp_path, n=4, batch_size=2, shard_subdir="resume")(range(4))
    again = _runner(tmp_path, n=4, batch_size=2, shard_subdir="resume")(range(4))
    assert first == again == {"records": [[0, 1], [2, 3]]}
    assert [item for _, item in _calls(tmp_path)] == [[0, 1], [2, 3]]  # forward ran once per batch, in all
    root = tmp_path / "out" / "resume"
    shards = _plan(root)
    assert shards and all((_shard_dir(root, s) / DONE).is_file() for s in shards)
    assert sorted(p.name for p in root.glob("split.*")) == sorted(_shard_dir(root, s).name for s in shards)


def test_only_a_shard_without_its_done_marker_is_computed_again(tmp_path):
    """Mirrors ``test_resume_reruns_only_incomplete_shards``: after a shard's ``done`` is removed, a
    rerun computes exactly that shard's items and merges the same result."""
    first = _runner(tmp_path, n=12, shard_size=3)(range(12))
    root = tmp_path / "out"
    shards = _plan(root)
    assert len(shards) >= 3
    victim = shards[len(shards) // 2]
    (_shard_dir(root, victim) / DONE).unlink()
    before = len(_calls(tmp_path))
    again = _runner(tmp_path, n=12, shard_size=3)(range(12))
    assert again == first == {"records": list(range(12))}
    assert [item for _, item in _calls(tmp_path)[before:]] == _shard_items(victim, list(range(12)))


def test_a_changed_shard_plan_recomputes_instead_of_refusing(tmp_path):
    """Mirrors ``test_resume_raises_when_shard_count_changes`` and
    ``test_resume_raises_when_shard_plan_changes``. Deliberate difference: ESPnet3 refuses to resume
    (``RuntimeError``) when the shard count or the items per shard changed; here the shards are
    content addressed, so a new plan computes the shards it does not find done and merges
    correctly, in the same ``output_dir``."""
    assert _runner(tmp_path, n=10, shard_size=2)(range(10)) == {"records": list(range(10))}
    assert _runner(tmp_path, n=10, shard_size=5)(range(10)) == {"records": list(range(10))}
    assert _runner(tmp_path, n=10, shard_size=5)([3, 1, 2]) == {"records": [3, 1, 2]}


def test_a_changed_fingerprint_recomputes_instead_of_refusing(tmp_path):
    """Mirrors ``test_resume_accepts_same_fingerprint``, ``test_resume_rejects_fingerprint_mismatch``,
    ``test_resume_rejects_manifest_without_fingerprint`` and ``test_resume_false_bypasses_fingerprint_check``
    (ESPnet3's author's branch). Same fingerprint: nothing recomputed. Deliberate difference: a
    changed fingerprint (or a ``manifest.json`` ESPnet3 wrote) is not an error: the fingerprint is
    hashed into every shard, so the changed run computes all of its shards; the earlier run's
    shards stay, ``done`` included, under their own names."""
    root = tmp_path / "out" / "fp"
    root.mkdir(parents=True)
    (root / PLAN).write_text(json.dumps({"version": 1, "output_dir": str(tmp_path), "shard_subdir": "fp",
                                         "shards": [{"shard_id": 0, "items": [[0, 1], [2, 3]]}]}))

    def run(fingerprint, **kwargs):
        return _runner(tmp_path, n=4, batch_size=2, shard_subdir="fp", fingerprint=fingerprint, **kwargs)

    a = run({"sha256": "a"}).run(range(4), progress=False)
    assert a.merged == {"records": [[0, 1], [2, 3]]} and a.computed == len(a.plan.shards)
    assert run({"sha256": "a"}).run(range(4), progress=False).computed == 0
    b = run({"sha256": "b"}).run(range(4), progress=False)
    assert b.merged == a.merged and b.computed == len(b.plan.shards)
    assert {s.name for s in a.plan.shards}.isdisjoint(s.name for s in b.plan.shards)
    assert all((root / s.name / DONE).is_file() for s in a.plan.shards)
    forced = run({"sha256": "b"}, resume=False).run(range(4), progress=False)
    assert forced.computed == len(forced.plan.shards) and forced.merged == a.merged


def test_stale_lock_files_never_block_and_a_failed_shard_leaves_none(tmp_path):
    """Mirrors ``test_resume_raises_for_locked_shard``, ``test_parallel_config_can_replace_stale_lock``
    and ``test_failed_shard_releases_lock``. A failing ``forward`` raises a ``RuntimeError`` naming
    the error; its shard has no ``done`` and nothing is left locked; once fixed, a rerun computes it
    (and, as ESPnet3's in-process run stops at the failure, the shards not reached), no other.
    Deliberate difference: there are no lock files (shards are staged and published atomically), so
    a ``lock`` file from ESPnet3 is ignored and ``allow_overwrite_lock`` is accepted with no effect."""
    set_parallel({"env": "serial", "allow_overwrite_lock": True})
    assert get_parallel_config().allow_overwrite_lock is True
    marker = tmp_path / "fail"
    marker.write_text("2\n")
    stale = tmp_path / "out" / "locked" / "split.0"
    stale.mkdir(parents=True)
    (stale / "lock").write_text("123\n")
    with pytest.raises(RuntimeError, match="boom on 2") as err:
        _runner(tmp_path, n=6, marker=marker, shard_subdir="locked", shard_size=1)(range(6))
    assert isinstance(err.value, ShardFailure)
    root = tmp_path / "out" / "locked"
    failed = [s for s in _plan(root) if 2 in _shard_items(s, list(range(6)))]
    assert len(failed) == 1 and not (_shard_dir(root, failed[0]) / DONE).exists()
    assert [p.relative_to(root).as_posix() for p in root.rglob("lock")] == ["split.0/lock"]  # only ESPnet3's
    undone = [i for s in _plan(root) if not (_shard_dir(root, s) / DONE).exists()
              for i in _shard_items(s, list(range(6)))]  # the failed shard and any not reached (serial stops)
    marker.unlink()
    before = len(_calls(tmp_path))
    fixed = _runner(tmp_path, n=6, shard_subdir="locked", shard_size=1)(range(6))
    assert fixed == {"records": list(range(6))}
    assert [item for _, item in _calls(tmp_path)[before:]] == undone and undone[0] == 2


@pytest.mark.dask
def test_local_with_n_workers_runs_the_shards_on_a_local_cluster(tmp_path):
    """Mirrors ``test_local_config_uses_workers_and_dask_dispatch`` and
    ``test_run_parallel_dask_dispatches_multiple_shards``: with ``set_parallel({"env": "local",
    "n_workers": 2})`` the shards run on a 2-worker ``LocalCluster`` started for the call, and the
    merged result keeps the input order. Deliberate difference: shards are content-defined (the
    plan, ``manifest.json``, says how many), not exactly ``n_workers`` contiguous ones."""
    set_parallel(LOCAL2)
    merged = _runner(tmp_path, n=10, shard_size=2)(range(10))
    assert merged == {"records": list(range(10))}
    calls = _calls(tmp_path)
    pids = {pid for pid, _ in calls}
    assert sorted(item for _, item in calls) == list(range(10))
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    root = tmp_path / "out"
    shards = _plan(root)
    assert len(shards) >= 2 and all((_shard_dir(root, s) / DONE).is_file() for s in shards)


@pytest.mark.dask
def test_a_failing_forward_on_a_worker_raises_and_leaves_no_lock_or_done(tmp_path):
    """Mirrors ``test_run_parallel_dask_cancels_pending_futures_on_worker_exception``: an exception of
    ``forward`` on a Dask worker reaches the caller (a ``RuntimeError`` naming it) instead of hanging,
    with ``resume=False``; the failing shard has no ``done`` and there is no ``lock`` file."""
    set_parallel(LOCAL2)
    marker = tmp_path / "fail"
    marker.write_text("2\n")
    with pytest.raises(RuntimeError, match="boom on 2"):
        _runner(tmp_path, n=4, marker=marker, resume=False, shard_size=1)(range(4))
    root = tmp_path / "out"
    failed = [s for s in _plan(root) if 2 in _shard_items(s, list(range(4)))]
    assert len(failed) == 1 and not (_shard_dir(root, failed[0]) / DONE).exists()
    assert not list(root.rglob("lock"))


# ---- test_inference_runner.py -----------------------------------------------------------------------
class NumbersInference(InferenceProvider):
    """``dataset``: ``config.n`` numbers, ``model``: doubles them; counts its builds (this process)."""

    builds = {"dataset": 0, "model": 0}

    @staticmethod
    def build_dataset(config):
        NumbersInference.builds["dataset"] += 1
        return list(range(config.n))

    @staticmethod
    def build_model(config):
        NumbersInference.builds["model"] += 1
        return lambda x: 2 * x


def test_a_forward_only_runner_on_an_inference_provider_sees_params_in_env():
    """Mirrors ``test_offline_on_example`` and ``test_streaming_on_example``: ``Runner(provider)`` with
    only ``forward``, ``runner([i])[0]`` is ``forward``'s value, and the provider's ``params`` (there
    ``stream``, ``chunk_sec``) reach ``forward``'s ``**env``. Deliberate difference: no ``output_dir``
    is needed (the run uses a temporary one) and the default ``merge`` returns the records."""
    provider = NumbersInference(OmegaConf.create({"n": 5}), params={"stream": True, "chunk_sec": 0.1})
    out = EnvEchoRunner(provider)([3, 4])
    assert out == [{"y": 6, "extra": {"chunk_sec": 0.1, "stream": True}},
                   {"y": 8, "extra": {"chunk_sec": 0.1, "stream": True}}]
    plain = EnvEchoRunner(ForwardEnvProvider({"n": 2}, params={"n_fft": 512}))([1])
    assert plain == [{"y": 2, "extra": {"n_fft": 512}}]


# ---- test_inference_provider.py ---------------------------------------------------------------------
def test_inference_provider_local_env_is_built_once_and_handed_out_as_copies():
    """Mirrors ``test_build_env_local_uses_cached_env_and_params``: ``dataset``, ``model`` and the
    params; built once; changing the dict returned changes nothing kept. Deliberate difference: it
    is built on the first ``build_env_local()``, not in the constructor."""
    NumbersInference.builds = {"dataset": 0, "model": 0}
    provider = NumbersInference(OmegaConf.create({"n": 3}), params={"flag": True})
    assert NumbersInference.builds == {"dataset": 0, "model": 0}
    env = provider.build_env_local()
    assert env["dataset"] == [0, 1, 2] and env["model"](4) == 8 and env["flag"] is True
    env["dataset"] = "mutated"
    assert provider.build_env_local()["dataset"] == [0, 1, 2]
    assert NumbersInference.builds == {"dataset": 1, "model": 1}


def test_inference_provider_setup_fn_rebuilds_per_call_with_a_params_snapshot():
    """Mirrors ``test_build_worker_setup_fn_rebuilds_env_and_captures_params``: each call of the setup
    function builds a new env; ``params`` are those of when it was made. Ours also: the function
    pickles without the provider or an env built here."""
    NumbersInference.builds = {"dataset": 0, "model": 0}
    provider = NumbersInference(OmegaConf.create({"n": 2}), params={"token": "v1"})
    provider.build_env_local()
    setup = provider.build_worker_setup_fn()
    provider.params["token"] = "v2"
    env1, env2 = setup(), setup()
    assert env1["token"] == env2["token"] == "v1"
    assert env1["dataset"] is not env2["dataset"] and env1["model"] is not env2["model"]
    assert NumbersInference.builds == {"dataset": 3, "model": 3}
    assert pickle.loads(pickle.dumps(setup))()["token"] == "v1"
    assert pickle.loads(pickle.dumps(provider))._local_resources is None


# ---- test_parallel.py -------------------------------------------------------------------------------
def test_set_parallel_keeps_a_copy_of_the_config():
    """Mirrors ``test_set_parallel_copies_options_dict`` and ``test_set_and_get_parallel_config``: an
    OmegaConf ``parallel`` node is read into the process-wide config; changing the node afterwards
    changes nothing."""
    cfg = OmegaConf.create({"env": "local", "n_workers": 2, "options": {"threads_per_worker": 1, "processes": True}})
    set_parallel(cfg)
    cfg.options.threads_per_worker = 999
    got = get_parallel_config()
    assert got.env == "local" and got.n_workers == 2 and got.options["threads_per_worker"] == 1


def _setup_bias():
    return {"bias": 10, "unknown": "ignored"}


def _add_default_bias(x, bias=-1):
    return x + bias


@pytest.mark.dask
def test_get_client_without_arguments_uses_set_parallels_config_and_its_env():
    """Mirrors ``test_get_client_context_manager_and_parallel_map``, ``test_worker_env_injection_via_setup_fn``,
    ``test_parallel_for_auto_inject_env_via_setup_fn_without_with`` and
    ``test_worker_env_conflict_detection_parallel_for``: ``get_client()`` with no config uses
    ``set_parallel``'s; its ``setup_fn`` env overrides a parameter's default; entered and exited by
    hand; a key given both as a keyword and by the env is a ``ValueError`` naming it, from
    ``parallel_for`` too; the client and its cluster are closed on exit."""
    set_parallel(LOCAL2)
    ctx = get_client(setup_fn=_setup_bias)
    client = ctx.__enter__()
    try:
        assert len(client.scheduler_info()["workers"]) == 2
        assert parallel_map(_add_default_bias, [1, 2, 3], client=client) == [11, 12, 13]
        with pytest.raises(ValueError, match=r"\bbias\b"):
            list(parallel_for(_add_default_bias, [1, 2], client=client, bias=5))
    finally:
        ctx.__exit__(None, None, None)
    assert client.status == "closed" and client.cluster.status.name == "closed"


def test_dict_return_worker_plugin_refuses_a_setup_fn_that_returns_no_dict():
    """Mirrors ``test_worker_plugin_setup_must_return_dict``: ESPnet3's name for the plugin that runs a
    ``setup_fn`` once per worker; a ``ValueError`` saying it must return a dict."""
    plugin = DictReturnWorkerPlugin(setup_fn=lambda: 123)
    with pytest.raises(ValueError, match="must return a dict"):
        plugin.setup(types.SimpleNamespace(plugins={}))


def test_build_local_gpu_cluster_without_dask_cuda_names_the_install():
    """Mirrors ``test_build_local_gpu_cluster_import_guard``: without dask-cuda, a ``RuntimeError`` (ours
    is also a ``ConfigError``) that names what to install."""
    if "dask_cuda" in sys.modules or __import__("importlib").util.find_spec("dask_cuda") is not None:
        pytest.skip("dask_cuda is installed")
    with pytest.raises(RuntimeError, match="dask_cuda") as err:
        build_local_gpu_cluster(n_workers=1, options={})
    assert isinstance(err.value, (GpuClusterError, ConfigError)) and "espnet3-flows[gpu]" in str(err.value)


@pytest.fixture
def stand_in_dask_cuda(monkeypatch):
    """A ``dask_cuda`` module whose ``LocalCUDACluster`` is ``distributed.LocalCluster``, and 2 visible
    GPUs: ESPnet3's documented checks of ``build_local_gpu_cluster`` on a machine without either."""
    import importlib.machinery

    from distributed import LocalCluster

    module = types.ModuleType("dask_cuda")
    module.__spec__ = importlib.machinery.ModuleSpec("dask_cuda", None)
    module.LocalCUDACluster = LocalCluster
    monkeypatch.setitem(sys.modules, "dask_cuda", module)
    monkeypatch.setattr("espnet3_flows.parallel.parallel.visible_gpu_count", lambda: 2)


@pytest.mark.parametrize("bad", [3, -1, 1.5, True])
def test_build_local_gpu_cluster_refuses_more_workers_than_gpus(stand_in_dask_cuda, bad):
    """ESPnet3's ``build_local_gpu_cluster`` documentation: ``n_workers`` above the visible GPUs is a
    ``ValueError`` (before any cluster starts); so is a negative or non-int one (ours)."""
    with pytest.raises(ValueError, match="n_workers"):
        build_local_gpu_cluster(bad, {})


@pytest.mark.dask
def test_build_local_gpu_cluster_warns_when_gpus_stay_idle(stand_in_dask_cuda):
    """ESPnet3's ``build_local_gpu_cluster`` documentation: fewer workers than GPUs warns and returns a
    client on the ``LocalCUDACluster`` (here the stand-in), through ``parallel.env: local_gpu``'s path."""
    with pytest.warns(UserWarning, match="n_workers=1 < num_gpus=2"):
        client = build_local_gpu_cluster(1, {"threads_per_worker": 1})
    try:
        client.wait_for_workers(1, timeout=120)
        assert len(client.scheduler_info()["workers"]) == 1
        assert client.submit(_add_default_bias, 1, bias=1).result() == 2
    finally:
        client.close()
        client.cluster.close()


@pytest.mark.gpu
@pytest.mark.dask
def test_build_local_gpu_cluster_gives_each_worker_its_own_gpu():
    """ESPnet3's ``build_local_gpu_cluster`` on real GPUs (``--run-gpu``): one worker per GPU, each
    seeing its own GPU first in ``CUDA_VISIBLE_DEVICES``; all GPUs: no warning."""
    import torch

    n = torch.cuda.device_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        client = build_local_gpu_cluster(n, {})
    try:
        client.wait_for_workers(n, timeout=120)
        visible = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        assert sorted(v.split(",")[0] for v in visible.values()) == [str(i) for i in range(n)], visible
    finally:
        client.close()
        client.cluster.close()
    with pytest.raises(ValueError, match=f"n_workers={n + 1} > num_gpus={n}"):
        build_local_gpu_cluster(n + 1, {})
