"""Streaming a manifest into a shard plan: equal to a reference computation, memory per shard not per
utterance, the same path for TSV and lhotse manifests, duplicates, skips, gzip spools, S3 inputs."""

from __future__ import annotations

import gzip
import json
import os
import tracemalloc

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.inputs.fingerprints import Fingerprinter, fingerprint_files
from espnet3_flows.inputs.manifest import read_manifest_slice
from espnet3_flows.inputs.records import ManifestError
from espnet3_flows.inputs.planner import plan_manifest
from espnet3_flows.hashing import code_salt
from espnet3_flows.sharding import plan_shards
from espnet3_flows.storage import Storage


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wavs")
    paths = []
    for i in range(5):
        p = root / f"a{i}.wav"
        sf.write(p, np.zeros(800 + 10 * i, dtype="float32"), 16000)
        paths.append(str(p))
    return paths


def _lines(wavs, n, start=0):
    return [f"utt{i:07d}\t{wavs[i % len(wavs)]}\tsome text {i}\tspk{i % 3}\n" for i in range(start, start + n)]


def test_streaming_plan_equals_a_reference_computation(tmp_path, wavs):
    lines = _lines(wavs, 3000)
    lines[10:10] = ["# a comment\n", "\n"]
    manifest = tmp_path / "m.tsv"
    manifest.write_text("".join(lines))
    config = {"job": "x", "n": 1}
    streamed = plan_manifest(str(manifest), "train", 40, config)
    # reference: every usable line in memory, keyed by its text and its file's fingerprint
    items = [ln.rstrip("\n") for ln in lines if ln.strip() and not ln.startswith("#")]
    prints = fingerprint_files([ln.split("\t")[1] for ln in items])
    keys = [f"{ln}\t{prints[ln.split(chr(9))[1]]}" for ln in items]
    reference = plan_shards(keys, 40, config, salt=code_salt(), cut_keys=[ln.split("\t")[0] for ln in items])
    assert [(s.start, s.stop, s.hash) for s in streamed.plan.shards] == [
        (s.start, s.stop, s.hash) for s in reference.shards]
    assert streamed.plan.digest == reference.digest
    # every shard's byte range holds exactly its utterances
    got = [u.utt_id for s in streamed.plan.shards for u in read_manifest_slice(s.source, "train")]
    assert got == [ln.split("\t")[0] for ln in items]


