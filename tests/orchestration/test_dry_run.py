"""``--dry-run`` checks what a run would read and writes nothing: every local audio file of the
shards to compute is stat'ed (missing, empty, not a regular file: the message a run gives, with
its file and line), a sample of headers gives the corpus's rates (a warning naming the key and
the value to set), and no file or directory is left in the output, beside the manifest or in the
temporary directory, for a TSV manifest and for a Kaldi data directory (whose joined lines go to
a temporary directory, not the output)."""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.config import load_config
from espnet3_flows.inputs.input_check import InputCheck
from espnet3_flows.orchestration.dry_run import dry_run, rate_warning
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner

GOOD = 6


def _corpus(root: Path) -> dict[str, Path]:
    """Six 8 kHz utterances, then a missing file, an empty file and a directory, as a TSV manifest
    and as a Kaldi data directory (``wav.scp``)."""
    audio = root / "audio"
    audio.mkdir(parents=True)
    rng = np.random.default_rng(0)
    entries = []
    for k in range(GOOD):
        path = audio / f"u{k}.wav"
        sf.write(path, (0.1 * rng.standard_normal(4000 + 800 * k)).astype(np.float32), 8000, subtype="PCM_16")
        entries.append((f"u{k}", path))
    (audio / "empty.wav").write_bytes(b"")
    (audio / "a-directory.wav").mkdir()
    entries += [("missing", audio / "missing.wav"), ("empty", audio / "empty.wav"),
                ("folder", audio / "a-directory.wav")]
    tsv = root / "lists" / "train.tsv"
    tsv.parent.mkdir()
    tsv.write_text("".join(f"{u}\t{p}\n" for u, p in entries))
    kaldi = root / "data" / "train"
    kaldi.mkdir(parents=True)
    (kaldi / "wav.scp").write_text("".join(f"{u} {p}\n" for u, p in entries))
    return {"tsv": tsv, "kaldi": kaldi}


def _listing(*roots: Path) -> set[str]:
    return {str(p) for root in roots for p in root.rglob("*")}


def _config(manifest: Path, out: Path, *overrides: str) -> CollectStatsConfig:
    return load_config(CollectStatsConfig, overrides=[f"manifests.train={manifest}", f"output_dir={out}",
                                                      "parallel.env=local", "parallel.n_workers=2", *overrides])


@pytest.mark.parametrize("kind", ["tsv", "kaldi"])
def test_a_dry_run_names_every_bad_file_as_a_run_would_and_writes_nothing(tmp_path, monkeypatch, capsys, kind):
    corpus = _corpus(tmp_path / "corpus")
    manifest = corpus[kind]
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out = tmp_path / "out"
    before = _listing(tmp_path)

    assert dry_run("collect_stats", _config(manifest, out)) == 1
    text = capsys.readouterr().out
    assert _listing(tmp_path) == before, "a dry run wrote something"
    assert f"inputs: {GOOD + 3} of {GOOD + 3} audio files stat'ed" in text and ": 3 bad" in text, text
    assert text.rstrip().splitlines()[-1] == ("error: 3 input(s) would stop a run (on_error=fail; on_error=skip "
                                              "lists them in skipped.tsv and goes on)")

    # the same messages as a run: the reasons the run's skipped.tsv gives, at the same file and line
    CollectStatsRunner(_config(manifest, out, "on_error=skip", "frontend.sampling_rate=8000", "parallel.env=serial"),
                       "train").run(progress=False)
    with open(out / "train" / "skipped.tsv", newline="") as f:
        skipped = list(csv.DictReader(f, delimiter="\t"))
    assert sorted(row["utt_id"] for row in skipped) == ["empty", "folder", "missing"]
    where = "wav.scp:" if kind == "kaldi" else "line "
    for row in skipped:
        reason = row["reason"].split(": ", 1)[1]  # (less the exception's class name)
        assert f"{where}{row['line']}, utt '{row['utt_id']}'" in text and reason in text, (row, text)

    # the rates: a warning naming the key and the value to set; none once it is set
    assert ("warning: split train: 6 of 6 sampled files are not at frontend.sampling_rate=16000 Hz (8000 Hz: 6); "
            "they are resampled to 16000 Hz. If 8000 Hz is your corpus's rate, set frontend.sampling_rate=8000") \
        in text


def test_under_skip_a_dry_run_lists_the_bad_files_and_succeeds_and_done_shards_are_not_checked(tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    cfg = _config(corpus["tsv"], out, "on_error=skip", "frontend.sampling_rate=8000", "parallel.env=serial")
    assert dry_run("collect_stats", cfg) == 0
    text = capsys.readouterr().out
    assert ": 3 bad" in text and "audio file not found" in text and "warning" not in text and "error" not in text
    CollectStatsRunner(cfg, "train").run(progress=False)
    listing = _listing(out)
    assert dry_run("collect_stats", cfg) == 0
    text = capsys.readouterr().out
    assert "to compute (0 utterances)" in text and "inputs:" not in text
    assert _listing(out) == listing


def test_a_dry_run_reads_a_sample_of_headers_spread_over_the_split(tmp_path, capsys):
    """250 utterances: 100 headers read, from the whole split (the 16 kHz tail is seen)."""
    audio = tmp_path / "audio"
    audio.mkdir()
    lines = []
    for k, rate in enumerate((8000, 16000)):
        path = audio / f"r{rate}.wav"
        sf.write(path, np.zeros(rate // 2, np.float32), rate, subtype="PCM_16")
        lines += [f"u{k}-{j:03d}\t{path}\n" for j in range(125)]
    manifest = tmp_path / "train.tsv"
    manifest.write_text("".join(lines))
    assert dry_run("collect_stats", _config(manifest, tmp_path / "out")) == 0
    text = capsys.readouterr().out
    assert "250 of 250 audio files stat'ed, 100 headers read: 0 bad" in text, text
    assert "(8000 Hz: 50, 16000 Hz: 50)" in text and "set frontend.sampling_rate" not in text, text


def test_the_rate_warning_names_the_jobs_key():
    found = InputCheck(rates={8000: 90, 16000: 10})
    assert rate_warning("dev", found, "xvector.sampling_rate", 16000) == (
        "split dev: 90 of 100 sampled files are not at xvector.sampling_rate=16000 Hz (8000 Hz: 90, 16000 Hz: 10); "
        "they are resampled to 16000 Hz. If 8000 Hz is your corpus's rate, set xvector.sampling_rate=8000")
    assert rate_warning("dev", InputCheck(rates={16000: 3}), "frontend.sampling_rate", 16000) is None
