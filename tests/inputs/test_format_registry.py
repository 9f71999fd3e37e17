"""The manifest-format registry: every built-in format is recognised from its path, and a new
format registers by subclassing alone, then plans and reads like the others."""

from __future__ import annotations

import gzip

import pytest

from espnet3_flows.inputs.formats import FORMATS, ManifestFormat, detect_format, format_named, known_formats
from espnet3_flows.inputs.manifest import read_manifest_slice
from espnet3_flows.inputs.planner import plan_manifest
from espnet3_flows.inputs.records import ManifestError, Utterance


def test_builtin_formats_are_registered():
    assert {"tsv", "lhotse", "kaldi", "hf"} <= set(known_formats())


def test_each_format_is_recognised_from_its_path(tmp_path):
    (tmp_path / "a.tsv").write_text("u1\t/a.wav\n")
    (tmp_path / "cuts.jsonl").write_text("")
    (tmp_path / "cuts.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "wav.scp").write_text("u1 /a.wav\n")
    (tmp_path / "ds").mkdir()
    for name in ("state.json", "dataset_info.json"):
        (tmp_path / "ds" / name).write_text("{}")
    expected = {"a.tsv": "tsv", "cuts.jsonl": "lhotse", "cuts.jsonl.gz": "lhotse", "data": "kaldi", "ds": "hf",
                "ds?id=key&audio=file": "hf"}
    assert {p: detect_format(str(tmp_path / p)).name for p in expected} == expected


def test_an_unknown_format_name_is_an_error():
    with pytest.raises(ManifestError, match="unknown manifest format 'nope'"):
        format_named("nope")


@pytest.fixture
def pipe_format():
    """A format declared here and nowhere else: ``id|path`` lines in ``*.pipes`` files."""

    class PipeSeparated(ManifestFormat):
        name = "test-pipe-separated"
        priority = 50

        def is_applicable(self, manifest, storage_options=None):
            return manifest.endswith(".pipes")

        def parse_line(self, line, lineno):
            utt_id, sep, path = line.partition("|")
            if not sep:
                raise ValueError("expected 'utt_id|path'")
            return Utterance(utt_id, path, line=lineno)

    FORMATS.register(PipeSeparated.name, PipeSeparated())
    yield PipeSeparated
    FORMATS.unregister("test-pipe-separated")


def test_a_registered_format_plans_like_the_others(tmp_path, pipe_format):
    manifest = tmp_path / "corpus.pipes"
    manifest.write_text("".join(f"u{i:02d}|/audio/{i}.wav\n" for i in range(40)) + "bad line\n")
    assert detect_format(str(manifest)) is format_named("test-pipe-separated")
    with pytest.raises(ManifestError, match=r"corpus.pipes:41: expected 'utt_id\|path'"):
        plan_manifest(str(manifest), "train", 8, {}, fingerprint="manifest")
    planned = plan_manifest(str(manifest), "train", 8, {}, fingerprint="manifest", on_error="skip")
    assert [s.line for s in planned.skipped] == [41]
    assert all(s.source["format"] == "test-pipe-separated" for s in planned.plan.shards)
    read = [u for s in planned.plan.shards for u in read_manifest_slice(s.source, "train")]
    assert [(u.utt_id, u.path) for u in read] == [(f"u{i:02d}", f"/audio/{i}.wav") for i in range(40)]
