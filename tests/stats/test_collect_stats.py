"""Collect-stats end to end on generated audio: ESPnet2 outputs, exact stats, frontends, resume, remote outputs."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf
import torch

from espnet3_flows import external_sort
from espnet3_flows.config import load_config
from espnet3_flows.inputs.demo import make_demo_corpus
from espnet3_flows.errors import ShardFailure
from espnet3_flows.sharding import ShardPlan, shard_size_bounds
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from espnet3_flows.stats.outputs import espnet_mvn
from tests.support.floats import REL, assert_same_floats

SR = 16000


class TinyFrontend(torch.nn.Module):
    """A model frontend for tests: frames of ``hop`` samples, their first ``dim`` samples times ``scale``.

    ``scale`` has no default, so a run only works when ``collect_stats_kwargs`` reaches
    ``collect_feats``.
    """

    def __init__(self, hop: int = 160, dim: int = 4):
        super().__init__()
        self.hop, self.dim = hop, dim

    def collect_feats(self, speech: torch.Tensor, speech_lengths: torch.Tensor, *, scale: float, **kwargs):
        frames = speech.shape[1] // self.hop
        feats = speech[:, : frames * self.hop].reshape(speech.shape[0], frames, self.hop)[:, :, : self.dim]
        return {"feats": feats * scale, "feats_lengths": speech_lengths // self.hop}


# ---- helpers -------------------------------------------------------------------------------
def _corpus(root: Path, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` short generated utterances: (utt_id, absolute wav path) in manifest order."""
    manifest = make_demo_corpus(root, n_utts=n, n_speakers=3, min_seconds=0.3, max_seconds=0.7, seed=seed,
                                splits={"train": 1.0})["train"]
    return [tuple(line.split("\t")[:2]) for line in manifest.read_text().splitlines()]  # type: ignore[misc]


def _write_manifest(path: Path, rows: list[tuple[str, str]]) -> str:
    path.write_text("".join(f"{u}\t{p}\n" for u, p in rows))
    return str(path)


def _config(manifest: str, output_dir: str, *overrides: str, base: dict | None = None) -> CollectStatsConfig:
    return load_config(CollectStatsConfig, base=base, overrides=[
        f"manifests.train={manifest}", f"output_dir={output_dir}", "parallel.env=serial", *overrides])


def _run(cfg: CollectStatsConfig, client=None):
    runner = CollectStatsRunner(cfg, "train")
    return runner.run(client=client, progress=False)


def _npz(path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _fbank(samples: np.ndarray) -> np.ndarray:
    from lhotse import Fbank, FbankConfig

    return np.asarray(Fbank(FbankConfig(sampling_rate=SR, num_mel_bins=80, dither=0.0)).extract(samples, SR))


def _shape_file(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(" ")) for line in path.read_text().splitlines()]  # type: ignore[misc]


def _shard_of(plan: ShardPlan, position: int) -> int:
    """Index of the shard that holds the utterance at ``position`` (manifest order)."""
    return next(s.index for s in plan.shards if s.start <= position < s.stop)


def _assert_same_stats(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rel: float = REL) -> None:
    """Two runs' stats: other processes and merge orders move last bits (``rel=0``: copies)."""
    assert int(a["count"]) == int(b["count"])
    for key in ("sum", "sum_square"):
        assert_same_floats(a[key], b[key], rel)


# ---- the main run, shared by several checks --------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[tuple[str, str]]]:
    root = tmp_path_factory.mktemp("corpus")
    rows = _corpus(root, 30)
    return _write_manifest(root / "train.tsv", rows), rows


@pytest.fixture(scope="module")
def main_run(corpus, tmp_path_factory):
    manifest, rows = corpus
    out = tmp_path_factory.mktemp("main_out")
    outcome = _run(_config(manifest, str(out), "shard_size=7", "batch_size=4", "write_collected_feats=true"))
    return out, outcome


