"""Runners written only against ESPnet3's documented BaseRunner contract (tests/parallel/espnet3_runners.py)
run unchanged: writer hooks in order per shard, ``merge`` over the ordered completed shard directories,
``batch_size`` lists, resume, in this process and on a 2-worker LocalCluster, local disk and S3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from espnet3_flows.parallel import ProviderError, ShardFailure, set_parallel
from espnet3_flows.parallel.base_runner import DONE, PLAN
from espnet3_flows.storage import Storage
from tests.parallel.espnet3_runners import (
    DuckProvider,
    Espnet3CollectStatsRunner,
    FailsOn13Runner,
    HookLogRunner,
    ListProvider,
    OneArgCloseRunner,
    RecordsRunner,
    RequiresMarkerRunner,
    WavListProvider,
)

N = 23


@pytest.fixture(params=["serial", pytest.param("dask", marks=pytest.mark.dask)])
def parallel(request):
    """ESPnet3's ``set_parallel``: nothing (in this process) or a 2-worker LocalCluster."""
    if request.param == "dask":
        set_parallel({"env": "local", "n_workers": 2})
    yield request.param
    set_parallel(None)


def _plan_hashes(out: Path, subdir: str = "") -> list[str]:
    return [s["hash"] for s in json.loads((out / subdir / PLAN).read_text())["shards"]]


def test_writer_hooks_run_in_order_and_merge_gets_the_ordered_completed_shard_dirs(parallel, tmp_path):
    out = tmp_path / "out"
    runner = HookLogRunner(ListProvider({"n": N}), batch_size=4, output_dir=str(out), shard_subdir="job",
                           shard_size=6)
    merged = runner(range(N))
    hashes = _plan_hashes(out, "job")
    assert len(hashes) > 1
    assert merged["dirs"] == [str(out / "job" / f"split.{h[:16]}") for h in hashes]  # plan order
    assert all(merged["done"]) and all((Path(d) / DONE).is_file() for d in merged["dirs"])
    for k, log in enumerate(merged["logs"]):
        shard = json.loads((Path(merged["dirs"][k]) / DONE).read_text())["shard"]
        n = shard["stop"] - shard["start"]
        # init_state opened the writers in the shard's directory, inside output_dir; one record per
        # batch of <= 4 items; close_writers last, its returned dict merged into the state
        assert log[0] == f"open {k} split.{hashes[k][:16]} True"
        assert log[1:-1] == [f"record {min(4, n - b)}" for b in range(0, n, 4)] and log[-1] == "close"
        assert json.loads((Path(merged["dirs"][k]) / DONE).read_text())["result"]["closed"] is True
    assert merged["rows"] == [f"{i} {2 * i}" for i in range(N)]
    assert merged["merged_file"] == out / "rows.txt" and (out / "rows.txt").is_file()


def test_rerun_computes_nothing_and_resume_false_recomputes(parallel, tmp_path):
    def run(**kwargs):
        return HookLogRunner(ListProvider({"n": N}), output_dir=str(tmp_path), shard_size=5, **kwargs)(range(N))

    first = run()
    again = run()
    assert again["tokens"] == first["tokens"] and again["rows"] == first["rows"]  # every shard reused
    fresh = run(resume=False)
    assert fresh["dirs"] == first["dirs"] and fresh["rows"] == first["rows"]
    assert not set(fresh["tokens"]) & set(first["tokens"])  # every shard computed again


def test_grown_input_recomputes_only_shards_it_changed(tmp_path):
    def run(n):
        return HookLogRunner(ListProvider({"n": 60}), output_dir=str(tmp_path), shard_size=6)(range(n))

    first = run(40)
    grown = run(60)
    kept = {t for t in grown["tokens"] if t in first["tokens"]}
    assert len(kept) >= len(first["tokens"]) - 1 and grown["rows"] == [f"{i} {2 * i}" for i in range(60)]


