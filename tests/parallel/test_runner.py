"""BaseRunner over local, Dask, memory:// and S3 outputs: results, layout, resume, errors."""

from __future__ import annotations

import json

import pytest

from espnet3_flows.parallel import ProviderError, ShardFailure
from espnet3_flows.parallel.base_runner import DONE, PLAN
from espnet3_flows.storage import Storage
from tests.parallel.jobs_for_tests import ArrayProvider, DictReturningProvider, NeedsMissingKeyRunner, ScaleSumRunner

N = 53
EXPECTED = 3.0 * 0.5 * sum(range(N))


def _output(kind, request, tmp_path):
    if kind == "local-disk":
        return str(tmp_path / "out"), {}
    if kind == "memory":  # per-process: serial only (refused with Dask, see below)
        return f"memory://runner-{tmp_path.name}", {}
    return request.getfixturevalue("s3_output")


@pytest.mark.parametrize("where,kind", [
    ("serial", "local-disk"), ("serial", "memory"), pytest.param("serial", "s3", marks=pytest.mark.s3),
    pytest.param("dask", "local-disk", marks=pytest.mark.dask),
    pytest.param("dask", "s3", marks=[pytest.mark.dask, pytest.mark.s3])])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_runner_results_layout_and_resume(where, kind, batch_size, request, tmp_path):
    url, options = _output(kind, request, tmp_path)
    client = request.getfixturevalue("dask_client") if where == "dask" else None
    runner = ScaleSumRunner(ArrayProvider({"n": N}), batch_size=batch_size, output_dir=url, shard_subdir="job",
                            shard_size=10, storage_options=options)
    out = runner.run(range(N), client=client, progress=False)
    assert out.merged == {"sum": EXPECTED, "n": N}
    n_shards = len(out.plan.shards)  # content-defined: the plan decides how many
    assert n_shards > 1 and (out.computed, out.cached) == (n_shards, 0)
    store = Storage(url, options)
    plan = json.loads(store.read_bytes("job", PLAN))
    assert [s["index"] for s in plan["shards"]] == list(range(n_shards)) and plan["num_items"] == N
    assert [s["hash"] for s in plan["shards"]] == [s.hash for s in out.plan.shards]
    for shard in out.plan.shards:
        done = store.read_json("job", shard.name, DONE)
        assert done["shard_hash"] == shard.hash and done["num_items"] == shard.num_items
        assert done["files"] == [f"job/{shard.name}/values.txt"] and done["result"]["n"] == shard.num_items
        lines = store.read_bytes("job", shard.name, "values.txt").decode().splitlines()
        assert [int(line.split()[0]) for line in lines] == list(shard.items)
    again = runner.run(range(N), client=client, progress=False)
    assert (again.computed, again.cached) == (0, n_shards) and again.merged == out.merged


def test_appending_items_recomputes_only_new_shards(tmp_path):
    provider = ArrayProvider({"n": 100})
    runner = ScaleSumRunner(provider, output_dir=str(tmp_path), shard_size=10)
    first = runner.run(range(45), progress=False)
    n_first = len(first.plan.shards)
    assert n_first > 1 and first.computed == n_first
    grown = runner.run(range(70), progress=False)
    n_grown = len(grown.plan.shards)
    assert n_grown > n_first
    # content-defined shards: every shard the first run closed at a boundary is unchanged and
    # cached; the last one (ended by the input, not a boundary) grows, and the rest are new
    kept = n_first - 1
    assert [s.hash for s in grown.plan.shards[:kept]] == [s.hash for s in first.plan.shards[:kept]]
    assert [(s.start, s.stop) for s in grown.plan.shards[:kept]] == [
        (s.start, s.stop) for s in first.plan.shards[:kept]]
    last = first.plan.shards[-1]
    if grown.plan.shards[kept].stop == last.stop:  # 45 happened to be a boundary: that shard is kept too
        kept += 1
    else:
        assert grown.plan.shards[kept].start == last.start and grown.plan.shards[kept].stop > last.stop
    assert [s.cached for s in grown.shards] == [True] * kept + [False] * (n_grown - kept)
    assert grown.merged["n"] == 70


def test_forward_needs_key_the_env_lacks_fails_before_work(tmp_path):
    runner = NeedsMissingKeyRunner(ArrayProvider({"n": 5}), output_dir=str(tmp_path), shard_size=2)
    with pytest.raises(ProviderError) as err:
        runner.run(range(5), progress=False)
    msg = str(err.value)
    assert "['model']" in msg and "ArrayProvider" in msg and "'data'" in msg and "'scale'" in msg
    assert not list(tmp_path.rglob(DONE))


@pytest.mark.dask
def test_missing_key_detected_on_dask_before_any_shard(tmp_path, dask_client):
    runner = NeedsMissingKeyRunner(ArrayProvider({"n": 5}), output_dir=str(tmp_path), shard_size=2)
    with pytest.raises(ProviderError, match="model"):
        runner.run(range(5), client=dask_client, progress=False)
    assert not list(tmp_path.rglob(DONE))