def test_espnet2_outputs_and_exact_normalisation(main_run, corpus):
    out, outcome = main_run
    _, rows = corpus
    npz = _npz(out / "train" / "feats_stats.npz")
    assert set(npz) == {"count", "sum", "sum_square"}
    assert np.issubdtype(npz["count"].dtype, np.integer) and npz["count"].shape == ()
    assert npz["sum"].dtype == np.float64 and npz["sum"].shape == (80,)
    assert npz["sum_square"].dtype == np.float64 and npz["sum_square"].shape == (80,)

    manifest_order = [u for u, _ in rows]
    scp_path = out / "train" / "collect_feats" / "feats.scp"
    # merged per-utterance outputs follow the manifest, shard by shard
    assert [line.split(" ", 1)[0] for line in scp_path.read_text().splitlines()] == manifest_order
    feats = dict(kaldiio.load_scp(str(scp_path)))
    assert sorted(feats) == sorted(manifest_order)
    for utt, path in rows:
        samples, rate = sf.read(path, dtype="float32")
        assert rate == SR
        # the fast fbank equals lhotse's to float32 rounding (tests/frontends/test_fbank.py)
        np.testing.assert_allclose(feats[utt], _fbank(samples), rtol=0, atol=1e-5)

    allfeats = np.concatenate([feats[u] for u, _ in rows]).astype(np.float64)
    assert int(npz["count"]) == allfeats.shape[0]
    mean, std = espnet_mvn(npz)
    normed = (allfeats - mean) / std
    np.testing.assert_allclose(normed.mean(axis=0), 0.0, atol=1e-6)
    np.testing.assert_allclose(normed.std(axis=0), 1.0, atol=1e-6)

    feats_shape = _shape_file(out / "train" / "feats_shape")
    assert [u for u, _ in feats_shape] == sorted(manifest_order)  # as ESPnet2's aggregate_stats_dirs sorts
    for utt, shape in feats_shape:
        assert shape == f"{feats[utt].shape[0]},80"
    speech_shape = _shape_file(out / "train" / "speech_shape")
    assert [u for u, _ in speech_shape] == sorted(manifest_order)
    frames_by_path = {u: sf.info(p).frames for u, p in rows}
    assert {u: int(n) for u, n in speech_shape} == frames_by_path
    assert (out / "train" / "stats_keys").read_text() == "feats\nfeats_lengths\n"  # as ESPnet2 writes them
    lengths = _npz(out / "train" / "feats_lengths_stats.npz")
    frames = [feats[u].shape[0] for u in manifest_order]
    assert {k: int(v) for k, v in lengths.items()} == {"count": len(frames), "sum": sum(frames),
                                                       "sum_square": sum(f * f for f in frames)}
    assert (out / "train" / "batch_keys").read_text() == "speech\n"
    assert "_lengths" not in (out / "train" / "batch_keys").read_text()


def test_lhotse_global_mvn_file(main_run):
    from lhotse.dataset.signal_transforms import GlobalMVN

    out, _ = main_run
    npz = _npz(out / "train" / "feats_stats.npz")
    mvn = GlobalMVN.from_file(str(out / "train" / "lhotse_global_mvn.pt"))
    mean, std = espnet_mvn(npz)
    np.testing.assert_allclose(mvn.norm_means.numpy(), npz["sum"] / npz["count"], rtol=1e-6)
    np.testing.assert_allclose(mvn.norm_stds.numpy(), std, rtol=1e-6)
    assert torch.load(out / "train" / "lhotse_global_mvn.pt", weights_only=True)["norm_means"].shape == (80,)


def test_summary_json(main_run, corpus):
    out, outcome = main_run
    _, rows = corpus
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary == {k: v for k, v in outcome.merged.items() if k != "files"} | {"files": summary["files"]}
    frames = [int(s.split(",")[0]) for _, s in _shape_file(out / "train" / "feats_shape")]
    samples = sum(sf.info(p).frames for _, p in rows)
    assert summary["split"] == "train"
    assert summary["utterances"] == len(rows) == 30
    assert summary["frames"] == sum(frames)
    assert summary["frames_min"] == min(frames) and summary["frames_max"] == max(frames)
    assert summary["seconds"] == pytest.approx(samples / SR)
    assert summary["feature_dim"] == 80 and summary["frontend"] == "fbank"
    assert summary["skipped"] == 0
    n_shards = len(outcome.plan.shards)  # content-defined: the plan decides how many
    assert n_shards > 1
    assert summary["shards"] == n_shards and summary["shards_computed"] == n_shards and summary["shards_cached"] == 0
    assert summary["plan_digest"] == outcome.plan.digest
    assert {"feats_stats.npz", "feats_shape", "speech_shape", "stats_keys", "batch_keys", "skipped.tsv",
            "collect_feats/feats.scp"} <= set(summary["files"])
    assert (out / "train" / "skipped.tsv").read_text().splitlines() == ["split\tutt_id\tline\tpath\treason"]


