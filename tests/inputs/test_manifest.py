"""Input manifests: TSV and lhotse JSONL parsing, line numbers, skip policy, utterance-id safety."""

from __future__ import annotations

import gzip
import json
import uuid

import fsspec
import pytest

from espnet3_flows.inputs.formats import detect_format
from espnet3_flows.inputs.manifest import read_manifest

from espnet3_flows.inputs.records import (

    SKIPPED_HEADER,

    ManifestError,

    SkippedItem,

    Utterance,

    validate_utt_id,

    write_skipped_tsv,

)


def _write(tmp_path, text: str, name: str = "m.tsv") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def test_tsv_with_two_three_and_four_fields(tmp_path):
    path = _write(tmp_path, "u1\t/a/1.wav\nu2\t/a/2.wav\thello world\nu3\t/a/3.wav\tbye\tspk7\nu4\t/a/4.wav\t\tspk8\n")
    utts, skipped = read_manifest(path, "train")
    assert skipped == []
    assert utts == [
        Utterance("u1", "/a/1.wav", "", "", 1),
        Utterance("u2", "/a/2.wav", "hello world", "", 2),
        Utterance("u3", "/a/3.wav", "bye", "spk7", 3),
        Utterance("u4", "/a/4.wav", "", "spk8", 4),
    ]
    assert all(u.payload is None and not u.format for u in utts)


def test_comments_blank_lines_and_crlf_keep_line_numbers(tmp_path):
    path = _write(tmp_path, "# header\n\nu1\t/a/1.wav\r\n   \n#u2\t/a/2.wav\nu3\t/a/3.wav\ttext\r\n")
    utts, _ = read_manifest(path, "dev")
    assert [(u.utt_id, u.path, u.text, u.line) for u in utts] == [("u1", "/a/1.wav", "", 3), ("u3", "/a/3.wav", "text", 6)]


@pytest.mark.parametrize("line,problem", [
    ("u1", "got 1 field(s)"),
    ("u1\t", "got 2 field(s)"),
    ("\t/a.wav", "got 2 field(s)"),
    ("u1\t/a.wav\tt\ts\textra", "at most 4 tab-separated fields, got 5"),
    ("a/b\t/a.wav", "unsafe characters"),
    ("-x\t/a.wav", "starts with '-'"),
])
def test_bad_tsv_lines_fail_with_split_file_line_and_id(tmp_path, line, problem):
    path = _write(tmp_path, f"ok\t/ok.wav\n{line}\n")
    with pytest.raises(ManifestError) as info:
        read_manifest(path, "train")
    msg = str(info.value)
    assert msg.startswith(f"split 'train': {path}:2: ")
    assert problem in msg
    first = line.split("\t")[0]
    if first:
        assert repr(first) in msg


def test_skip_policy_returns_skipped_lines(tmp_path):
    raw = b"u1\t/a/1.wav\nu2\nu1\t/a/3.wav\nu\xe9\t/a/4.wav\nu5\t/a/5.wav\n"
    path = tmp_path / "m.tsv"
    path.write_bytes(raw)
    with pytest.raises(ManifestError, match=r":2: utt 'u2': expected"):
        read_manifest(str(path), "train")
    utts, skipped = read_manifest(str(path), "train", on_error="skip")
    assert [u.utt_id for u in utts] == ["u1", "u5"]
    assert [(s.split, s.utt_id, s.line) for s in skipped] == [("train", "u2", 2), ("train", "u1", 3), ("train", "u\\xe9", 4)]
    assert "duplicate utterance id 'u1' (first on line 1)" in skipped[1].reason
    assert "not valid UTF-8" in skipped[2].reason
    assert all(s.reason.startswith("manifest: ") for s in skipped)


def test_empty_or_unusable_manifests_are_errors(tmp_path):
    for text in ("", "\n", "# nothing\n"):
        with pytest.raises(ManifestError, match="has no usable utterance"):
            read_manifest(_write(tmp_path, text), "train", on_error="skip")
    with pytest.raises(ManifestError, match="has no usable utterance"):
        read_manifest(_write(tmp_path, "bad\n"), "train", on_error="skip")
    with pytest.raises(ManifestError, match=r"split 'x': manifest not found: .*nope\.tsv"):
        read_manifest(str(tmp_path / "nope.tsv"), "x")
    with pytest.raises(ValueError, match="on_error must be one of"):
        read_manifest(_write(tmp_path, "u\t/a.wav\n"), "x", on_error="ignore")


def _cut(cut_id: str, source: str, text: str | None = None, speaker: str | None = None) -> dict:
    rec = {"id": f"rec-{cut_id}", "sources": [{"type": "file", "channels": [0], "source": source}],
           "sampling_rate": 16000, "num_samples": 16000, "duration": 1.0}
    sups = [{"id": f"s-{cut_id}", "recording_id": rec["id"], "start": 0.0, "duration": 1.0, "channel": 0,
             "text": text, "speaker": speaker}] if text is not None else []
    return {"id": cut_id, "start": 0.0, "duration": 1.0, "channel": 0, "supervisions": sups,
            "recording": rec, "type": "MonoCut"}


