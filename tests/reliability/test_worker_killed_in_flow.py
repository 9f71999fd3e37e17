"""A Dask worker SIGKILLed in the middle of a flow run (not only the engine's): the run survives
one loss, a shard that kills every worker fails the run naming it, and either way the outputs
equal those of a run that was never hurt."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.parallel import ShardFailure
from tests.support.floats import assert_same_floats

pytestmark = [pytest.mark.prefect, pytest.mark.dask]
KILLER = "tests.orchestration.slow_model.KillOnceFramer"


def _cfg(manifest: str, out: Path, marker: Path | None, poison: Path | None = None) -> dict:
    model = {"_target_": KILLER, "marker": str(marker), "kill_at": 4, "poison": str(poison)} if marker else {
        "_target_": KILLER, "marker": "/nonexistent/never", "kill_at": 0}
    return {"manifests": {"train": manifest}, "output_dir": str(out), "shard_size": 6, "batch_size": 2,
            "frontend": {"type": "model", "model": model}, "parallel": {"env": "local", "n_workers": 2}}


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _assert_same_outputs(out: Path, ref: Path) -> None:
    got, want = _npz(out / "train" / "feats_stats.npz"), _npz(ref / "train" / "feats_stats.npz")
    assert got.keys() == want.keys()
    for key in want:
        assert_same_floats(got[key], want[key])  # two runs, other processes
    for name in ("speech_shape", "feats_shape"):
        assert (out / "train" / name).read_text() == (ref / "train" / name).read_text()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "staging left behind"


@pytest.fixture(scope="module")
def reference(prefect_harness, demo_corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("clean") / "out"
    summary = run_job("collect_stats", _cfg(demo_corpus["train"], out, None), progress=False)["train"]
    assert summary["shards"] >= 6
    return out, summary


def test_flow_survives_a_killed_worker(prefect_harness, demo_corpus, reference, tmp_path):
    ref, ref_summary = reference
    marker = tmp_path / "killed"
    summary = run_job("collect_stats", _cfg(demo_corpus["train"], tmp_path / "out", marker), progress=False)["train"]
    assert marker.exists(), "no worker was killed"
    assert int(marker.read_text()) != os.getpid(), "the kill must hit a worker, not the driver"
    # Dask re-ran the lost shard on the surviving (or restarted) worker: nothing is missing
    assert summary["shards_computed"] == summary["shards"] == ref_summary["shards"]
    assert summary["utterances"] == ref_summary["utterances"] and summary["frames"] == ref_summary["frames"]
    _assert_same_outputs(tmp_path / "out", ref)
    again = run_job("collect_stats", _cfg(demo_corpus["train"], tmp_path / "out", marker), progress=False)["train"]
    assert again["shards_cached"] == again["shards"] and again["shards_computed"] == 0


@pytest.mark.slow
def test_a_shard_that_kills_every_worker_fails_naming_it_then_rerun_finishes(
        prefect_harness, demo_corpus, reference, tmp_path):
    ref, ref_summary = reference
    marker, poison, out = tmp_path / "killed", tmp_path / "poison", tmp_path / "out"
    poison.touch()
    cfg = _cfg(demo_corpus["train"], out, marker, poison)
    cfg["parallel"]["allowed_failures"] = 1  # the default 3 costs two more worker restarts (~20 s)
    with pytest.raises(ShardFailure) as err:
        run_job("collect_stats", cfg, progress=False)
    message = str(err.value)
    # Dask gives up on a task after its workers died parallel.allowed_failures + 1 (2) times: the
    # run ends with the shards named, it does not loop restarting workers
    assert "train/shards/split." in message and "workers died" in message, message
    assert "2 different workers" in message, message  # parallel.allowed_failures reached the scheduler
    assert not (out / "train" / "feats_stats.npz").exists(), "a failed run must not publish"
    done = sorted(p.parent.name for p in (out / "train" / "shards").glob("split.*/done"))
    assert len(done) < ref_summary["shards"]

    poison.unlink()
    rerun = run_job("collect_stats", _cfg(demo_corpus["train"], out, marker, poison), progress=False)["train"]
    assert rerun["shards_cached"] == len(done)
    assert rerun["shards_computed"] == ref_summary["shards"] - len(done)
    _assert_same_outputs(out, ref)
