"""Broken inputs by class: audio paths that are not regular files, headers that disagree with their
data, manifest encodings, impossible config values. Each is named; none hangs or passes as good data."""

from __future__ import annotations

import gzip
import os
import socket
import struct
import threading

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.inputs.audio import AudioConfig, AudioError, audio_length, read_audio
from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.inputs.manifest import read_manifest
from espnet3_flows.inputs.records import ManifestError, Utterance
from espnet3_flows.inputs.planner import plan_manifest
from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner
from espnet3_flows.xvector.job import XVectorJobConfig


def _wav(path, n=16000):
    sf.write(path, (0.1 * np.random.default_rng(0).standard_normal(n)).astype("float32"), 16000, subtype="PCM_16")
    return path


def _not_regular(tmp_path, kind):
    p = tmp_path / f"{kind}.wav"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        return p, s
    elif kind == "device":
        return "/dev/zero", None  # reading it would never end
    return p, None


def _truncated(tmp_path):
    data = _wav(tmp_path / "full.wav").read_bytes()
    p = tmp_path / "truncated.wav"
    p.write_bytes(data[: len(data) // 2])
    return p


def _huge_data_chunk(tmp_path):
    data = bytearray(_wav(tmp_path / "ok.wav").read_bytes())
    i = data.find(b"data")
    data[i + 4:i + 8] = struct.pack("<I", 2_000_000_000)  # claims 2 GB of samples
    p = tmp_path / "claims-2gb.wav"
    p.write_bytes(bytes(data))
    return p


@pytest.mark.parametrize("read", [read_audio, audio_length], ids=["decode", "header-only"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "socket", "device"])
def test_paths_that_are_not_regular_files_are_bad_items_without_opening(tmp_path, read, kind):
    path, handle = _not_regular(tmp_path, kind)
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: result.append(_raises(read, str(path))), daemon=True)
    t.start()
    t.join(10)
    if handle is not None:
        handle.close()
    assert not t.is_alive(), f"reading a {kind} blocked"
    assert isinstance(result[0], AudioError) and "not a regular file" in str(result[0]), result


def _raises(read, path):
    try:
        read(Utterance("u1", path), AudioConfig())
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


@pytest.mark.parametrize("read", [read_audio, audio_length], ids=["decode", "header-only"])
@pytest.mark.parametrize("make", [_truncated, _huge_data_chunk], ids=["truncated", "data-chunk-claims-2GB"])
def test_header_data_length_mismatch_is_a_bad_item(tmp_path, read, make):
    with pytest.raises(AudioError, match="header and data disagree"):
        read(Utterance("u1", str(make(tmp_path))), AudioConfig())
    assert read(Utterance("u2", str(_wav(tmp_path / "good.wav"))), AudioConfig()) is not None


@pytest.mark.parametrize("frontend", ["none", "fbank"])
def test_broken_audio_is_named_under_fail_and_listed_under_skip(tmp_path, frontend):
    good = [_wav(tmp_path / f"g{i}.wav") for i in range(3)]
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    bad = {"b-fifo": fifo, "b-trunc": _truncated(tmp_path), "b-huge": _huge_data_chunk(tmp_path),
           "b-dir": tmp_path / "adir"}
    (tmp_path / "adir").mkdir()
    lines = [f"g{i}\t{p}\n" for i, p in enumerate(good)] + [f"{u}\t{p}\n" for u, p in bad.items()]
    manifest = tmp_path / "m.tsv"
    manifest.write_text("".join(lines))
    base = {"manifests": {"train": str(manifest)}, "shard_size": 100, "frontend": {"type": frontend},
            "parallel": {"env": "serial"}}
    with pytest.raises(Exception, match="b-fifo") as info:
        CollectStatsRunner(load_config(CollectStatsConfig, base=base | {"output_dir": str(tmp_path / "f")}),
                           "train").run(progress=False)
    assert "FIFO" in str(info.value)
    cfg = load_config(CollectStatsConfig, base=base | {"output_dir": str(tmp_path / "s"), "on_error": "skip"})
    summary = CollectStatsRunner(cfg, "train").run(progress=False).merged
    assert summary["utterances"] == 3 and summary["skipped"] == 4
    skipped = (tmp_path / "s/train/skipped.tsv").read_text()
    assert all(u in skipped for u in bad) and "header and data disagree" in skipped


def test_utf8_bom_is_not_part_of_the_first_id(tmp_path):
    wav = _wav(tmp_path / "a.wav")
    manifest = tmp_path / "bom.tsv"
    manifest.write_bytes(b"\xef\xbb\xbfutt1\t" + str(wav).encode() + b"\nutt2\t" + str(wav).encode() + b"\n")
    utts, _ = read_manifest(str(manifest), "train")
    assert [u.utt_id for u in utts] == ["utt1", "utt2"]
    plan = plan_manifest(str(manifest), "train", 10, {})
    from espnet3_flows.inputs.manifest import read_manifest_slice

    assert [u.utt_id for u in read_manifest_slice(plan.plan.shards[0].source)] == ["utt1", "utt2"]


@pytest.mark.parametrize("name", ["cuts.jsonl.gz", "m.tsv.gz"])
def test_a_gz_manifest_that_is_not_gzip_names_split_and_file(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"id": "x"}\n')
    with pytest.raises(ManifestError, match=rf"split 'dev': manifest .*{name} is not a valid gzip file"):
        read_manifest(str(path), "dev")
    with pytest.raises(ManifestError, match="not a valid gzip file"):
        from espnet3_flows.storage import Storage

        plan_manifest(str(path), "dev", 10, {}, spool=Storage(tmp_path / "out"))
    truncated = tmp_path / f"t-{name}"
    truncated.write_bytes(gzip.compress(b"".join(b"u%d\t/a.wav\n" % i for i in range(1000)))[:60])
    with pytest.raises(ManifestError, match="not a valid gzip file"):
        read_manifest(str(truncated), "dev")


@pytest.mark.parametrize("override", ["frontend.channel=-1", "frontend.sampling_rate=0", "frontend.max_duration=-5",
                                      "frontend.num_mel_bins=0", "shard_size=0", "batch_size=0", "fingerprint=mtime",
                                      "on_error=ignore"])
def test_impossible_collect_stats_values_are_config_errors(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1]):
        load_config(CollectStatsConfig, overrides=[override])


