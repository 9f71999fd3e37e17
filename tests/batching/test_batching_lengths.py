"""Reading lengths: shape files (shared and disjoint), group files, lhotse cuts, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from lhotse import CutSet
from lhotse.testing.dummies import dummy_cut

from espnet3_flows.batching import (
    LengthFileError,
    LengthTable,
    read_group_file,
    read_shape_file,
)
from espnet3_flows.batching.lengths import read_path_list


def test_reads_feature_and_sample_shapes(write_file):
    feats = read_shape_file(write_file("feats_shape", ["a 123,80", "b 7,80", "", "c 50,80"]))
    assert feats.ids == ["a", "b", "c"]
    assert feats.lengths.tolist() == [123, 7, 50]
    assert feats.dim == 80
    assert feats.line_nos == [1, 2, 4]
    speech = read_shape_file(write_file("speech_shape", ["a 48000", "b 16000"]))
    assert speech.lengths.tolist() == [48000, 16000]
    assert speech.dim == 1


def test_shared_ids_align_on_first_file_order(write_file):
    speech = write_file("speech_shape", ["b 300", "a 100", "c 200"])
    text = write_file("text_shape", ["a 5,500", "b 9,500", "c 7,500"])
    table = LengthTable.from_shape_files([speech, text], frame_shift=1 / 16000)
    assert table.ids == ["b", "a", "c"]
    assert table.lengths.tolist() == [[300, 100, 200], [9, 5, 7]]
    assert table.dims == [1, 500]
    assert table.primary.tolist() == [300, 100, 200]


def test_disjoint_files_concatenate_into_one_column(write_file, tmp_path):
    part0 = write_file("shape.0", ["a 10,80", "b 20,80"])
    part1 = write_file("shape.1", ["c 30,80"])
    table = LengthTable.from_shape_files([[part0, part1]])
    assert table.ids == ["a", "b", "c"]
    assert table.primary.tolist() == [10, 20, 30]
    listing = write_file("shapes.list", ["shape.0", str(part1)])
    assert read_path_list(listing) == [tmp_path / "shape.0", part1]


def test_disjoint_parts_combine_with_shared_columns(write_file):
    speech = [write_file("s.0", ["a 100", "b 200"]), write_file("s.1", ["c 300"])]
    text = [write_file("t.0", ["c 3"]), write_file("t.1", ["b 2", "a 1"])]
    table = LengthTable.from_shape_files([speech, text])
    assert table.lengths.tolist() == [[100, 200, 300], [1, 2, 3]]


@pytest.mark.parametrize(
    ("lines", "line_no", "utt", "reason"),
    [
        (["a 10", "b"], 2, "b", "expected 'uttid shape'"),
        (["a 10", "b 10 80"], 2, "b", "expected 'uttid shape'"),
        (["a 10", "b ten,80"], 2, "b", "not comma-separated integers"),
        (["a 10", "b 0,80"], 2, "b", "zero or negative"),
        (["a 10", "b -5"], 2, "b", "zero or negative"),
        (["a 10", "b 12,0"], 2, "b", "zero or negative"),
        (["a 10", "b 11", "a 12"], 3, "a", "duplicate id, first seen at"),
    ],
)
def test_bad_shape_lines_name_file_line_and_id(write_file, lines, line_no, utt, reason):
    path = write_file("bad_shape", lines)
    with pytest.raises(LengthFileError) as caught:
        read_shape_file(path)
    error = caught.value
    assert isinstance(error, ValueError)
    assert (error.path, error.line_no, error.utt_id) == (str(path), line_no, utt)
    assert f"{path}:{line_no}" in str(error) and repr(utt) in str(error) and reason in str(error)


def test_empty_shape_file_is_an_error(write_file):
    with pytest.raises(LengthFileError, match="no utterances"):
        read_shape_file(write_file("empty", ["", "  "]))


def test_duplicate_across_disjoint_files_names_both(write_file):
    part0 = write_file("shape.0", ["a 10", "b 20"])
    part1 = write_file("shape.1", ["c 5", "b 30"])
    with pytest.raises(LengthFileError) as caught:
        LengthTable.from_shape_files([[part0, part1]])
    assert caught.value.path == str(part1) and caught.value.line_no == 2
    assert f"{part0}:2" in str(caught.value)


def test_id_missing_from_second_file(write_file):
    speech = write_file("speech_shape", ["a 100", "b 200", "c 300"])
    text = write_file("text_shape", ["a 5", "c 7"])
    with pytest.raises(LengthFileError) as caught:
        LengthTable.from_shape_files([speech, text])
    error = caught.value
    assert (error.path, error.line_no, error.utt_id) == (str(speech), 2, "b")
    assert str(text) in str(error)


def test_id_missing_from_first_file(write_file):
    speech = write_file("speech_shape", ["a 100"])
    text = write_file("text_shape", ["a 5", "z 7"])
    with pytest.raises(LengthFileError) as caught:
        LengthTable.from_shape_files([speech, text])
    assert (caught.value.path, caught.value.line_no, caught.value.utt_id) == (str(text), 2, "z")


def test_group_file(write_file):
    groups = write_file("utt2spk", ["a spk1", "b spk2", "x spk9"])
    assert read_group_file(groups) == {"a": "spk1", "b": "spk2", "x": "spk9"}
    shapes = write_file("shape", ["a 10", "b 20"])
    table = LengthTable.from_shape_files([shapes], group_file=groups)
    assert table.groups == ["spk1", "spk2"]


def test_group_file_errors(write_file):
    with pytest.raises(LengthFileError) as caught:
        read_group_file(write_file("utt2spk", ["a s1", "a s2"]))
    assert (caught.value.line_no, caught.value.utt_id) == (2, "a")
    with pytest.raises(LengthFileError, match="expected 'uttid group'"):
        read_group_file(write_file("utt2spk_bad", ["a"]))
    shapes = write_file("shape", ["a 10", "b 20"])
    with pytest.raises(LengthFileError, match="have no group") as missing:
        LengthTable.from_shape_files([shapes], group_file=write_file("utt2g", ["a g"]))
    assert missing.value.utt_id == "b"


def test_from_lhotse_cuts_in_seconds_and_frames():
    durations = [1.25, 3.0, 0.004]
    cuts = CutSet.from_cuts(dummy_cut(i, duration=d) for i, d in enumerate(durations))
    seconds = LengthTable.from_cuts(cuts)
    assert seconds.ids == [c.id for c in cuts]
    assert np.allclose(seconds.primary, durations)
    assert seconds.frame_shift == 1.0
    frames = LengthTable.from_cuts(cuts, frame_shift=0.01, group_of=lambda c: c.id[-1])
    assert frames.primary.tolist() == [125, 300, 1]
    assert frames.groups == ["0", "1", "2"]


def test_from_cuts_rejects_duplicates_and_zero_durations():
    cut = dummy_cut(0, duration=1.0)
    with pytest.raises(LengthFileError, match="duplicate id") as caught:
        LengthTable.from_cuts([cut, cut])
    assert caught.value.line_no == 2 and caught.value.utt_id == cut.id
    with pytest.raises(LengthFileError, match="not positive"):
        LengthTable.from_cuts([dummy_cut(1, duration=0.0)])


def test_concat_tables(make_table):
    left = make_table([10, 20], prefix="a")
    right = make_table([30], prefix="b")
    both = LengthTable.concat([left, right])
    assert both.ids == ["a0000", "a0001", "b0000"]
    assert both.primary.tolist() == [10, 20, 30]
    with pytest.raises(ValueError, match="'a0000' appears in more than one table"):
        LengthTable.concat([left, left])