def test_planning_memory_is_per_shard_not_per_utterance(tmp_path, wavs):
    """100,000 lines: holding the split's utterances would take tens of MB of Python objects."""
    manifest = tmp_path / "big.tsv"
    with open(manifest, "w") as f:
        for start in range(0, 100_000, 10_000):
            f.writelines(_lines(wavs, 10_000, start))
    tracemalloc.start()
    try:
        planned = plan_manifest(str(manifest), "train", 1000, {})
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        shard = planned.plan.shards[len(planned.plan.shards) // 2]
        utts = read_manifest_slice(shard.source, "train")  # what one worker holds
        _, worker_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert planned.plan.num_items == 100_000 and len(utts) == shard.num_items
    assert peak < 8 * 2**20, f"planning peaked at {peak / 2**20:.1f} MB of Python objects"  # ~2 MB measured
    assert worker_peak < 8 * 2**20, f"reading one shard peaked at {worker_peak / 2**20:.1f} MB"


def test_tsv_and_lhotse_manifests_take_the_same_path(tmp_path, wavs):
    tsv, jsonl = tmp_path / "m.tsv", tmp_path / "cuts.jsonl.gz"
    tsv.write_text("".join(_lines(wavs, 500)))
    with gzip.open(jsonl, "wt") as f:
        for i in range(500):
            cut = {"id": f"utt{i:07d}", "start": 0, "duration": 0.05, "channel": 0,
                   "recording": {"id": f"r{i}", "sources": [{"type": "file", "channel_ids": [0],
                                                             "source": wavs[i % len(wavs)]}],
                                 "sampling_rate": 16000, "num_samples": 800, "duration": 0.05, "channel_ids": [0]},
                   "supervisions": [{"id": f"s{i}", "recording_id": f"r{i}", "start": 0, "duration": 0.05,
                                     "speaker": f"spk{i % 3}", "text": f"some text {i}"}]}
            f.write(json.dumps(cut) + "\n")
    a = plan_manifest(str(tsv), "train", 30, {})
    b = plan_manifest(str(jsonl), "train", 30, {}, spool=Storage(tmp_path / "out"), spool_rel="train/shards/inputs")
    assert [(s.start, s.stop) for s in a.plan.shards] == [(s.start, s.stop) for s in b.plan.shards]  # ids decide
    assert b.manifest.startswith(str(tmp_path / "out" / "train" / "shards" / "inputs"))  # decompressed once
    utts = [u for s in b.plan.shards for u in read_manifest_slice(s.source, "train")]
    assert [u.utt_id for u in utts] == [f"utt{i:07d}" for i in range(500)] and utts[7].payload["id"] == "utt0000007"
    again = plan_manifest(str(jsonl), "train", 30, {}, spool=Storage(tmp_path / "out"), spool_rel="train/shards/inputs")
    assert again.plan.digest == b.plan.digest and again.manifest == b.manifest


def test_duplicates_and_bad_lines_fail_or_are_left_out_of_the_ranges(tmp_path, wavs):
    lines = _lines(wavs, 400)
    lines.insert(300, lines[5])  # a repeated id, far from its first line
    lines.insert(100, "no tabs here\n")
    manifest = tmp_path / "m.tsv"
    manifest.write_text("".join(lines))
    with pytest.raises(ManifestError, match=r"m\.tsv:101: .*expected 'utt_id<TAB>wav_path"):
        plan_manifest(str(manifest), "train", 20, {})
    del lines[100]
    manifest.write_text("".join(lines))
    with pytest.raises(ManifestError, match=r"m\.tsv:301: utt 'utt0000005': duplicate .* \(first on line 6\)"):
        plan_manifest(str(manifest), "train", 20, {})
    lines.insert(100, "no tabs here\n")
    manifest.write_text("".join(lines))
    planned = plan_manifest(str(manifest), "train", 20, {}, on_error="skip")
    assert [(s.line, s.utt_id) for s in planned.skipped] == [(101, "no tabs here"), (302, "utt0000005")]
    ids = [u.utt_id for s in planned.plan.shards for u in read_manifest_slice(s.source, "train")]
    assert ids == [f"utt{i:07d}" for i in range(400)]


def test_a_manifest_edited_after_planning_is_refused_by_the_worker(tmp_path, wavs):
    manifest = tmp_path / "m.tsv"
    manifest.write_text("".join(_lines(wavs, 100)))
    planned = plan_manifest(str(manifest), "train", 20, {})
    manifest.write_text("".join(_lines(wavs, 100)).replace("some text 3", "other text"))
    with pytest.raises(ManifestError, match="changed since the run was planned"):
        read_manifest_slice(planned.plan.shards[0].source, "train")


def test_fingerprint_manifest_mode_plans_without_touching_files(tmp_path, wavs):
    manifest = tmp_path / "m.tsv"
    manifest.write_text("".join(_lines(["/no/such/dir/x.wav"], 200)))
    stat = plan_manifest(str(manifest), "train", 20, {})
    trusted = plan_manifest(str(manifest), "train", 20, {}, fingerprint="manifest")
    assert [(s.start, s.stop) for s in stat.plan.shards] == [(s.start, s.stop) for s in trusted.plan.shards]
    assert {s.hash for s in stat.plan.shards}.isdisjoint(s.hash for s in trusted.plan.shards)


@pytest.mark.s3
def test_s3_inputs_are_fingerprinted_from_concurrent_listings(moto_server, s3_output):
    import s3fs

    url, options = s3_output
    fs = s3fs.S3FileSystem(**options)
    bucket = url[len("s3://"):].split("/")[0]
    paths = []
    for d in range(12):
        for i in range(25):
            key = f"{bucket}/audio/d{d:02d}/{i}.wav"
            fs.pipe_file(key, b"x" * (i + 1))
            paths.append(f"s3://{key}")
    etags = {f"s3://{e['name']}": e["ETag"].strip('"') for e in fs.find(f"{bucket}/audio", detail=True).values()}
    with Fingerprinter("stat", options, threads=4, cache_entries=60) as fp:
        prints = fp.fingerprints([*paths, f"s3://{bucket}/audio/d03/none.wav"])
        assert prints[:-1] == [f"{i + 1}:{etags[p]}" for p, i in zip(paths, [i for _ in range(12) for i in range(25)], strict=True)]
        assert prints[-1] == "missing"
        assert fp._cached <= 60 + 25  # the listing cache stays bounded
    manifest = os.path.join(url, "m.tsv")
    fs.pipe_file(manifest[len("s3://"):], "".join(f"u{i:04d}\t{p}\n" for i, p in enumerate(paths)).encode())
    planned = plan_manifest(manifest, "train", 25, {}, storage_options=options)
    assert planned.plan.num_items == 300
    assert [u.path for s in planned.plan.shards for u in read_manifest_slice(s.source, "train", options)] == paths