def test_shard_size_does_not_change_stats(main_run, corpus, tmp_path):
    out, outcome = main_run
    manifest, _ = corpus
    # shard_size=7 cuts the 30 utterances into several content-defined shards of bounded size
    lo, hi, _ = shard_size_bounds(7)
    sizes = [s.num_items for s in outcome.plan.shards]
    assert len(sizes) > 1 and sum(sizes) == 30
    assert all(lo <= n <= hi for n in sizes[:-1]) and 1 <= sizes[-1] <= hi
    single = _run(_config(manifest, str(tmp_path), "shard_size=1000"))
    assert len(single.plan.shards) == 1
    _assert_same_stats(_npz(out / "train" / "feats_stats.npz"), _npz(tmp_path / "train" / "feats_stats.npz"))
    assert (out / "train" / "feats_shape").read_text() == (tmp_path / "train" / "feats_shape").read_text()


def test_every_published_scp_names_files_that_exist(main_run):
    """Each shard's own feats.scp as well as the merged one: none points into a staging directory."""
    out, _ = main_run
    merged = dict(kaldiio.load_scp(str(out / "train" / "collect_feats" / "feats.scp")))
    shard_scps = sorted((out / "train" / "shards").glob("split.*/feats.scp"))
    assert len(shard_scps) > 1
    seen = set()
    for scp in shard_scps:
        for line in scp.read_text().splitlines():
            assert line.split(" ", 1)[1].startswith(str(out / "train" / "collect_feats") + "/feats.split."), line
        for utt, feats in kaldiio.load_scp(str(scp)).items():
            np.testing.assert_array_equal(feats, merged[utt])
            seen.add(utt)
    assert seen == set(merged)


def test_outputs_linked_to_a_pretrained_model_are_replaced_not_written_through(main_run, corpus, tmp_path):
    out, _ = main_run
    manifest, _ = corpus
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    names = ("feats_stats.npz", "feats_shape", "summary.json")
    (tmp_path / "out" / "train").mkdir(parents=True)
    for name in names:
        (pretrained / name).write_bytes(b"the pretrained model's " + name.encode())
        (tmp_path / "out" / "train" / name).symlink_to(pretrained / name)
    _run(_config(manifest, str(tmp_path / "out")))
    for name in names:
        assert (pretrained / name).read_bytes() == b"the pretrained model's " + name.encode()
        assert not (tmp_path / "out" / "train" / name).is_symlink()
    _assert_same_stats(_npz(tmp_path / "out" / "train" / "feats_stats.npz"), _npz(out / "train" / "feats_stats.npz"))


def test_shape_files_are_sorted_by_id_whatever_the_manifest_order(main_run, corpus, tmp_path, monkeypatch):
    """ESPnet2 sorts shape files by utterance id (aggregate_stats_dirs.py); a shuffled manifest
    over several shards, merged through runs on disk, gives the same files byte for byte."""
    out, _ = main_run
    _, rows = corpus
    shuffled = sorted(rows, key=lambda r: r[0][::-1])  # an order unrelated to the ids
    assert shuffled != sorted(rows)
    monkeypatch.setattr(external_sort, "CHUNK_ROWS", 4)  # several runs merged from local disk
    _run(_config(_write_manifest(tmp_path / "shuffled.tsv", shuffled), str(tmp_path / "out"), "shard_size=7"))
    for name in ("feats_shape", "speech_shape"):
        text = (tmp_path / "out" / "train" / name).read_text()
        assert text == (out / "train" / name).read_text()
        ids = [line.split(" ", 1)[0] for line in text.splitlines()]
        assert ids == sorted(u for u, _ in rows)