def test_setup_fn_returning_dict_is_a_clear_error(tmp_path):
    runner = ScaleSumRunner(DictReturningProvider({"n": 5}), output_dir=str(tmp_path))
    with pytest.raises(ProviderError, match="returned a dict"):
        runner.provider.checked_setup_fn()


@pytest.mark.dask
def test_setup_fn_returning_dict_fails_at_submit(tmp_path, dask_client):
    runner = ScaleSumRunner(DictReturningProvider({"n": 5}), output_dir=str(tmp_path), shard_size=2)
    with pytest.raises(ProviderError, match="zero-argument function"):
        runner.run(range(5), client=dask_client, progress=False)


def test_in_memory_run_without_output_dir():
    runner = ScaleSumRunner(ArrayProvider({"n": 20}), shard_size=6)
    out = runner.run(range(20), progress=False)
    assert out.merged == {"sum": 3.0 * 0.5 * sum(range(20)), "n": 20}
    assert runner(range(20)) == out.merged  # ESPnet3's call form


class _CloseFailsOnce(ScaleSumRunner):
    """``close_writers`` fails the first time (a full disk while closing the shard's files);
    ``merge`` writes a total file, once every shard is done."""

    failed: list[bool] = []

    @staticmethod
    def close_writers(writers, state, **env):
        ScaleSumRunner.close_writers(writers, state)
        if not _CloseFailsOnce.failed:
            _CloseFailsOnce.failed.append(True)
            raise OSError("disk full while closing the shard's files")

    def merge(self, shard_dirs):
        merged = super().merge(shard_dirs)
        (self.output_dir / "total.json").write_text(json.dumps(merged))
        return {**merged, "published": True}


def test_failed_shard_publishes_nothing_and_merge_is_the_last_step(tmp_path):
    _CloseFailsOnce.failed.clear()
    runner = _CloseFailsOnce(ArrayProvider({"n": 12}), output_dir=str(tmp_path / "out"), shard_subdir="job",
                             shard_size=4)
    store = runner.storage
    with pytest.raises(ShardFailure, match="disk full") as err:
        runner.run(range(12), progress=False)
    assert isinstance(err.value.__cause__, OSError)
    plan = runner.plan(range(12))
    assert not any(store.exists(runner.shard_rel(s, DONE)) or store.exists(runner.shard_rel(s, "values.txt"))
                   for s in plan.shards)  # the failed shard is the first, and a run here stops at it
    assert not store.exists("total.json")  # merge runs only when every shard is done
    out = runner.run(range(12), progress=False)
    assert out.merged == {"sum": 3.0 * 0.5 * sum(range(12)), "n": 12, "published": True}
    assert store.read_json("total.json") == {"sum": 3.0 * 0.5 * sum(range(12)), "n": 12}


def test_bad_runner_arguments():
    with pytest.raises(ValueError, match="on_error"):
        ScaleSumRunner(ArrayProvider({"n": 1}), on_error="ignore")
    with pytest.raises(ValueError, match="batch_size"):
        ScaleSumRunner(ArrayProvider({"n": 1}), batch_size=0)
    with pytest.raises(TypeError, match="item 0 .* is a bytes: items are hashed into shards and stored in the plan as JSON"):
        ScaleSumRunner(ArrayProvider({"n": 1})).plan([b"0"])
    with pytest.raises(ValueError, match="shard_size"):
        ScaleSumRunner(ArrayProvider({"n": 1}), shard_size=0)


@pytest.mark.dask
def test_memory_output_refused_on_dask(dask_client):
    runner = ScaleSumRunner(ArrayProvider({"n": 5}), output_dir="memory://x", shard_size=2)
    with pytest.raises(ValueError, match="other processes"):
        runner.run(range(5), client=dask_client, progress=False)


# ---- the hooks' earlier names (they said "env" for the worker's resources) ----------------------
def _plus(idx, data, scale, offset, bonus=0.0):
    ids = idx if isinstance(idx, list) else [idx]
    return [(i, float(scale * data[i] + offset + bonus)) for i in ids]


class _EarlierNames(ScaleSumRunner):
    """Written before the rename: overrides ``shard_env``, ``shard_env_keys`` and ``check_env_keys``."""

    called: list[str]
    forward = staticmethod(_plus)

    def shard_env(self, shard, env):
        self.called.append("shard_env")
        return {**super().shard_env(shard, env), "offset": 100.0}

    def shard_env_keys(self):
        self.called.append("shard_env_keys")
        return (*super().shard_env_keys(), "offset")

    def check_env_keys(self, keys):
        self.called.append("check_env_keys")
        super().check_env_keys(keys)


class _CurrentNames(ScaleSumRunner):
    """Written for the current names: ``shard_resources``, ``shard_resource_keys``, ``check_resource_keys``."""

    called: list[str]
    forward = staticmethod(_plus)

    def shard_resources(self, shard, resources):
        self.called.append("shard_resources")
        return {**super().shard_resources(shard, resources), "offset": 100.0}

    def shard_resource_keys(self):
        self.called.append("shard_resource_keys")
        return (*super().shard_resource_keys(), "offset")

    def check_resource_keys(self, keys):
        self.called.append("check_resource_keys")
        super().check_resource_keys(keys)