def test_only_forward_returns_records_in_order_without_an_output_dir(parallel):
    """The x-vector page's skeleton: ``MyRunner(provider)`` with a forward only, then ``runner(range(n))``."""
    assert RecordsRunner(ListProvider({"n": N}))(range(N)) == [{"idx": i, "y": 2 * i} for i in range(N)]
    batched = RecordsRunner(ListProvider({"n": 10}), batch_size=3)(range(10))
    if parallel == "serial":  # one shard: batches of 3 from its start
        assert batched == [[{"idx": i, "y": 2 * i} for i in chunk] for chunk in ([0, 1, 2], [3, 4, 5], [6, 7, 8], [9])]
    else:  # 10 items on 2 workers are cut into several shards (every worker busy); a batch never spans two
        assert [r for batch in batched for r in batch] == [{"idx": i, "y": 2 * i} for i in range(10)]
        assert all(1 <= len(batch) <= 3 for batch in batched)


def test_items_need_not_be_positions(tmp_path):
    runner = RecordsRunner(ListProvider({"n": 40}), output_dir=str(tmp_path), shard_size=4)
    assert runner([7, 3, 30, 3]) == [{"idx": i, "y": 2 * i} for i in (7, 3, 30, 3)]


def test_one_argument_close_writers_and_a_provider_of_another_class(parallel, tmp_path):
    merged = OneArgCloseRunner(DuckProvider(N), output_dir=str(tmp_path), shard_size=5)(range(N))
    assert merged["rows"] == [f"{i} {2 * i}" for i in range(N)]
    assert all(log[-1] == f"record {1}" for log in merged["logs"])  # no "close": its own close_writers ran


def test_is_shard_done_of_the_runner_decides_with_the_done_record(tmp_path):
    runner = RequiresMarkerRunner(ListProvider({"n": N}), output_dir=str(tmp_path), shard_size=5)
    first = runner(range(N))
    emptied = Path(first["dirs"][1]) / "rows.txt"
    emptied.write_text("")  # the runner's own condition now fails for that shard only
    again = runner(range(N))
    changed = [a != b for a, b in zip(first["tokens"], again["tokens"], strict=True)]
    assert changed == [k == 1 for k in range(len(changed))]


def test_forward_needing_a_key_the_provider_lacks_fails_before_any_shard(tmp_path):
    class NeedsTokenizer(RecordsRunner):
        @staticmethod
        def forward(idx, dataset, model, tokenizer):
            return idx

    with pytest.raises(ProviderError, match="tokenizer") as err:
        NeedsTokenizer(ListProvider({"n": 5}), output_dir=str(tmp_path))(range(5))
    assert "ListProvider" in str(err.value) and "'dataset'" in str(err.value)
    assert not list(tmp_path.rglob(DONE))


def test_failing_forward_names_the_shard_and_keeps_the_others(tmp_path, dask_client):
    runner = FailsOn13Runner(ListProvider({"n": N}), output_dir=str(tmp_path), shard_size=5)
    with pytest.raises(ShardFailure, match="model exploded on 13") as err:
        runner.run(range(N), client=dask_client, progress=False)
    assert isinstance(err.value.__cause__, RuntimeError) and "1 shard(s) failed (FailsOn13Runner/split." in str(err.value)
    done = {p.parent.name for p in tmp_path.glob("split.*/done")}
    assert len(done) == len(_plan_hashes(tmp_path)) - 1  # the others are published


@pytest.mark.s3
def test_s3_output_merge_reads_local_copies_and_its_files_are_published(parallel, s3_output):
    url, options = s3_output
    runner = HookLogRunner(ListProvider({"n": N}), batch_size=4, output_dir=url, shard_subdir="job", shard_size=6,
                           storage_options=options)
    merged = runner(range(N))
    store = Storage(url, options)
    plan = store.read_json("job", PLAN)
    assert [Path(d).name for d in merged["dirs"]] == [f"split.{s['hash'][:16]}" for s in plan["shards"]]
    assert all(merged["done"]) and merged["rows"] == [f"{i} {2 * i}" for i in range(N)]
    assert runner.output_dir == url  # the local mirror was the output only during merge
    assert merged["merged_file"] == store.uri("rows.txt")  # a path it returned now names the published file
    assert store.read_bytes("rows.txt").decode().splitlines() == merged["rows"]
    for s in plan["shards"]:
        assert store.exists("job", f"split.{s['hash'][:16]}", "rows.txt")
    again = HookLogRunner(ListProvider({"n": N}), batch_size=4, output_dir=url, shard_subdir="job", shard_size=6,
                          storage_options=options)(range(N))
    assert again["tokens"] == merged["tokens"]


