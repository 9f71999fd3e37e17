"""A HuggingFace dataset saved to disk as a manifest: the same stats as a TSV of the same audio,
with paths or with embedded bytes; reruns, touched files and per-shard reads."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import datasets  # a test dependency ([dev]): missing, this module fails to import, it is not skipped

from espnet3_flows.config import load_config
from espnet3_flows.inputs.demo import make_demo_corpus
from espnet3_flows.inputs.formats import detect_format
from espnet3_flows.inputs.formats import hf
from espnet3_flows.inputs.manifest import read_manifest_slice
from espnet3_flows.inputs.records import ManifestError
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner


def _config(manifest: str, out: Path, *overrides: str) -> CollectStatsConfig:
    return load_config(CollectStatsConfig, overrides=[f"manifests.train={manifest}", f"output_dir={out}",
                                                      "parallel.env=serial", "shard_size=4", *overrides])


def _run(manifest: str, out: Path):
    return CollectStatsRunner(_config(manifest, out), "train").run(progress=False)


def _outputs(out: Path) -> dict[str, object]:
    with np.load(out / "train" / "feats_stats.npz") as z:
        stats = {k: z[k] for k in z.files}
    return {"stats": stats, **{n: (out / "train" / n).read_text() for n in ("feats_shape", "speech_shape")}}


def _assert_same(a: dict, b: dict) -> None:
    assert a["feats_shape"] == b["feats_shape"] and a["speech_shape"] == b["speech_shape"]
    assert int(a["stats"]["count"]) == int(b["stats"]["count"])
    for key in ("sum", "sum_square"):
        np.testing.assert_array_equal(a["stats"][key], b["stats"][key])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_corpus")
    tsv = make_demo_corpus(root, n_utts=12, n_speakers=3, min_seconds=0.3, max_seconds=0.6, seed=3,
                           splits={"train": 1.0})["train"]
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    tsv_out = root / "tsv_out"
    _run(str(tsv), tsv_out)
    return root, rows, _outputs(tsv_out)


def _save(rows, path: Path, *, embed: bool, id_col: str = "id", audio_col: str = "audio") -> str:
    data = {id_col: [r[0] for r in rows], audio_col: [r[1] for r in rows],
            "speaker": [r[3] if len(r) > 3 else "" for r in rows]}
    ds = datasets.Dataset.from_dict(data)
    if embed:  # save_to_disk embeds an Audio column's files: the rows keep no usable path
        ds = ds.cast_column(audio_col, datasets.Audio(decode=False))
    ds.save_to_disk(str(path))
    return str(path)


def test_rows_with_paths_give_the_tsv_outputs_and_rerun_only_what_changed(corpus, tmp_path):
    root, rows, expected = corpus
    manifest = _save(rows, tmp_path / "ds_paths", embed=False)
    assert detect_format(manifest).name == "hf"
    out = tmp_path / "out"
    first = _run(manifest, out)
    assert first.computed == len(first.shards) > 1
    _assert_same(_outputs(out), expected)
    assert _run(manifest, out).computed == 0  # a rerun computes nothing

    touched = rows[5][1]
    st = os.stat(touched)
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    runner = CollectStatsRunner(_config(manifest, out), "train")
    plan = runner.plan()
    holder = next(s.index for s in plan.shards if s.start <= 5 < s.stop)
    again = runner.run(progress=False)
    assert [s.index for s in again.shards if not s.cached] == [holder]
    _assert_same(_outputs(out), expected)


def test_embedded_bytes_with_other_column_names_give_the_tsv_outputs(corpus, tmp_path):
    root, rows, expected = corpus
    directory = _save(rows, tmp_path / "ds_bytes", embed=True, id_col="key", audio_col="file")
    table = datasets.load_from_disk(directory).data.table
    assert all(v is not None for v in table.column("file").combine_chunks().field("bytes").to_pylist())
    manifest = f"{directory}?id=key&audio=file"
    out = tmp_path / "out"
    first = _run(manifest, out)
    assert first.computed == len(first.shards) > 1
    _assert_same(_outputs(out), expected)
    assert _run(manifest, out).computed == 0


def test_a_shard_reads_only_its_rows(corpus, tmp_path, monkeypatch):
    from espnet3_flows.inputs.audio import AudioConfig, load_audio

    _, rows, _ = corpus
    manifest = _save(rows, tmp_path / "ds_bytes", embed=True)
    runner = CollectStatsRunner(_config(manifest, tmp_path / "out"), "train")
    shard = runner.plan().shards[1]
    utts = read_manifest_slice(shard.source, "train")
    assert [u.utt_id for u in utts] == [r[0] for r in rows[shard.start:shard.stop]]

    read: list[int] = []
    column = hf._audio_column

    class Spy:
        def __init__(self, col):
            self.col = col

        def __getitem__(self, row):
            read.append(row)
            return self.col[row]

    monkeypatch.setattr(hf, "_audio_column", lambda *a: Spy(column(*a)))
    for u in utts:
        load_audio(u, AudioConfig())
    assert read == list(range(shard.start, shard.stop))


def test_bad_rows_are_named_and_skipped_under_skip(corpus, tmp_path):
    _, rows, _ = corpus
    bad = [list(r) for r in rows[:6]]
    bad[2][0] = "../escape"
    bad[4][0] = bad[1][0]  # a repeated id
    manifest = _save(bad, tmp_path / "ds_bad", embed=False)
    with pytest.raises(ManifestError, match=r"ds_bad:3: .*'\.\./escape'"):
        _run(manifest, tmp_path / "out_fail")
    runner = CollectStatsRunner(_config(manifest, tmp_path / "out_skip", "on_error=skip"), "train")
    runner.plan()
    assert sorted(s.line for s in runner.manifest_skipped()) == [3, 5]


def test_missing_datasets_package_is_one_clear_error(corpus, tmp_path, monkeypatch):
    _, rows, _ = corpus
    manifest = _save(rows[:3], tmp_path / "ds", embed=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ManifestError, match=r"needs the `datasets` package: pip install 'espnet3-flows\[hf\]'"):
        _run(manifest, tmp_path / "out")
