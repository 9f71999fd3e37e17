"""ESPnet3's collect-stats runner, hook for hook as its source has it
(:class:`~tests.parallel.espnet3_runners.Espnet3SourceCollectStatsRunner`, called as ESPnet3's
``collect_stats()`` calls it: ``runner(index_batches)``), on our engine: the same ``{key}_stats.npz``
(``count``, ``sum``, ``sum_square``), shape files, per-shard files and merge totals, checked against
an independent float64 numpy computation, in this process and on a 2-worker ``LocalCluster``. Mirrors
``test/espnet3/components/data/test_collect_stats.py``; see ``docs/espnet3-conformance.md``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from espnet3_flows.parallel import set_parallel
from espnet3_flows.parallel.base_runner import DONE, PLAN
from tests.parallel.espnet3_runners import SyntheticStatsProvider, SyntheticUtterances, espnet3_collect_stats


@pytest.fixture(autouse=True)
def no_parallel_config():
    set_parallel(None)
    yield
    set_parallel(None)


def _reference(n: int, dim: int, base_len: int, scale: float, with_uids: bool) -> dict:
    """What collect-stats must find, computed here in float64 from the utterances themselves."""
    data = SyntheticUtterances(n, dim, base_len, with_uids)
    mel = [scale * data.features(i).astype(np.float64) for i in range(n)]
    lengths = np.array([data.length(i) for i in range(n)], dtype=np.float64)
    uid = (lambda i: f"utt{i:03d}") if with_uids else str
    return {
        "mel": {"count": sum(len(m) for m in mel), "sum": sum(m.sum(0) for m in mel),
                "sum_square": sum((m ** 2).sum(0) for m in mel)},
        "mel_lengths": {"count": n, "sum": lengths.sum(), "sum_square": (lengths ** 2).sum()},
        "mel_shape": [f"{uid(i)} {data.length(i)},{dim}" for i in range(n)],
        "mel_lengths_shape": [f"{uid(i)} 1" for i in range(n)],
        "uids": [uid(i) for i in range(n)],
    }


def _check_npz(path: Path, expected: dict) -> None:
    with np.load(path) as got:
        assert int(got["count"]) == expected["count"]
        np.testing.assert_array_equal(np.asarray(got["sum"], dtype=np.float64), expected["sum"])
        np.testing.assert_array_equal(np.asarray(got["sum_square"], dtype=np.float64), expected["sum_square"])


def _shard_dirs(mode_dir: Path) -> list[Path]:
    return [mode_dir / f"split.{s['hash'][:16]}" for s in json.loads((mode_dir / PLAN).read_text())["shards"]]


@pytest.mark.parametrize("where,mode,with_uids", [
    ("serial", "train", False), ("serial", "valid", True),
    pytest.param("local", "train", True, marks=pytest.mark.dask)])
def test_stats_npz_shapes_and_totals_equal_a_float64_reference(tmp_path, where, mode, with_uids):
    """Mirrors ``test_collect_stats_local_basic`` (``use_parallel`` × ``use_espnet_preprocessor``),
    ``test_collect_stats_entrypoint_train`` and ``test_collect_stats_entrypoint_valid``: under
    ``output_dir/<mode>``, ``stats_keys`` and ``{key}_stats.npz`` for ``mel`` and ``mel_lengths``
    whose ``count`` is the total frames, ``{key}_shape`` lines ``uid T,D`` in item order, the collected
    features' scp with a line per utterance; the merge's totals are the same numbers, and so are
    the per-shard ``*_stats.npz`` summed over the shards. ``local``: ``parallel_config`` of
    ``env: local, n_workers: 2`` (shards on a ``LocalCluster``)."""
    n, dim, base_len, scale = 23, 3, 2, 2.0
    if where == "local":
        set_parallel({"env": "local", "n_workers": 2})
    provider = SyntheticStatsProvider({"n": n, "dim": dim, "base_len": base_len, "scale": scale,
                                       "with_uids": with_uids, "write_collected_feats": True})
    totals = espnet3_collect_stats(provider, tmp_path, mode, n, batch_size=3, write_collected_feats=True,
                                   shard_size=2)
    want = _reference(n, dim, base_len, scale, with_uids)
    mode_dir = tmp_path / mode
    assert (mode_dir / "stats_keys").read_text().split() == ["mel", "mel_lengths"]
    for key in ("mel", "mel_lengths"):
        _check_npz(mode_dir / f"{key}_stats.npz", want[key])
        assert int(totals["count"][key]) == want[key]["count"]
        np.testing.assert_array_equal(np.asarray(totals["sum"][key], dtype=np.float64), want[key]["sum"])
        np.testing.assert_array_equal(np.asarray(totals["sq"][key], dtype=np.float64), want[key]["sum_square"])
        assert (mode_dir / f"{key}_shape").read_text().splitlines() == want[f"{key}_shape"]
        scp = (mode_dir / "collect_feats" / f"{key}.scp").read_text().splitlines()
        assert [line.split()[0] for line in scp] == want["uids"]
    shard_dirs = _shard_dirs(mode_dir)
    assert len(shard_dirs) > 1 and all((d / DONE).is_file() for d in shard_dirs)
    for key in ("mel", "mel_lengths"):
        parts = [np.load(d / f"{key}_stats.npz") for d in shard_dirs]
        assert sum(int(p["count"]) for p in parts) == want[key]["count"]
        np.testing.assert_array_equal(sum(p["sum_square"].astype(np.float64) for p in parts), want[key]["sum_square"])
        assert all((d / "stats_keys.txt").read_text().split() == ["mel", "mel_lengths"] for d in shard_dirs)


def test_a_rerun_recomputes_nothing_and_writes_the_same_stats(tmp_path):
    """ESPnet3's ``collect_stats(..., resume=True)`` (its author's branch): a second call over the same
    data finds every shard done, computes none, and writes the same ``*_stats.npz``."""
    provider = SyntheticStatsProvider({"n": 11})
    first = espnet3_collect_stats(provider, tmp_path, "train", 11, batch_size=2, shard_size=2)
    before = (tmp_path / "train" / "mel_stats.npz").read_bytes()
    marks = {d: (d / DONE).stat().st_mtime_ns for d in _shard_dirs(tmp_path / "train")}
    again = espnet3_collect_stats(SyntheticStatsProvider({"n": 11}), tmp_path, "train", 11, batch_size=2,
                                  shard_size=2)
    assert {d: (d / DONE).stat().st_mtime_ns for d in marks} == marks  # no shard recomputed
    assert int(again["count"]["mel"]) == int(first["count"]["mel"])
    with np.load(tmp_path / "train" / "mel_stats.npz") as a, np.load(__import__("io").BytesIO(before)) as b:
        for key in ("count", "sum", "sum_square"):
            np.testing.assert_array_equal(a[key], b[key])


def test_collected_feature_scps_name_published_files(tmp_path):
    """Mirrors what ``test_collect_stats_local_basic`` relies on with ``write_collected_feats=True``:
    every ``.npy`` the merged ``collect_feats/{key}.scp`` names exists and holds that utterance's
    features (ESPnet3 writes them in place; we stage and publish, so the scp must name the published
    files)."""
    provider = SyntheticStatsProvider({"n": 5, "write_collected_feats": True})
    espnet3_collect_stats(provider, tmp_path, "train", 5, batch_size=2, write_collected_feats=True)
    data = SyntheticUtterances(5)
    for line in (tmp_path / "train" / "collect_feats" / "mel.scp").read_text().splitlines():
        uid, path = line.split(maxsplit=1)
        assert Path(path).is_file(), f"{uid}: {path} does not exist"
        np.testing.assert_array_equal(np.load(path), 2.0 * data.features(int(uid)))


@pytest.mark.prefect
def test_runner_flow_runs_it_unchanged_with_the_same_stats(prefect_harness, tmp_path):
    """The same runner as a Prefect flow (``runner_flow(runner, index_batches)``): the same totals as
    ``runner(index_batches)`` in this process, and the same ``{key}_shape`` file."""
    from espnet3_flows.orchestration import runner_flow
    from tests.parallel.espnet3_runners import Espnet3SourceCollectStatsRunner

    batches = [list(range(i, min(i + 3, 13))) for i in range(0, 13, 3)]
    flowed = runner_flow(Espnet3SourceCollectStatsRunner(SyntheticStatsProvider({"n": 13}), tmp_path / "flow", "train",
                                                         shard_size=2),
                         batches, parallel={"env": "serial"}, progress=False)
    want = _reference(13, 3, 2, 2.0, False)
    for key in ("mel", "mel_lengths"):
        assert int(flowed["count"][key]) == want[key]["count"]
        np.testing.assert_array_equal(np.asarray(flowed["sum"][key], dtype=np.float64), want[key]["sum"])
        np.testing.assert_array_equal(np.asarray(flowed["sq"][key], dtype=np.float64), want[key]["sum_square"])
        assert (tmp_path / "flow" / "train" / f"{key}_shape").read_text().splitlines() == want[f"{key}_shape"]