class _EarlierOverCurrent(_CurrentNames):
    """A subclass written for the earlier names over a runner with the current ones (as a user's
    subclass of a built-in job's runner): both are called, its ``super()`` reaching the current ones."""

    def shard_env(self, shard, env):
        self.called.append("shard_env")
        return {**super().shard_env(shard, env), "bonus": 1000.0}

    def shard_env_keys(self):
        return (*super().shard_env_keys(), "bonus")


class _CurrentOverEarlier(_EarlierNames):
    """The other way round: the current names over a runner written for the earlier ones."""

    def shard_resources(self, shard, resources):
        self.called.append("shard_resources")
        return {**super().shard_resources(shard, resources), "bonus": 1000.0}

    def shard_resource_keys(self):
        return (*super().shard_resource_keys(), "bonus")


@pytest.mark.parametrize(("cls", "bonus", "called"), [
    (_EarlierNames, 0.0, {"shard_env", "shard_env_keys", "check_env_keys"}),
    (_CurrentNames, 0.0, {"shard_resources", "shard_resource_keys", "check_resource_keys"}),
    (_EarlierOverCurrent, 1000.0, {"shard_env", "shard_resources", "shard_resource_keys", "check_resource_keys"}),
    (_CurrentOverEarlier, 1000.0, {"shard_resources", "shard_env", "shard_env_keys", "check_env_keys"}),
])
def test_a_runner_written_for_either_hook_name_is_called(cls, bonus, called, tmp_path):
    """``forward`` needs ``offset`` (and ``bonus``), which only the overrides add: a hook not called
    fails the key check or the shard."""
    runner = cls(ArrayProvider({"n": 10}), output_dir=str(tmp_path), shard_size=4)
    runner.called = []
    out = runner.run(range(10), progress=False)
    assert out.merged == {"sum": 3.0 * 0.5 * sum(range(10)) + (100.0 + bonus) * 10, "n": 10}
    assert set(runner.called) == called


def test_get_env_is_the_earlier_name_of_worker_resources():
    from espnet3_flows.parallel import get_env, worker_resources

    assert get_env is worker_resources
    provider = ArrayProvider({"n": 3})
    assert sorted(get_env(provider, local=True)) == ["data", "kill_at", "kill_marker", "pid", "scale"]


BAD = {7, 40, 41}
CALLS: list[list[int]] = []


class BadItemsRunner(ScaleSumRunner):
    """``forward`` over a list fails as a whole when it holds an item of ``BAD`` (a model that
    finds a corrupt utterance mid-batch); every call is recorded."""

    @staticmethod
    def forward(idx, data, scale, kill_marker, kill_at):
        from espnet3_flows.errors import BadItemError

        CALLS.append(list(idx))
        bad = sorted(BAD.intersection(idx))
        if bad:
            raise BadItemError(f"item {bad[0]} is corrupt")
        return [(i, float(scale * data[i])) for i in idx]


def test_a_whole_shard_with_bad_items_is_cut_in_halves_not_into_single_items(tmp_path):
    from espnet3_flows.parallel.base_runner import WHOLE_SHARD

    CALLS.clear()
    runner = BadItemsRunner(ArrayProvider({"n": N}), batch_size=WHOLE_SHARD, output_dir=str(tmp_path),
                            shard_size=1000, on_error="skip")
    out = runner.run(range(N), progress=False)
    assert len(out.plan.shards) == 1 and out.merged["n"] == N - len(BAD)
    assert out.merged["sum"] == pytest.approx(3.0 * 0.5 * sum(set(range(N)) - BAD))
    lines = (tmp_path / out.plan.shards[0].name / "values.txt").read_text().splitlines()
    assert [int(line.split()[0]) for line in lines] == sorted(set(range(N)) - BAD)  # in order
    done = json.loads((tmp_path / out.plan.shards[0].name / DONE).read_text())
    assert [s["idx"] for s in done["skipped"]] == sorted(BAD)
    # halves of halves: 53 items, three bad in two places: 23 calls over 210 items, each call batched
    # (a call per item, as before: 55 calls over 156 items, 53 of them alone)
    assert len(CALLS) <= 2 * len(BAD) * (N - 1).bit_length() + 1, CALLS
    assert sum(len(c) for c in CALLS) <= 4 * N, CALLS  # about 2 passes over the shard per bad place
    assert all([b] in CALLS for b in BAD)  # each bad item was found alone


def test_a_bad_item_in_a_batch_fails_the_run_naming_it_under_on_error_fail(tmp_path):
    from espnet3_flows.errors import ItemFailure
    from espnet3_flows.parallel.base_runner import WHOLE_SHARD

    runner = BadItemsRunner(ArrayProvider({"n": N}), batch_size=WHOLE_SHARD, output_dir=str(tmp_path),
                            shard_size=1000)
    with pytest.raises(ItemFailure, match="item 7"):
        runner.run(range(N), progress=False)
