"""The command line and export_batches: batch files, reports, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lhotse import CutSet
from lhotse.testing.dummies import dummy_cut

from espnet3_flows.batching import (
    BatchConfig,
    BatchReport,
    LengthTable,
    export_batches,
    read_batch_file,
)
from espnet3_flows.batching.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shape_files(write_file, lognormal_frames):
    frames = lognormal_frames(120, seed=9)
    ids = [f"spk{i % 3}-utt{i:03d}" for i in range(len(frames))]
    feats = write_file("feats_shape", [f"{u} {f},80" for u, f in zip(ids, frames, strict=True)])
    text = write_file("text_shape", [f"{u} {1 + f // 40},300" for u, f in zip(ids, frames, strict=True)])
    groups = write_file("utt2spk", [f"{u} {u.split('-')[0]}" for u in ids])
    return ids, frames, feats, text, groups


def test_cli_writes_batches_and_report(shape_files, tmp_path, capsys):
    ids, frames, feats, text, _ = shape_files
    length_of = dict(zip(ids, frames, strict=True))
    report = main([
        "--shape-file", str(feats), "--shape-file", str(text), "--batch-type", "numel",
        "--batch-bins", "2000000", "--output-dir", str(tmp_path / "out"), "--split", "train",
    ])
    batches = read_batch_file(tmp_path / "out" / "batches" / "train.txt")
    assert sorted(u for b in batches for u in b) == sorted(ids)
    assert report.num_batches == len(batches)
    assert report.mean_batch_size == pytest.approx(len(ids) / len(batches))
    real = sum(length_of[u] for b in batches for u in b)
    padded = sum(len(b) * max(length_of[u] for u in b) for b in batches)
    assert report.padding_efficiency == pytest.approx(real / padded)
    assert report.padding_fraction == pytest.approx((padded - real) / padded)
    saved = json.loads((tmp_path / "out" / "batches" / "train.json").read_text())
    assert BatchReport.from_dict(saved["report"]) == report
    assert saved["report"]["config"]["batch_bins"] == 2_000_000
    out = capsys.readouterr().out
    assert f"batches:            {len(batches)}" in out and "padding fraction" in out


def test_cli_shape_list_group_by_and_json(write_file, tmp_path, capsys):
    write_file("shape.0", ["a 10", "b 30"])
    write_file("shape.1", ["c 20", "d 40"])
    listing = write_file("shapes.list", ["shape.0", "shape.1"])
    groups = write_file("utt2g", ["a x", "b y", "c x", "d y"])
    main([
        "--shape-list", str(listing), "--group-file", str(groups), "--group-by",
        "--batch-type", "sorted", "--batch-size", "4", "--is-descending", "false",
        "--output-dir", str(tmp_path), "--split", "dev", "--json",
    ])
    batches = read_batch_file(tmp_path / "batches" / "dev.txt")
    assert batches == [["a", "c"], ["b", "d"]]
    assert json.loads(capsys.readouterr().out)["num_batches"] == 2


def test_espnet2_spellings_are_accepted(shape_files, tmp_path):
    ids, frames, feats, text, _ = shape_files
    length_of = dict(zip(ids, frames, strict=True))
    main(["--shape-file", str(feats), "--shape-file", str(text), "--batch_type", "length", "--batch_bins", "4000",
          "--sort_in_batch", "ascending", "--sort_batch", "descending", "--output-dir", str(tmp_path),
          "--split", "train"])
    batches = read_batch_file(tmp_path / "batches" / "train.txt")
    assert sorted(u for b in batches for u in b) == sorted(ids)
    longest = [max(length_of[u] for u in b) for b in batches]
    assert longest == sorted(longest, reverse=True)  # sort_batch descending
    assert all([length_of[u] for u in b] == sorted(length_of[u] for u in b) for b in batches)  # ascending inside
    saved = json.loads((tmp_path / "batches" / "train.json").read_text())["report"]["config"]
    assert saved["batch_type"] == "length" and saved["batch_bins"] == 4000 and saved["padding"] is True


def test_module_entry_point_and_errors(shape_files, write_file, tmp_path):
    _, _, feats, _, _ = shape_files
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "espnet3_flows.batching", "--batch-type", "length",
               "--max-duration", "30", "--frame-shift", "0.01", "--output-dir", str(tmp_path),
               "--split", "valid"]
    done = subprocess.run(command + ["--shape-file", str(feats)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "batches" / "valid.txt").exists() and "padding efficiency" in done.stdout
    bad = write_file("bad_shape", ["a 10,80", "b 0,80"])
    failed = subprocess.run(command + ["--shape-file", str(bad)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert f"{bad}:2" in failed.stderr and "'b'" in failed.stderr


def test_export_from_lhotse_cuts(tmp_path):
    cuts = CutSet.from_cuts(dummy_cut(i, duration=0.5 + (i % 9)) for i in range(40))
    table = LengthTable.from_cuts(cuts, frame_shift=0.01)
    report = export_batches(table, BatchConfig(batch_bins=2000), tmp_path, "train_cuts")
    batches = read_batch_file(tmp_path / "batches" / "train_cuts.txt")
    assert sorted(u for b in batches for u in b) == sorted(cuts.ids)
    assert report.num_utterances == 40 and report.num_oversized == 0
    frames = {c.id: round(c.duration * 100) for c in cuts}
    assert all(len(b) * max(frames[u] for u in b) <= 2000 for b in batches)


@pytest.mark.parametrize("split", ["../escape", "a/b", ".hidden", ""])
def test_split_name_cannot_escape(make_table, tmp_path, split):
    with pytest.raises(ValueError, match="split name"):
        export_batches(make_table([1, 2]), BatchConfig(batch_bins=10), tmp_path, split)
