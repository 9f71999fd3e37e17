"""Unusual but legal utterance ids (non-ASCII letters, punctuation, the longest id accepted) through
collect-stats, extract-features and x-vectors: every scp and shape file written reads back with
kaldiio and ESPnet2's ``read_2columns_text`` with exactly the ids as keys, and every per-utterance
file (``{id}.npy``, ``{id}.pt``) is there."""

from __future__ import annotations

from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf
import torch
from espnet2.fileio.read_text import read_2columns_text

from espnet3_flows.config import load_config
from espnet3_flows.features.job import ExtractFeaturesConfig, FeatureRunner
from espnet3_flows.inputs.records import MAX_ID_BYTES, ManifestError
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from espnet3_flows.xvector.job import XVectorJobConfig, XVectorRunner
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

SR = 16000
#: legal today and unusual: letters of other scripts, quotes, brackets, shell characters, a
#: zero-width space (not whitespace to any reader), and the longest id (two-byte letters)
IDS = ["ü-spk_1", "话者1_発話", "a'b\"c", "x(1)[2]{3}", "a;b&c!d?e|f", "a\u200bb", "Ωmega~^`$",
       "é" * (MAX_ID_BYTES // 2)]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unusual")
    rng = np.random.default_rng(0)
    lines = []
    for i, utt in enumerate(IDS):
        wav = root / f"{i}.wav"  # the audio's own name is not under test
        sf.write(wav, (0.1 * rng.standard_normal(int(SR * (0.3 + 0.05 * i)))).astype(np.float32), SR)
        lines.append(f"{utt}\t{wav}\t\tspk{i % 2}\n")
    path = root / "train.tsv"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _read_back(split_dir: Path) -> dict[str, list[str]]:
    """Each scp, shape and utt2spk file below ``split_dir`` (shards aside) read with ESPnet2's reader, each
    scp of ark entries also with kaldiio: file name → keys (one check of kaldiio's keys inside)."""
    keys = {}
    for path in sorted(split_dir.rglob("*")):
        if "shards" in path.parts or not (path.suffix == ".scp" or path.name.endswith("_shape")
                                          or path.name == "utt2spk"):
            continue
        espnet = read_2columns_text(path)
        assert len(espnet) == len(path.read_text(encoding="utf-8").split("\n")) - 1, path  # no line lost or merged
        if path.suffix == ".scp" and ".ark:" in path.read_text(encoding="utf-8"):
            loaded = kaldiio.load_scp(str(path))
            assert list(loaded) == list(espnet), path
            for key in loaded:
                assert np.isfinite(loaded[key]).all()
        keys[str(path.relative_to(split_dir))] = sorted(espnet)
    return keys


def test_every_written_scp_and_shape_file_reads_back_with_the_ids_as_keys(manifest, tmp_path):
    ids = sorted(IDS)
    common = [f"manifests.train={manifest}", "parallel.env=serial", "shard_size=3"]

    stats = tmp_path / "stats"
    CollectStatsRunner(load_config(CollectStatsConfig, overrides=[
        *common, f"output_dir={stats}", "write_collected_feats=true", "collected_feats_format=npy"]), "train").run(
        progress=False)
    keys = _read_back(stats / "train")
    assert {"feats_shape", "speech_shape", "collect_feats/feats.scp"} <= set(keys)
    assert all(k == ids for k in keys.values()), keys
    for utt, npy in read_2columns_text(stats / "train" / "collect_feats" / "feats.scp").items():
        assert np.load(npy).ndim == 2, utt  # the longest id's file name fits

    feats = tmp_path / "feats"
    FeatureRunner(load_config(ExtractFeaturesConfig, overrides=[*common, f"output_dir={feats}"]), "train").run(
        progress=False)
    keys = _read_back(feats / "train")
    assert {"feats.scp", "feats_shape"} <= set(keys) and all(k == ids for k in keys.values()), keys

    xv = tmp_path / "xv"
    ecapa = build_random_ecapa_dir(tmp_path / "ecapa")
    XVectorRunner(load_config(XVectorJobConfig, overrides=[
        *common, f"output_dir={xv}", f"xvector.pretrained_model={ecapa}", "xvector.batch_size=4"]), "train").run(
        progress=False)
    split_dir = next(xv.rglob("xvector.scp")).parent  # below the model's tag, as ESPnet2 names it
    keys = _read_back(split_dir)
    by_utt = {k: v for k, v in keys.items() if not Path(k).name.startswith("spk")}
    assert {"xvector.scp", "utt2spk"} <= set(by_utt) and all(v == ids for v in by_utt.values()), keys
    pts = sorted(p for p in split_dir.rglob("*.pt") if "shards" not in p.parts)
    assert sorted(p.name[: -len(".pt")] for p in pts) == ids
    assert all(torch.load(p, weights_only=True).ndim == 1 for p in pts)


@pytest.mark.parametrize("job,bad_id", [("stats", "a\u3000b"), ("stats", "c\u00a0d"), ("stats", "e\u2028f"),
                                        ("stats", "g\x85h"), ("xvector", "x" * 252)])
def test_an_id_the_readers_would_split_or_too_long_for_its_files_is_refused_at_planning(manifest, tmp_path, job,
                                                                                          bad_id):
    lines = manifest.read_text(encoding="utf-8").splitlines(keepends=True)
    bad = tmp_path / "train.tsv"
    bad.write_bytes("".join([*lines[:2], bad_id + lines[2][lines[2].index("\t"):], *lines[3:]]).encode("utf-8"))
    common = [f"manifests.train={bad}", "parallel.env=serial", "shard_size=3", f"output_dir={tmp_path / 'out'}"]
    if job == "stats":
        runner = CollectStatsRunner(load_config(CollectStatsConfig, overrides=common), "train")
    else:
        ecapa = build_random_ecapa_dir(tmp_path / "ecapa")
        runner = XVectorRunner(load_config(XVectorJobConfig, overrides=[
            *common, f"xvector.pretrained_model={ecapa}"]), "train")
    with pytest.raises(ManifestError) as err:  # the CLI's exit status 2, one line
        runner.run(progress=False)
    assert f"{bad}:3:" in str(err.value) and repr(bad_id)[:40] in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file() and "shards" not in p.parts
                and p.name != "owner.json"]  # nothing published
