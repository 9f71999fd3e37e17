"""Utterance- and speaker-id checks: every id refused that ESPnet2's and kaldiio's readers would not
read back whole (Unicode whitespace, line separators, control characters) or whose files would not
fit a file name; each input format (TSV, lhotse, Kaldi data directory, Hugging Face dataset) refuses
such an id at planning, naming its file, line and id. Speaker ids are checked only for a job that
writes files keyed by them (``utt2spk``, ``spk_xvector.scp``)."""

from __future__ import annotations

import json
import sys

import pytest

from espnet3_flows.inputs.planner import plan_manifest
from espnet3_flows.inputs.records import (
    ID_FILE_SUFFIXES,
    MAX_ID_BYTES,
    NAME_MAX,
    ManifestError,
    id_file_name,
    validate_speaker_id,
    validate_utt_id,
)
from espnet3_flows.storage import Storage, atomic_local_file

#: one of each kind a reader splits or strips at, or a file system or encoder refuses
HOSTILE_CHARS = {
    "ideographic space": "\u3000", "no-break space": "\u00a0", "narrow no-break space": "\u202f",
    "ogham space": "\u1680", "en quad": "\u2000", "hair space": "\u200a", "math space": "\u205f",
    "line separator": "\u2028", "paragraph separator": "\u2029", "next line": "\u0085",
    "vertical tab": "\x0b", "form feed": "\x0c", "file separator": "\x1c", "group separator": "\x1d",
    "record separator": "\x1e", "unit separator": "\x1f", "C1 control": "\x9b", "escape": "\x1b",
    "lone surrogate": "\ud800",
}
#: ids that are unusual but read back whole: accepted
UNUSUAL_IDS = ["ü-spk_1", "话者1_発話", "a'b\"c", "x(1)[2]{3}", "a;b&c!d?e", "#1", "a|b", "é" * 119,
               "a\u200bb", "Ωmega~^`$"]


@pytest.mark.parametrize("kind", sorted(HOSTILE_CHARS))
def test_every_kind_of_splitting_or_control_character_is_refused(kind):
    utt_id = f"spk1{HOSTILE_CHARS[kind]}utt2"
    with pytest.raises(ValueError, match="unsafe characters") as err:
        validate_utt_id(utt_id)
    assert repr(utt_id)[:20] in str(err.value) and f"U+{ord(HOSTILE_CHARS[kind]):04X}" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_no_accepted_id_is_split_or_stripped_by_the_readers():
    # every code point: whatever is accepted reads back whole through str.split (ESPnet2's
    # read_2columns_text, kaldiio.load_scp) and str.splitlines
    for code in range(sys.maxunicode + 1):
        utt_id = f"a{chr(code)}b"
        if utt_id.split() == [utt_id] and utt_id.splitlines() == [utt_id]:
            continue
        with pytest.raises(ValueError):
            validate_utt_id(utt_id)


@pytest.mark.parametrize("utt_id", UNUSUAL_IDS)
def test_unusual_ids_that_read_back_whole_are_accepted(utt_id):
    assert validate_utt_id(utt_id) == utt_id