@pytest.mark.dask
def test_on_a_real_dask_cluster(main_run, corpus, tmp_path, dask_client):
    out, _ = main_run
    manifest, _ = corpus
    cfg = _config(manifest, str(tmp_path), "shard_size=7", "batch_size=4", "write_collected_feats=true")
    outcome = _run(cfg, client=dask_client)
    n_shards = len(outcome.plan.shards)
    assert n_shards > 1 and [s.hash for s in outcome.plan.shards] == [s.hash for s in main_run[1].plan.shards]
    assert outcome.computed == n_shards and outcome.cached == 0
    _assert_same_stats(_npz(out / "train" / "feats_stats.npz"), _npz(tmp_path / "train" / "feats_stats.npz"))
    for name in ("feats_shape", "speech_shape", "stats_keys", "batch_keys"):
        assert (tmp_path / "train" / name).read_text() == (out / "train" / name).read_text()
    ours = dict(kaldiio.load_scp(str(tmp_path / "train" / "collect_feats" / "feats.scp")))
    ref = dict(kaldiio.load_scp(str(out / "train" / "collect_feats" / "feats.scp")))
    assert sorted(ours) == sorted(ref)
    for utt in ref:
        assert_same_floats(ours[utt], ref[utt])  # workers' features and this process's
    # a rerun on the cluster resumes from the done records
    again = _run(cfg, client=dask_client)
    assert again.computed == 0 and again.cached == n_shards


def test_lhotse_cutset_manifest_gives_the_same_stats(main_run, corpus, tmp_path):
    from lhotse import CutSet, MonoCut, Recording

    out, _ = main_run
    _, rows = corpus
    cuts = []
    for utt, path in rows:
        rec = Recording.from_file(path, recording_id=utt)
        cuts.append(MonoCut(id=utt, start=0.0, duration=rec.duration, channel=0, recording=rec))
    cutset_path = tmp_path / "cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(cutset_path)
    lhotse_out = tmp_path / "out"
    outcome = _run(_config(str(cutset_path), str(lhotse_out), "shard_size=7"))
    assert outcome.merged["utterances"] == len(rows)
    _assert_same_stats(_npz(out / "train" / "feats_stats.npz"), _npz(lhotse_out / "train" / "feats_stats.npz"))
    for name in ("feats_shape", "speech_shape"):
        assert (lhotse_out / "train" / name).read_text() == (out / "train" / name).read_text()


# ---- sampling rates and channels ---------------------------------------------------------------
def _tone(freq: float, seconds: float, sr: int) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory):
    """A 16 kHz mono file, an 8 kHz mono file and a 2-channel file whose channels sound different."""
    root = tmp_path_factory.mktemp("mixed")
    sf.write(root / "mono16.wav", _tone(440, 0.5, SR), SR, subtype="FLOAT")
    sf.write(root / "mono8.wav", _tone(440, 0.5, 8000), 8000, subtype="FLOAT")
    stereo = np.stack([_tone(300, 0.6, SR), _tone(3000, 0.6, SR) + 0.05 * _tone(5100, 0.6, SR)], axis=1)
    sf.write(root / "stereo.wav", stereo, SR, subtype="FLOAT")
    rows = [("a-mono16", str(root / "mono16.wav")), ("b-mono8", str(root / "mono8.wav")),
            ("c-stereo", str(root / "stereo.wav"))]
    return _write_manifest(root / "train.tsv", rows), root, stereo


def test_resampling_and_channel_choice(mixed_corpus, tmp_path):
    from scipy.signal import resample_poly

    manifest, root, stereo = mixed_corpus
    runs = {}
    for name, extra in (("mean", []), ("ch1", ["frontend.channel=1"])):
        _run(_config(manifest, str(tmp_path / name), "write_collected_feats=true", *extra))
        runs[name] = dict(kaldiio.load_scp(str(tmp_path / name / "train" / "collect_feats" / "feats.scp")))
        speech = dict(_shape_file(tmp_path / name / "train" / "speech_shape"))
        assert int(speech["b-mono8"]) == 2 * sf.info(root / "mono8.wav").frames == 8000
        assert int(speech["a-mono16"]) == 8000
        feats_shape = dict(_shape_file(tmp_path / name / "train" / "feats_shape"))
        assert feats_shape["b-mono8"] == f"{runs[name]['b-mono8'].shape[0]},80"

    up = resample_poly(sf.read(root / "mono8.wav", dtype="float32")[0].astype(np.float64), 2, 1).astype(np.float32)
    np.testing.assert_allclose(runs["mean"]["b-mono8"], _fbank(up), rtol=1e-5, atol=1e-4)
    # below the old Nyquist, a 440 Hz tone at 8 kHz, resampled, looks like the same tone recorded at 16 kHz
    np.testing.assert_allclose(runs["mean"]["b-mono8"][5:-5, :60], runs["mean"]["a-mono16"][5:-5, :60], atol=0.5)

    np.testing.assert_allclose(runs["ch1"]["c-stereo"], _fbank(stereo[:, 1]), rtol=0, atol=1e-5)
    mean = stereo.astype(np.float64).mean(axis=1).astype(np.float32)
    np.testing.assert_allclose(runs["mean"]["c-stereo"], _fbank(mean), rtol=1e-5, atol=1e-4)
    assert np.abs(runs["ch1"]["c-stereo"] - runs["mean"]["c-stereo"]).max() > 1.0
    assert np.abs(_fbank(stereo[:, 0]) - runs["mean"]["c-stereo"]).max() > 1.0