@pytest.mark.parametrize("override", ["xvector.channel=-2", "xvector.sampling_rate=-1", "xvector.max_duration=0"])
def test_impossible_xvector_values_are_config_errors(override):
    base = ["xvector.pretrained_model=/m", "xvector.manifest_paths.train=/m.tsv"]
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[-1]):
        load_config(XVectorJobConfig, overrides=[*base, override])


def test_lhotse_command_sources_need_allow_pipes(tmp_path):
    """A lhotse cut whose recording is read by a shell command is refused like a wav.scp command."""
    import json

    from espnet3_flows.inputs.audio import AudioConfig, AudioError, load_audio
    from espnet3_flows.inputs.records import ManifestError, Utterance
    from espnet3_flows.inputs.planner import plan_manifest

    marker = tmp_path / "ran"
    cut = {"id": "c1", "start": 0, "duration": 1.0, "channel": 0,
           "recording": {"id": "r1", "sampling_rate": 16000, "num_samples": 16000, "duration": 1.0, "channel_ids": [0],
                         "sources": [{"type": "command", "channels": [0], "source": f"touch {marker}; cat x.wav"}]}}
    manifest = tmp_path / "cuts.jsonl"
    manifest.write_text(json.dumps(cut) + "\n")
    with pytest.raises(ManifestError, match=r"cuts\.jsonl:1: utt 'c1': .*is a command; .*allow_pipes=true"):
        plan_manifest(str(manifest), "train", 10, {})
    with pytest.raises(AudioError, match="source type 'command'.*allow_pipes is false"):
        load_audio(Utterance("c1", "", payload=cut, format="lhotse"), AudioConfig())
    assert not marker.exists()