def test_the_longest_id_has_room_for_every_id_file_and_its_temporary_name(tmp_path):
    assert NAME_MAX - max(len(s) for s in ID_FILE_SUFFIXES) - len(".tmp-12345678") == MAX_ID_BYTES
    for longest in ("a" * MAX_ID_BYTES, "é" * (MAX_ID_BYTES // 2)):
        assert validate_utt_id(longest) == longest
        for suffix in ID_FILE_SUFFIXES:  # real files, written as the jobs write them
            with atomic_local_file(tmp_path / id_file_name(longest, suffix), fsync=False) as f:
                f.write(b"x")
            assert (tmp_path / id_file_name(longest, suffix)).read_bytes() == b"x"
    for too_long in ("a" * (MAX_ID_BYTES + 1), "a" * 252, "a" * 255, "é" * (MAX_ID_BYTES // 2 + 1)):
        with pytest.raises(ValueError, match=f"longer than {MAX_ID_BYTES} bytes"):
            validate_utt_id(too_long)


def test_an_id_file_with_an_undeclared_ending_is_refused():
    with pytest.raises(ValueError, match="ID_FILE_SUFFIXES"):
        id_file_name("u1", ".embedding.npz")


def _cut(utt_id: str, wav: str) -> dict:
    rec = {"id": "r", "sources": [{"type": "file", "channels": [0], "source": wav}], "sampling_rate": 16000,
           "num_samples": 16000, "duration": 1.0, "channel_ids": [0]}
    return {"id": utt_id, "start": 0.0, "duration": 1.0, "channel": 0, "recording": rec, "type": "MonoCut"}


def _manifest(tmp_path, fmt: str, bad_id: str) -> tuple[str, str, int]:
    """A manifest of format ``fmt`` whose second utterance is ``bad_id``: (manifest, the file an
    error names, the line it names)."""
    ids, wav = ["u1", bad_id, "u3"], str(tmp_path / "a.wav")
    if fmt == "tsv":
        path = tmp_path / "m.tsv"
        path.write_text("".join(f"{u}\t{wav}\n" for u in ids), encoding="utf-8")
        return str(path), str(path), 2
    if fmt == "lhotse":
        path = tmp_path / "cuts.jsonl"
        path.write_text("".join(json.dumps(_cut(u, wav)) + "\n" for u in ids), encoding="utf-8")
        return str(path), str(path), 2
    if fmt == "kaldi":
        data = tmp_path / "data"
        data.mkdir()
        (data / "wav.scp").write_text("".join(f"{u} {wav}\n" for u in sorted(ids)), encoding="utf-8")
        return str(data), str(data / "wav.scp"), sorted(ids).index(bad_id) + 1
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_dict({"id": ids, "audio": [wav] * 3}).save_to_disk(str(directory))
    return str(directory), str(directory), 2  # its rows are spooled; the error names the dataset, row 1 as line 2


@pytest.mark.parametrize("fmt", ["tsv", "lhotse", "kaldi", "hf"])
@pytest.mark.parametrize("bad_id", ["a\u3000b", "c\u00a0d", "e\u2028f", "g\x85h", "x" * 252])
def test_every_format_refuses_the_id_at_planning_naming_file_line_and_id(tmp_path, fmt, bad_id):
    manifest, named, line = _manifest(tmp_path, fmt, bad_id)
    with pytest.raises(ManifestError) as err:
        plan_manifest(manifest, "train", 2, {}, spool=Storage(tmp_path / "out"), spool_rel="train/shards/inputs")
    message = str(err.value)
    assert len(message.splitlines()) == 1 and len(message) < 1000
    assert f"{named}:{line}:" in message
    assert repr(bad_id)[:40] in message


@pytest.mark.parametrize("kind", sorted(HOSTILE_CHARS))
def test_a_speaker_id_the_readers_would_split_is_refused_by_the_same_rule(kind):
    speaker = f"spk{HOSTILE_CHARS[kind]}1"
    with pytest.raises(ValueError, match="speaker id .* contains unsafe characters") as err:
        validate_speaker_id(speaker)
    assert repr(speaker)[:20] in str(err.value) and f"U+{ord(HOSTILE_CHARS[kind]):04X}" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_speaker_and_utterance_ids_share_the_character_rule():
    # every code point a reader splits or strips at is refused in both; speaker ids name no file,
    # so only the path separators, and the length bound, are the utterance id's own
    assert validate_speaker_id("John_Smith") == "John_Smith"
    for code in range(sys.maxunicode + 1):
        c = chr(code)
        if c in "/\\" or c.isalnum():
            continue
        try:
            validate_utt_id(f"a{c}b")
            utt_ok = True
        except ValueError:
            utt_ok = False
        try:
            validate_speaker_id(f"a{c}b")
            spk_ok = True
        except ValueError:
            spk_ok = False
        assert utt_ok == spk_ok, hex(code)


@pytest.mark.parametrize("speaker", [*UNUSUAL_IDS, "a/b", "-spk", "s" * 400])
def test_speaker_ids_that_read_back_whole_are_accepted(speaker):
    assert validate_speaker_id(speaker) == speaker


def _speaker_manifest(tmp_path, fmt: str, bad: str) -> tuple[str, str, int]:
    """A manifest of format ``fmt`` whose second utterance's speaker is ``bad``: (manifest, the
    file an error names, the line it names)."""
    ids, speakers, wav = ["u1", "u2", "u3"], ["s1", bad, "s3"], str(tmp_path / "a.wav")
    if fmt == "tsv":
        path = tmp_path / "m.tsv"
        path.write_text("".join(f"{u}\t{wav}\ttext\t{s}\n" for u, s in zip(ids, speakers, strict=True)), encoding="utf-8")
        return str(path), str(path), 2
    if fmt == "lhotse":
        path = tmp_path / "cuts.jsonl"
        cuts = []
        for u, s in zip(ids, speakers, strict=True):
            cut = _cut(u, wav)
            cut["supervisions"] = [{"id": u, "recording_id": "r", "start": 0.0, "duration": 1.0, "speaker": s}]
            cuts.append(json.dumps(cut) + "\n")
        path.write_text("".join(cuts), encoding="utf-8")
        return str(path), str(path), 2
    if fmt == "kaldi":
        data = tmp_path / "data"
        data.mkdir()
        (data / "wav.scp").write_text("".join(f"{u} {wav}\n" for u in ids), encoding="utf-8")
        (data / "utt2spk").write_text("".join(f"{u} {s}\n" for u, s in zip(ids, speakers, strict=True)), encoding="utf-8")
        return str(data), str(data / "utt2spk"), 2
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_dict({"id": ids, "audio": [wav] * 3, "speaker": speakers}).save_to_disk(str(directory))
    return str(directory), str(directory), 2


#: speaker ids ESPnet's readers would split (a person's name too), each refused where speaker ids key files
BAD_SPEAKERS = ["John Smith", "a\u3000b", "c\u00a0d", "e\u2028f", "g\x85h", "x\x1fy"]


@pytest.mark.parametrize("fmt", ["tsv", "lhotse", "kaldi", "hf"])
@pytest.mark.parametrize("bad", BAD_SPEAKERS)
def test_every_format_refuses_the_speaker_id_at_planning_when_speaker_ids_key_files(tmp_path, fmt, bad):
    manifest, named, line = _speaker_manifest(tmp_path, fmt, bad)
    with pytest.raises(ManifestError) as err:
        plan_manifest(manifest, "train", 2, {}, spool=Storage(tmp_path / "out"), spool_rel="train/shards/inputs",
                      fingerprint="manifest", speakers=True)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and len(message) < 1000
    assert f"{named}:{line}:" in message and "speaker id" in message
    assert repr(bad)[:40] in message


@pytest.mark.parametrize("fmt", ["tsv", "lhotse", "kaldi", "hf"])
def test_speaker_ids_are_left_alone_where_no_file_is_keyed_by_them(tmp_path, fmt):
    manifest, _, _ = _speaker_manifest(tmp_path, fmt, "John Smith")
    planned = plan_manifest(manifest, "train", 2, {}, spool=Storage(tmp_path / "out"),
                            spool_rel="train/shards/inputs", fingerprint="manifest")
    assert planned.plan.num_items == 3 and not planned.skipped


@pytest.mark.parametrize("fmt", ["tsv", "kaldi"])
def test_a_bad_speaker_id_is_skipped_and_listed_under_skip(tmp_path, fmt):
    manifest, named, line = _speaker_manifest(tmp_path, fmt, "a\u3000b")
    planned = plan_manifest(manifest, "train", 2, {}, spool=Storage(tmp_path / "out"),
                            spool_rel="train/shards/inputs", fingerprint="manifest", speakers=True, on_error="skip")
    assert planned.plan.num_items == 2
    assert [(s.utt_id, s.line) for s in planned.skipped] == [("u2", line)]
    assert "speaker id" in planned.skipped[0].reason