def test_espnet3_collect_stats_runner_equals_our_collect_stats(demo_corpus, tmp_path, parallel):
    from espnet3_flows.config import load_config
    from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner

    manifest = demo_corpus["train"]
    theirs = Espnet3CollectStatsRunner(WavListProvider({"manifest": manifest}), output_dir=str(tmp_path / "e3"),
                                       mode="train", batch_size=4, shard_size=8)
    n = len(Path(manifest).read_text().splitlines())
    aggregated = theirs(range(n))
    cfg = load_config(CollectStatsConfig, base={"manifests": {"train": manifest}, "output_dir": str(tmp_path / "ours"),
                                                "shard_size": 8, "parallel": {"env": "serial"}})
    CollectStatsRunner(cfg, "train").run(progress=False)
    with np.load(tmp_path / "e3" / "train" / "feats_stats.npz") as a, \
            np.load(tmp_path / "ours" / "train" / "feats_stats.npz") as b:
        assert int(a["count"]) == int(b["count"]) == int(aggregated["count"]["feats"])
        np.testing.assert_allclose(a["sum"], b["sum"], rtol=1e-9)
        np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-9)
    assert sorted((tmp_path / "e3" / "train" / "feats_shape").read_text().splitlines()) == \
        sorted((tmp_path / "ours" / "train" / "feats_shape").read_text().splitlines())


def test_pre_batched_index_lists_as_items_as_espnet3s_collect_stats_passes_them(demo_corpus, tmp_path, parallel):
    """ESPnet3's ``collect_stats()`` cuts the indices into batches itself and calls
    ``runner(index_batches)`` with ``batch_size=None``: each item is a list of ints, and
    ``forward`` receives it as it is."""
    manifest = demo_corpus["train"]
    n = len(Path(manifest).read_text().splitlines())
    batches = [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]
    batched = Espnet3CollectStatsRunner(WavListProvider({"manifest": manifest}), output_dir=str(tmp_path / "lists"),
                                        mode="train", shard_size=3)
    per_item = Espnet3CollectStatsRunner(WavListProvider({"manifest": manifest}), output_dir=str(tmp_path / "ints"),
                                         mode="train", batch_size=4, shard_size=12)
    a, b = batched(batches), per_item(range(n))
    assert int(a["count"]["feats"]) == int(b["count"]["feats"])
    np.testing.assert_allclose(a["sum"]["feats"], b["sum"]["feats"], rtol=1e-9)
    plan = json.loads((tmp_path / "lists" / "train" / PLAN).read_text())
    assert [i for s in plan["shards"] for i in s["indices"]] == batches  # stored as given
    again = Espnet3CollectStatsRunner(WavListProvider({"manifest": manifest}), output_dir=str(tmp_path / "lists"),
                                      mode="train", shard_size=3)
    assert again.run(batches, progress=False).computed == 0  # the same lists hash to the same shards


def test_items_that_are_not_json_data_are_refused_naming_the_item(tmp_path):
    runner = RecordsRunner(ListProvider({"n": 4}), output_dir=str(tmp_path))
    with pytest.raises(TypeError, match=r"item 1 \(\[1, \{2\}\]\) is a set: items are hashed"):
        runner([[0], [1, {2}]])
    with pytest.raises(TypeError, match=r"item 0 \(nan\) is not a finite number"):
        runner([float("nan")])