# ---- other frontends -----------------------------------------------------------------------
def test_frontend_none_writes_speech_shape_from_headers_only(mixed_corpus, tmp_path, monkeypatch):
    manifest, root, _ = mixed_corpus

    def no_decoding(*args, **kwargs):
        raise AssertionError("frontend.type=none must not decode audio")

    monkeypatch.setattr(sf, "read", no_decoding)
    monkeypatch.setattr(sf.SoundFile, "read", no_decoding)
    outcome = _run(_config(manifest, str(tmp_path), "frontend.type=none"))
    split = tmp_path / "train"
    assert not (split / "feats_stats.npz").exists()
    assert not (split / "feats_shape").exists()
    assert not (split / "lhotse_global_mvn.pt").exists()
    assert (split / "stats_keys").read_text() == ""
    assert (split / "batch_keys").read_text() == "speech\n"
    assert _shape_file(split / "speech_shape") == [("a-mono16", "8000"), ("b-mono8", "8000"), ("c-stereo", "9600")]
    assert outcome.merged["frontend"] == "none" and outcome.merged["feature_dim"] is None
    assert outcome.merged["utterances"] == 3 and outcome.merged["frames"] == 0


def test_model_frontend_with_collect_stats_kwargs(corpus, tmp_path):
    manifest, rows = corpus
    target = "tests.stats.test_collect_stats.TinyFrontend"
    cfg = _config(manifest, str(tmp_path), "frontend.type=model", f"frontend.model._target_={target}",
                  "frontend.model.hop=200", "frontend.model.dim=3", "collect_stats_kwargs.scale=3.0",
                  "shard_size=8", "batch_size=5")
    outcome = _run(cfg)
    assert outcome.merged["feature_dim"] == 3
    expected, shapes = [], {}
    for utt, path in rows:
        x, _ = sf.read(path, dtype="float32")
        frames = len(x) // 200
        expected.append(3.0 * x[: frames * 200].reshape(frames, 200)[:, :3].astype(np.float64))
        shapes[utt] = f"{frames},3"
    ref = np.concatenate(expected)
    npz = _npz(tmp_path / "train" / "feats_stats.npz")
    assert int(npz["count"]) == ref.shape[0]
    np.testing.assert_allclose(npz["sum"], ref.sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(npz["sum_square"], np.square(ref).sum(axis=0), rtol=1e-6)
    assert dict(_shape_file(tmp_path / "train" / "feats_shape")) == shapes

    # without the kwarg the model cannot run: the kwargs really are what reaches collect_feats
    bare = _config(manifest, str(tmp_path / "bare"), "frontend.type=model", f"frontend.model._target_={target}")
    with pytest.raises(ShardFailure, match="scale") as err:
        _run(bare)
    assert isinstance(err.value.__cause__, TypeError)


# ---- resume ------------------------------------------------------------------------------
def test_resume_append_and_touch(tmp_path):
    rows = _corpus(tmp_path / "data", 44, seed=3)
    manifest = tmp_path / "train.tsv"
    out = tmp_path / "out"
    cfg = _config(str(manifest), str(out), "shard_size=6", "batch_size=3")

    _write_manifest(manifest, rows[:40])
    first = _run(cfg)
    n_first = len(first.plan.shards)
    assert n_first > 1 and (first.computed, first.cached) == (n_first, 0)
    stats_first = _npz(out / "train" / "feats_stats.npz")

    again = _run(cfg)
    assert (again.computed, again.cached) == (0, n_first)
    assert again.merged["shards_cached"] == n_first and again.merged["shards_computed"] == 0
    _assert_same_stats(stats_first, _npz(out / "train" / "feats_stats.npz"), rel=0)

    _write_manifest(manifest, rows)  # 10% more lines
    grown = _run(cfg)
    n_grown = len(grown.plan.shards)
    assert n_grown > n_first
    # every closed shard but the last keeps its hash and is cached; only the last shard of the
    # first run (if the appended lines change it) and the new shards are computed
    kept = n_first - 1
    assert [s.hash for s in grown.plan.shards[:kept]] == [s.hash for s in first.plan.shards[:kept]]
    # True when line 40 ended a shard by content: then that shard is unchanged too
    last_unchanged = grown.plan.shards[kept].hash == first.plan.shards[-1].hash
    recomputed = [s.index for s in grown.shards if not s.cached]
    assert recomputed == list(range(kept + last_unchanged, n_grown))
    assert (grown.computed, grown.cached) == (len(recomputed), n_grown - len(recomputed))
    assert grown.merged["utterances"] == 44

    fresh = tmp_path / "fresh"
    _run(_config(str(manifest), str(fresh), "shard_size=44"))
    _assert_same_stats(_npz(fresh / "train" / "feats_stats.npz"), _npz(out / "train" / "feats_stats.npz"))

    # rewriting one wav (new content and mtime) recomputes only its shard
    utt, path = rows[14]
    x, rate = sf.read(path, dtype="float32")
    sf.write(path, 0.5 * x, rate, subtype="PCM_16")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    touched = _run(cfg)
    # the boundaries follow the ids, not the files: the plan keeps its shape
    assert [(s.start, s.stop) for s in touched.plan.shards] == [(s.start, s.stop) for s in grown.plan.shards]
    assert [s.index for s in touched.shards if not s.cached] == [_shard_of(touched.plan, 14)]
    assert (touched.computed, touched.cached) == (1, n_grown - 1)
    assert not np.array_equal(_npz(out / "train" / "feats_stats.npz")["sum"],
                              _npz(fresh / "train" / "feats_stats.npz")["sum"])


# ---- remote outputs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    rows = _corpus(root, 8, seed=5)
    manifest = _write_manifest(root / "train.tsv", rows)
    local = root / "local_out"
    _run(_config(manifest, str(local), "shard_size=3"))
    return manifest, local


def _check_remote(fs, prefix: str, local: Path, n_shards: int, etags: bool = False) -> None:
    import io

    with np.load(io.BytesIO(fs.cat_file(f"{prefix}/train/feats_stats.npz"))) as z:
        remote = {k: z[k] for k in z.files}
    _assert_same_stats(_npz(local / "train" / "feats_stats.npz"), remote)
    for name in ("feats_shape", "speech_shape", "stats_keys", "batch_keys"):
        assert fs.cat_file(f"{prefix}/train/{name}") == (local / "train" / name).read_bytes()
    summary = json.loads(fs.cat_file(f"{prefix}/train/summary.json"))
    assert summary["utterances"] == 8 and summary["shards"] == n_shards
    if etags:  # as S3 gave them: the check reads nothing
        assert all(d.get("etag") for d in summary["digests"].values())
    digests = {name: {k: v for k, v in d.items() if k != "etag"} for name, d in summary["digests"].items()}
    assert {**summary, "digests": digests} == json.loads((local / "train" / "summary.json").read_text()) | {
        k: summary[k] for k in ("files", "shards_computed", "shards_cached", "compute_seconds")}
    plan = json.loads(fs.cat_file(f"{prefix}/train/shards/manifest.json"))
    assert len(plan["shards"]) == n_shards
    for shard in plan["shards"]:  # each done record in its content-named directory
        done = json.loads(fs.cat_file(f"{prefix}/train/shards/split.{shard['hash'][:16]}/done"))
        assert done["shard_hash"] == shard["hash"]
    assert not [p for p in fs.find(prefix) if ".tmp-" in p]


def test_output_on_memory_filesystem(small_corpus):
    import fsspec

    manifest, local = small_corpus
    url = f"memory://stats-{uuid.uuid4().hex}"
    cfg = _config(manifest, url, "shard_size=3")
    first = _run(cfg)
    n_shards = len(first.plan.shards)
    assert n_shards > 1 and first.computed == n_shards
    assert first.merged["files"]["summary.json"].startswith("memory://")
    fs = fsspec.filesystem("memory")
    _check_remote(fs, fsspec.core.strip_protocol(url), local, n_shards)
    assert _run(cfg).computed == 0
    fs.rm(fsspec.core.strip_protocol(url), recursive=True)


@pytest.mark.s3
def test_output_on_s3(small_corpus, s3_output):
    import s3fs

    manifest, local = small_corpus
    url, options = s3_output
    cfg = _config(manifest, url, "shard_size=3", base={"storage_options": options})
    first = _run(cfg)
    n_shards = len(first.plan.shards)
    assert n_shards > 1 and first.computed == n_shards
    assert first.merged["files"]["feats_stats.npz"] == f"{url}/train/feats_stats.npz"
    fs = s3fs.S3FileSystem(**options)
    _check_remote(fs, url.removeprefix("s3://"), local, n_shards, etags=True)
    again = _run(cfg)
    assert (again.computed, again.cached) == (0, n_shards)


def test_a_rewritten_manifest_is_reread_in_the_same_process(tmp_path):
    rows = _corpus(tmp_path / "data", 10, seed=9)
    manifest = tmp_path / "train.tsv"
    _write_manifest(manifest, rows[:5])
    cfg = _config(str(manifest), str(tmp_path / "out"), "shard_size=5")
    first = _run(cfg)
    assert first.merged["utterances"] == 5
    # same number of lines, other utterances: nothing may come from the first run (no cached manifest)
    _write_manifest(manifest, rows[5:])
    st = os.stat(manifest)
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    second = _run(cfg)
    assert second.merged["utterances"] == 5 and second.cached == 0
    ids = [u for u, _ in _shape_file(tmp_path / "out" / "train" / "feats_shape")]
    assert ids == sorted(u for u, _ in rows[5:])
    speech = {u: int(n) for u, n in _shape_file(tmp_path / "out" / "train" / "speech_shape")}
    assert speech == {u: sf.info(p).frames for u, p in rows[5:]}


@pytest.mark.parametrize("frontend", ["fbank", "none"])
def test_native_rates_are_recorded_and_mostly_low_rate_input_warns(tmp_path, frontend, caplog):
    root = tmp_path / "audio"
    root.mkdir()
    rows = []
    for i, rate in enumerate([8000, 8000, 8000, 16000]):
        path = root / f"u{i}.wav"
        sf.write(path, _tone(300 + 50 * i, 0.5, rate), rate, subtype="FLOAT")
        rows.append(f"u{i}\t{path}")
    manifest = tmp_path / "train.tsv"
    manifest.write_text("\n".join(rows) + "\n")
    with caplog.at_level("WARNING", logger="espnet3_flows"):
        summary = _run(_config(manifest, str(tmp_path / "out"), f"frontend.type={frontend}")).merged
    assert summary["native_sampling_rates"] == {"8000": 3, "16000": 1}
    assert len(summary["warnings"]) == 1
    warning = summary["warnings"][0]
    assert "3 of 4 utterances" in warning and "frontend.sampling_rate=8000" in warning
    assert warning in caplog.text
    written = json.loads((tmp_path / "out" / "train" / "summary.json").read_text())
    assert written["native_sampling_rates"] == {"8000": 3, "16000": 1} and written["warnings"] == [warning]

    # at the data's own rate: nothing to warn about
    again = _run(_config(manifest, str(tmp_path / "out8"), f"frontend.type={frontend}",
                         "frontend.sampling_rate=8000")).merged
    assert "warnings" not in again and again["native_sampling_rates"] == {"8000": 3, "16000": 1}


def test_a_torch_frontends_statistics_stay_where_they_are_computed(corpus, tmp_path, monkeypatch):
    """Without features written, a torch frontend's features are summed up where they are computed
    (the CPU here, by a GPU's code) and never handed back: the statistics and shapes equal the
    run that writes the features, within float64 rounding."""
    from espnet3_flows.frontends.wave_frontends import TorchFrontend

    manifest, _ = corpus
    target = "tests.stats.test_collect_stats.TinyFrontend"
    common = ["frontend.type=model", f"frontend.model._target_={target}", "frontend.model.hop=200",
              "frontend.model.dim=3", "collect_stats_kwargs.scale=3.0", "frontend.max_batch_samples=40000",
              "shard_size=8", "batch_size=5"]
    written = _run(_config(manifest, str(tmp_path / "written"), *common, "write_collected_feats=true"))

    def no_features(self, waves, kwargs):
        raise AssertionError("features were handed back to the host")

    monkeypatch.setattr(TorchFrontend, "__call__", no_features)
    kept = _run(_config(manifest, str(tmp_path / "kept"), *common))
    assert kept.merged["feature_dim"] == written.merged["feature_dim"] == 3
    _assert_same_stats(_npz(tmp_path / "kept" / "train" / "feats_stats.npz"),
                       _npz(tmp_path / "written" / "train" / "feats_stats.npz"), rel=1e-6)
    for name in ("feats_shape", "speech_shape"):
        assert (tmp_path / "kept" / "train" / name).read_text() == (tmp_path / "written" / "train" / name).read_text()
    summary = [json.loads((tmp_path / d / "train" / "summary.json").read_text()) for d in ("kept", "written")]
    assert summary[0]["frames"] == summary[1]["frames"]
    # the padding of the frontend's batches, measured where it computed the moments (and only there)
    assert 0.0 < summary[0]["padding_fraction"] < 0.5 and "padding_fraction" not in summary[1]


class NaNForLongFrontend(TinyFrontend):
    """:class:`TinyFrontend` whose features are NaN for utterances over ``limit`` samples."""

    def __init__(self, limit: int, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit

    def collect_feats(self, speech, speech_lengths, **kwargs):
        out = super().collect_feats(speech, speech_lengths, **kwargs)
        out["feats"][speech_lengths > self.limit] = float("nan")
        return out


@pytest.mark.parametrize("written", [False, True], ids=["moments on the device", "features handed back"])
def test_an_utterance_with_nan_features_on_the_device_is_skipped_alone(corpus, tmp_path, written):
    """Found where the features were computed either way: with the moments, or with the features
    handed back (``write_collected_feats``: one flag per utterance comes back with them)."""
    manifest, rows = corpus
    lengths = {utt: sf.info(path).frames for utt, path in rows}
    limit = sorted(lengths.values())[-3]  # the two longest get NaN features
    common = ["frontend.type=model", "frontend.model.hop=200", "frontend.model.dim=3", "collect_stats_kwargs.scale=1.0",
              "frontend.max_batch_samples=40000", "shard_size=8", "batch_size=5", f"write_collected_feats={written}"]
    bad = _run(_config(manifest, str(tmp_path / "bad"), *common, "on_error=skip",
                       "frontend.model._target_=tests.stats.test_collect_stats.NaNForLongFrontend",
                       f"frontend.model.limit={limit}"))
    kept = [(u, p) for u, p in rows if lengths[u] <= limit]
    clean = _run(_config(_write_manifest(tmp_path / "clean.tsv", kept), str(tmp_path / "clean"), *common,
                         "frontend.model._target_=tests.stats.test_collect_stats.TinyFrontend"))
    assert bad.merged["feature_dim"] == clean.merged["feature_dim"]
    _assert_same_stats(_npz(tmp_path / "bad" / "train" / "feats_stats.npz"),
                       _npz(tmp_path / "clean" / "train" / "feats_stats.npz"), rel=1e-6)
    assert json.loads((tmp_path / "bad" / "train" / "summary.json").read_text())["skipped"] == 2 == len(rows) - len(kept)
    skipped = (tmp_path / "bad" / "train" / "skipped.tsv").read_text().splitlines()[1:]
    assert sorted(line.split("\t")[1] for line in skipped) == sorted(u for u, _ in rows if lengths[u] > limit)
    assert all("NaN or Inf" in line for line in skipped)


def test_a_subclass_written_for_the_earlier_hook_names_extends_the_jobs_own(corpus, tmp_path):
    """A user's subclass of the job's runner that overrides ``shard_env`` / ``shard_env_keys`` (the
    hooks' earlier names) is called where the engine asks for ``shard_resources`` /
    ``shard_resource_keys``, and its ``super()`` gets what the job itself adds (the shard's
    ``dataset``, ``feats_format``)."""

    class Tagged(CollectStatsRunner):
        def shard_env(self, shard, env):
            return {**super().shard_env(shard, env), "tag": "mine"}

        def shard_env_keys(self):
            return (*super().shard_env_keys(), "tag")

    runner = Tagged(_config(corpus[0], str(tmp_path), "shard_size=7"), "train")
    shard = runner.plan().shards[0]
    resources = runner.shard_resources(shard, {"frontend": None})
    assert resources["tag"] == "mine" and resources["feats_format"] is None and resources["frontend"] is None
    assert len(resources["dataset"]) == shard.num_items and resources["split"] == "train"
    assert runner.shard_resource_keys() == ("dataset", "split", "outputs_rel", "tag")