@pytest.mark.parametrize("name", ["cuts.jsonl", "cuts.jsonl.gz"])
def test_lhotse_jsonl_manifests(tmp_path, name):
    lines = [json.dumps(_cut("c1", "/a/1.wav", "hi", "spk1")), "", json.dumps(_cut("c2", "/a/2.wav"))]
    data = ("\n".join(lines) + "\n").encode()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert detect_format(str(tmp_path / name)).name == "lhotse"
    utts, _ = read_manifest(str(tmp_path / name), "train")
    assert [(u.utt_id, u.path, u.text, u.speaker, u.line) for u in utts] == [
        ("c1", "/a/1.wav", "hi", "spk1", 1), ("c2", "/a/2.wav", "", "", 3)]
    assert utts[0].payload["recording"]["sources"][0]["source"] == "/a/1.wav"


def test_lhotse_manifest_built_by_lhotse(tmp_path):
    import numpy as np
    import soundfile as sf
    from lhotse import CutSet, Recording, RecordingSet

    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16000)
    cuts = CutSet.from_manifests(recordings=RecordingSet.from_recordings([Recording.from_file(wav, recording_id="rec-a")]))
    cuts.to_file(tmp_path / "cuts.jsonl.gz")
    utts, _ = read_manifest(str(tmp_path / "cuts.jsonl.gz"), "train")
    assert [u.utt_id for u in utts] == [next(iter(cuts)).id]
    assert utts[0].path == str(wav)


@pytest.mark.parametrize("line,problem", [
    ("not json", "not a JSON object"),
    ("[1, 2]", "needs an 'id'"),
    ('{"id": "c9", "recording": {"sources": []}}', "has no recording source"),
    (json.dumps(_cut("a/b", "/a.wav")), "unsafe characters"),
])
def test_bad_lhotse_lines(tmp_path, line, problem):
    path = _write(tmp_path, json.dumps(_cut("c1", "/a/1.wav")) + "\n" + line + "\n", "cuts.jsonl")
    with pytest.raises(ManifestError, match=rf"split 'train': .*cuts\.jsonl:2: .*{problem}"):
        read_manifest(path, "train")
    utts, skipped = read_manifest(path, "train", on_error="skip")
    assert [u.utt_id for u in utts] == ["c1"] and [s.line for s in skipped] == [2]


def test_manifest_through_fsspec():
    url = f"memory://manifests-{uuid.uuid4().hex}/train.tsv"
    with fsspec.open(url, "wb") as f:
        f.write(b"u1\ts3://bucket/1.wav\n")
    utts, _ = read_manifest(url, "train")
    assert utts == [Utterance("u1", "s3://bucket/1.wav", line=1)]


@pytest.mark.parametrize("utt_id", ["u1", "spk01-utt_0001", "a.b", "a-", "ü-spk_1", "A" * 238, "1",
                                    "a:b", "a=b"])
def test_valid_utt_ids(utt_id):
    assert validate_utt_id(utt_id) == utt_id


@pytest.mark.parametrize("utt_id,reason", [
    ("", "empty"),
    ("a/b", "unsafe"), ("/abs", "unsafe"), ("a\\b", "unsafe"), ("a\0b", "unsafe"), ("a\tb", "unsafe"),
    ("a\nb", "unsafe"), ("a\rb", "unsafe"), ("a b", "unsafe"), ("a\x7fb", "unsafe"), ("a\x01", "unsafe"),
    (".", "'..'"), ("..", "'..'"), ("a..b", "'..'"), ("-x", "starts with '-'"), ("--help", "starts with '-'"),
    ("A" * 256, "longer than 238 bytes"), ("ü" * 128, "longer than 238 bytes"),
])
def test_hostile_utt_ids(utt_id, reason):
    with pytest.raises(ValueError, match=reason):
        validate_utt_id(utt_id)


def test_utterance_and_skipped_item_records():
    u = Utterance("u1", "/a/1.wav", "t", "s", 12)
    assert Utterance.from_dict(json.loads(json.dumps(u.to_dict()))) == u
    assert u.where("train") == "split train, line 12, utt 'u1' (/a/1.wav)"
    assert Utterance("u2", "/b.wav").where() == "utt 'u2' (/b.wav)"

    s = SkippedItem("train", "u\t1", 4, "/a\nb.wav", "AudioError: bad\r\nthing")
    assert SkippedItem.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    line = s.tsv_line()
    assert line.count("\t") == 4 and "\n" not in line and "\r" not in line
    assert line.split("\t") == ["train", "u\\t1", "4", "/a\\nb.wav", "AudioError: bad\\r\\nthing"]
    text = write_skipped_tsv([s, SkippedItem("dev", "u2", 0, "", "manifest: x")])
    assert text.splitlines() == [SKIPPED_HEADER, line, "dev\tu2\t0\t\tmanifest: x"]
    assert write_skipped_tsv([]) == SKIPPED_HEADER + "\n"
