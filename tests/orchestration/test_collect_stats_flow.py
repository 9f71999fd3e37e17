"""Collect-stats as a Prefect flow: Dask cluster, cache hits, incremental runs, S3, artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import s3fs

from espnet3_flows.orchestration.flows import run_job
from tests.support.prefect_readback import artifacts_of, runs_writing, task_run_states

pytestmark = pytest.mark.prefect


@pytest.mark.unpatched
@pytest.mark.dask
def test_flow_on_local_cluster_caches_and_publishes(prefect_harness, demo_corpus, tmp_path):
    out = tmp_path / "out"
    cfg = {"manifests": demo_corpus, "output_dir": str(out), "shard_size": 8,
           "parallel": {"env": "local", "n_workers": 2}}
    first = run_job("collect_stats", cfg, progress=False)
    shards = {split: first[split]["shards"] for split in first}
    assert all(first[split]["shards_computed"] == n > 0 for split, n in shards.items())
    for split in ("train", "valid"):
        for name in ("feats_stats.npz", "feats_shape", "speech_shape", "stats_keys", "batch_keys", "summary.json",
                     "stats.png", "skipped.tsv"):
            assert (out / split / name).is_file(), name
    assert not (out / ".prefect-results").exists(), "the done records are the cache: Prefect persists nothing"
    (run,) = runs_writing("collect-stats-shards", out, newest_only=True)
    arts = artifacts_of(run, "collect-stats-")
    report = arts["collect-stats-train-report"]
    assert report.type == "markdown" and "| Utterances | 48 |" in report.data and "data:image/png;base64," in report.data
    assert arts["collect-stats-splits"].type == "table"
    assert arts["collect-stats-progress"].type == "progress" and float(arts["collect-stats-progress"].data) == 100.0
    assert f"[feats_stats.npz](file://{out}/train/feats_stats.npz)" in report.data  # its files, linked there
    assert set(arts) == {"collect-stats-progress", "collect-stats-splits", "collect-stats-train-report",
                         "collect-stats-valid-report"}, sorted(arts)  # one artifact a split, no link artifacts
    # every task's final state reached the API, the merges' too (sent just before the workers exit)
    states = task_run_states("collect-stats-shards", out, expected=sum(shards.values()) + len(shards))
    assert len(states) == sum(shards.values()) + len(shards) and set(states.values()) == {"COMPLETED"}, states
    before = (out / "train" / "feats_stats.npz").read_bytes()

    again = run_job("collect_stats", cfg, progress=False)
    assert again["train"]["shards_computed"] == 0 and again["train"]["shards_cached"] == shards["train"]
    assert (out / "train" / "feats_stats.npz").read_bytes() == before

    # the cluster's statistics are the engine's alone (with ESPNET3_FLOWS_PATCHES=off too: the
    # patches are speed-ups, never a change of result)
    serial = tmp_path / "serial"
    run_job("collect_stats", {**cfg, "output_dir": str(serial), "parallel": {"env": "serial"}}, progress=False)
    for split in ("train", "valid"):
        with np.load(out / split / "feats_stats.npz") as a, np.load(serial / split / "feats_stats.npz") as b:
            assert a.files == b.files
            for key in b.files:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-12)


def test_incremental_append_computes_only_new_shards(prefect_harness, demo_corpus, tmp_path):
    manifest = tmp_path / "train.tsv"
    lines = Path(demo_corpus["train"]).read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:40]))
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "shard_size": 8,
           "parallel": {"env": "serial"}}
    first = run_job("collect_stats", cfg, progress=False)["train"]
    assert first["shards_computed"] == first["shards"]
    manifest.write_text("".join(lines))  # 8 lines appended: the last (partial) shard and new ones recompute
    grown = run_job("collect_stats", cfg, progress=False)["train"]
    assert grown["utterances"] == 48 and grown["shards_cached"] >= first["shards"] - 1
    assert grown["shards_computed"] == grown["shards"] - grown["shards_cached"] <= 3

    full = {"manifests": {"train": demo_corpus["train"]}, "output_dir": str(tmp_path / "full"), "shard_size": 8,
            "parallel": {"env": "serial"}}
    run_job("collect_stats", full, progress=False)
    a = np.load(tmp_path / "out" / "train" / "feats_stats.npz")
    b = np.load(tmp_path / "full" / "train" / "feats_stats.npz")
    assert int(a["count"]) == int(b["count"])
    np.testing.assert_allclose(a["sum"], b["sum"], rtol=1e-12)
    np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)
    assert (tmp_path / "out/train/speech_shape").read_text() == (tmp_path / "full/train/speech_shape").read_text()


def test_insertions_into_a_sorted_manifest_recompute_only_the_shards_that_receive_them(prefect_harness, demo_corpus,
                                                                                      tmp_path):
    """Kaldi/ESPnet data dirs are sorted by id: new data lands in the middle. Shards after an insertion
    shift position but keep their content, so they must be found done (their directories are named by
    content, not by position)."""
    lines = sorted(Path(demo_corpus["train"]).read_text().splitlines(keepends=True))
    manifest = tmp_path / "train.tsv"
    manifest.write_text("".join(lines))
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "shard_size": 4,
           "parallel": {"env": "serial"}}
    first = run_job("collect_stats", cfg, progress=False)["train"]
    assert first["shards"] >= 8
    grown = list(lines)
    for at in (30, 10):  # one early (shifts almost every shard), one later
        uid, path = grown[at].split("\t")[:2]
        grown.insert(at + 1, f"{uid}-x\t{path}\n")  # sorts right after its neighbour
    assert grown == sorted(grown)
    manifest.write_text("".join(grown))
    again = run_job("collect_stats", cfg, progress=False)["train"]
    plan = json.loads((tmp_path / "out/train/shards/manifest.json").read_text())["shards"]
    new_positions = [i for i, line in enumerate(ln for ln in grown) if "-x\t" in line]
    receiving = {k for k, s in enumerate(plan) for p in new_positions if s["start"] <= p < s["stop"]}
    # each insertion recomputes its shard and rarely a neighbour or two (a boundary moved by the minimum
    # size, or the new id itself ending a shard); positions shifted for all later shards
    assert again["utterances"] == 50 and 1 <= again["shards_computed"] <= len(receiving) + 2 * len(new_positions)
    assert again["shards_cached"] >= first["shards"] - 2 - 2 * len(new_positions), (first, again)
    clean = run_job("collect_stats", cfg | {"output_dir": str(tmp_path / "clean")}, progress=False)["train"]
    assert clean["shards"] == again["shards"]
    a, b = np.load(tmp_path / "out/train/feats_stats.npz"), np.load(tmp_path / "clean/train/feats_stats.npz")
    assert int(a["count"]) == int(b["count"])
    np.testing.assert_allclose(a["sum_square"], b["sum_square"], rtol=1e-12)
    for name in ("feats_shape", "speech_shape"):
        assert (tmp_path / "out/train" / name).read_bytes() == (tmp_path / "clean/train" / name).read_bytes()


@pytest.mark.s3
def test_outputs_and_results_on_s3(prefect_harness, demo_corpus, s3_output):
    url, options = s3_output
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": url, "storage_options": options,
           "shard_size": 4, "parallel": {"env": "serial"}}
    first = run_job("collect_stats", cfg, progress=False)["valid"]
    assert first["shards_computed"] == first["shards"] > 1
    fs = s3fs.S3FileSystem(**options)
    root = url[len("s3://"):]
    stats = np.load(fs.open(f"{root}/valid/feats_stats.npz", "rb"))
    assert int(stats["count"]) == first["frames"] and stats["sum"].shape == (80,)
    assert not fs.exists(f"{root}/.prefect-results")
    assert fs.cat(f"{root}/valid/speech_shape").decode().count("\n") == 12
    again = run_job("collect_stats", cfg, progress=False)["valid"]
    assert again["shards_cached"] == first["shards"]
    secret = options["secret"]
    for path in fs.find(root):
        assert secret.encode() not in fs.cat(path) or path.endswith(".wav")


def test_unwritable_output_fails_before_work(prefect_harness, demo_corpus, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = {"manifests": demo_corpus, "output_dir": str(blocker / "out"), "parallel": {"env": "serial"}}
    from espnet3_flows.storage import StorageError

    with pytest.raises(StorageError, match="not writable"):
        run_job("collect_stats", cfg, progress=False)


def test_warns_when_a_dask_client_would_take_over_the_flow(caplog):
    """prefect-dask runs tasks on any Dask client open in the process, ignoring parallel.*."""
    from distributed import Client

    from espnet3_flows.orchestration.cluster_warnings import warn_if_dask_client_open
    from espnet3_flows.parallel.parallel_config import ParallelConfig

    with Client(processes=False, n_workers=0, dashboard_address=":0"):
        with caplog.at_level("WARNING", logger="espnet3_flows"):
            assert warn_if_dask_client_open(ParallelConfig(env="local")) is True
        assert warn_if_dask_client_open(ParallelConfig(env="serial")) is False
    assert "prefect-dask will run the shard tasks on its cluster" in caplog.text


@pytest.mark.dask
def test_statistics_are_exact_sums_of_the_written_features(prefect_harness, demo_corpus, tmp_path):
    """``sum``/``sum_square`` in feats_stats.npz against an independent exact sum (``math.fsum``)
    over every feature value the run wrote, at 1e-12 of the summed magnitudes: the float64
    accumulation and the cross-shard merges lose nothing a float64 result can hold."""
    import math

    import kaldiio

    cfg = {"manifests": {"train": demo_corpus["train"]}, "output_dir": str(tmp_path / "out"), "shard_size": 6,
           "write_collected_feats": True, "parallel": {"env": "local", "n_workers": 2}}
    summary = run_job("collect_stats", cfg, progress=False)["train"]
    assert summary["shards"] >= 4  # several shards, merged across workers
    feats = [np.asarray(m, dtype=np.float64) for _, m in
             kaldiio.load_scp_sequential(str(tmp_path / "out" / "train" / "collect_feats" / "feats.scp"))]
    assert len(feats) == summary["utterances"]
    x = np.concatenate(feats)  # float32 values, exactly representable; squares too (24+24 < 53 bits)
    with np.load(tmp_path / "out" / "train" / "feats_stats.npz") as npz:
        assert int(npz["count"]) == x.shape[0] == summary["frames"]
        for d in range(x.shape[1]):
            col = x[:, d].tolist()
            exact_sum, exact_sq = math.fsum(col), math.fsum(v * v for v in col)
            scale = math.fsum(abs(v) for v in col)
            assert abs(npz["sum"][d] - exact_sum) <= 1e-12 * scale, (d, npz["sum"][d], exact_sum)
            assert abs(npz["sum_square"][d] - exact_sq) <= 1e-12 * exact_sq, (d, npz["sum_square"][d], exact_sq)


@pytest.mark.parametrize("error, attempts, on_error", [("bad", 1, "fail"), ("os", 3, "fail"), ("value", 3, "fail"),
                                                       ("value", 3, "skip"), ("os", 3, "skip")])
def test_bad_items_are_not_retried_other_failures_are(prefect_harness, demo_corpus, tmp_path, error, attempts,
                                                      on_error):
    """A bad item (BadItemError under on_error: fail) fails the same way every time: the run fails
    on the first attempt. An I/O error may be transient, and a plain ValueError is a bug (numpy or
    torch inside the model): both get every retry and fail the run, under on_error: skip too, where
    they never turn into skipped items."""
    import soundfile as sf

    from espnet3_flows.parallel import ShardFailure

    poisoned = tmp_path / "poisoned.wav"
    sf.write(poisoned, np.zeros(12345, dtype=np.float32), 16000)
    manifest = tmp_path / "train.tsv"
    manifest.write_text(Path(demo_corpus["valid"]).read_text() + f"poisoned\t{poisoned}\n")
    counter = tmp_path / "attempts"
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "shard_size": 4,
           "batch_size": 1, "retries": 2, "retry_delay_seconds": 0.05, "parallel": {"env": "serial"}, "on_error": on_error,
           "frontend": {"type": "model", "model": {"_target_": "tests.orchestration.slow_model.FailOnLength",
                                                    "length": 12345, "counter": str(counter), "error": error}}}
    with pytest.raises(ShardFailure, match="poisoned length"):
        run_job("collect_stats", cfg, progress=False)
    assert len(counter.read_text().splitlines()) == attempts


def test_a_bad_item_under_skip_is_listed_and_the_run_completes(prefect_harness, demo_corpus, tmp_path):
    import soundfile as sf

    poisoned = tmp_path / "poisoned.wav"
    sf.write(poisoned, np.zeros(12345, dtype=np.float32), 16000)
    manifest = tmp_path / "train.tsv"
    manifest.write_text(Path(demo_corpus["valid"]).read_text() + f"poisoned\t{poisoned}\n")
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "shard_size": 4,
           "batch_size": 2, "on_error": "skip", "parallel": {"env": "serial"},
           "frontend": {"type": "model", "model": {"_target_": "tests.orchestration.slow_model.FailOnLength",
                                                    "length": 12345, "counter": str(tmp_path / "n"), "error": "bad"}}}
    summary = run_job("collect_stats", cfg, progress=False)["train"]
    assert summary["skipped"] == 1 and summary["utterances"] == 12
    assert "poisoned length 12345" in (tmp_path / "out" / "train" / "skipped.tsv").read_text()
