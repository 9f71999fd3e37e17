"""A saved Hugging Face dataset's fingerprint (``espnet3_flows.inputs.formats.hf_fingerprint``):
``datasets``' private one where the switch allows it, else one from the dataset's files; either
changes when the dataset on disk does, and a run with every patch off gives the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from espnet3_flows import patches
from espnet3_flows.inputs.formats.hf_fingerprint import PUBLIC_PREFIX, dataset_fingerprint

datasets = pytest.importorskip("datasets")


def _saved(path: Path, ids: list[str]) -> object:
    datasets.Dataset.from_dict({"id": ids, "audio": [f"/a/{i}.wav" for i in ids]}).save_to_disk(str(path))
    return datasets.load_from_disk(str(path))


@pytest.mark.parametrize("switch, public", [("", False), ("-dataset_fingerprint", True), ("off", True)])
def test_the_fingerprint_follows_the_switch_and_the_data(tmp_path, monkeypatch, switch, public):
    monkeypatch.setenv(patches.VAR, switch)
    first = dataset_fingerprint(_saved(tmp_path / "a", ["u1", "u2"]))
    assert first.startswith(PUBLIC_PREFIX) == public
    assert dataset_fingerprint(datasets.load_from_disk(str(tmp_path / "a"))) == first  # stable across loads
    assert dataset_fingerprint(_saved(tmp_path / "b", ["u1", "u3"])) != first  # other rows


def test_an_embedded_dataset_runs_the_same_with_every_patch_off(tmp_path, monkeypatch):
    """The rows' fingerprints are planned and checked in the driver and on the workers with the
    public kind alone; the outputs equal those of a run with the patches on (the stats to float32
    rounding: with the patches off lhotse's own ``Fbank.extract`` computes the features, the fast
    path's equal to that rounding)."""
    from espnet3_flows.inputs.demo import make_demo_corpus
    from tests.inputs.test_hf_format import _outputs, _run
    from tests.support.floats import assert_same_floats

    tsv = make_demo_corpus(tmp_path / "c", n_utts=4, n_speakers=2, min_seconds=0.3, max_seconds=0.5, seed=5,
                           splits={"train": 1.0})["train"]
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    data = {"id": [r[0] for r in rows], "audio": [r[1] for r in rows]}
    ds = datasets.Dataset.from_dict(data).cast_column("audio", datasets.Audio(decode=False))
    ds.save_to_disk(str(tmp_path / "ds"))
    _run(str(tmp_path / "ds"), tmp_path / "on")
    monkeypatch.setenv(patches.VAR, "off")
    _run(str(tmp_path / "ds"), tmp_path / "off")
    on, off = _outputs(tmp_path / "on"), _outputs(tmp_path / "off")
    assert on["feats_shape"] == off["feats_shape"] and on["speech_shape"] == off["speech_shape"]
    assert int(on["stats"]["count"]) == int(off["stats"]["count"])
    for key in ("sum", "sum_square"):
        assert_same_floats(on["stats"][key], off["stats"][key], rel=1e-6)
