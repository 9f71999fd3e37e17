"""Kaldi data directories as manifests: wav.scp (paths, archives, commands), segments, utt2spk, text."""

from __future__ import annotations

import io
import pickle
import struct
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf

from espnet3_flows import external_sort
from espnet3_flows.inputs import kaldi_dir
from espnet3_flows.inputs.audio import AudioConfig, AudioError, RecordingCache, load_audio, run_pipe
from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.inputs.manifest import read_manifest_slice
from espnet3_flows.inputs.records import ManifestError, Utterance, fingerprint_target
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from espnet3_flows.frontends.frontend import FbankFrontend, FrontendConfig
from espnet3_flows.storage import Storage

SR = 16000


def _tone(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    x = 0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    return (x * 32767).astype(np.int16)


def _write_wav(path: Path, samples: np.ndarray) -> Path:
    sf.write(path, samples, SR, subtype="PCM_16")
    return path


@pytest.fixture
def recordings(tmp_path: Path) -> dict[str, np.ndarray]:
    """Three recordings: a WAV file, a WAV in a Kaldi archive, and a WAV behind a command."""
    return {"recA": _tone(2.0, 1), "recB": _tone(1.5, 2), "recC": _tone(1.2, 3)}


def _data_dir(tmp_path: Path, recs: dict[str, np.ndarray], counter: Path | None = None) -> Path:
    d = tmp_path / "data" / "train"
    d.mkdir(parents=True)
    audio = tmp_path / "audio"
    audio.mkdir()
    a = _write_wav(audio / "recA.wav", recs["recA"])
    ark = audio / "recB.ark"
    kaldiio.save_ark(str(ark), {"recB": (SR, recs["recB"])}, scp=str(audio / "recB.scp"))
    ark_entry = (audio / "recB.scp").read_text().split(None, 1)[1].strip()  # "/abs/recB.ark:6"
    c = _write_wav(audio / "recC.wav", recs["recC"])
    counter_cmd = f"echo run >> {counter}; " if counter else ""
    (d / "wav.scp").write_text(f"recA {a}\nrecB {ark_entry}\nrecC sh -c '{counter_cmd}cat {c}' |\n")
    (d / "segments").write_text(
        "recA-000-050 recA 0.00 0.50\n"
        "recA-050-120 recA 0.50 1.20\n"
        "recA-120-200 recA 1.20 2.00\n"
        "recB-000-070 recB 0.00 0.70\n"
        "recB-070-end recB 0.70 -1\n"
        "recC-000-060 recC 0.00 0.60\n"
        "recC-060-120 recC 0.60 1.20\n")
    speakers = {"recA": "spk1", "recB": "spk2", "recC": "spk1"}
    utts = [line.split()[0] for line in (d / "segments").read_text().splitlines()]
    (d / "utt2spk").write_text("".join(f"{u} {speakers[u[:4]]}\n" for u in utts))
    (d / "text").write_text("".join(f"{u} hello world {i}\n" for i, u in enumerate(utts)))
    return d


def _expected_segment(recs: dict[str, np.ndarray], utt: str) -> np.ndarray:
    rec, start, end = utt[:4], utt.split("-")[1], utt.split("-")[2]
    x = recs[rec].astype(np.float32) / 32768.0
    first = int(round(int(start) / 100 * SR))
    stop = x.size if end == "end" else int(round(int(end) / 100 * SR))
    return x[first:stop]


def _stats_cfg(manifest: Path | str, out: Path, *extra: str) -> CollectStatsConfig:
    return load_config(CollectStatsConfig, overrides=[
        f"manifests.train={manifest}", f"output_dir={out}", "parallel.env=serial", *extra])


def _run(cfg: CollectStatsConfig):
    return CollectStatsRunner(cfg, "train").run(progress=False)


# ---- end to end -----------------------------------------------------------------------------
def test_segments_archive_and_command_give_the_sliced_audio(tmp_path, recordings):
    counter = tmp_path / "decodes.txt"
    d = _data_dir(tmp_path, recordings, counter)
    out = tmp_path / "out"
    outcome = _run(_stats_cfg(d, out, "allow_pipes=true", "write_collected_feats=true", "shard_size=100"))
    assert outcome.merged["utterances"] == 7
    # recC has two segments in the one shard: its command ran once
    assert counter.read_text().splitlines() == ["run"]
    feats = dict(kaldiio.load_scp(str(out / "train/collect_feats/feats.scp")))
    fbank = FbankFrontend(FrontendConfig())
    segments = [line.split()[0] for line in (d / "segments").read_text().splitlines()]
    assert sorted(feats) == segments
    for utt in segments:
        want = fbank([_expected_segment(recordings, utt)], {})[0]
        np.testing.assert_allclose(feats[utt], want, rtol=1e-5, atol=1e-5, err_msg=utt)
    shapes = dict(line.split(" ", 1) for line in (out / "train/speech_shape").read_text().splitlines())
    assert {u: int(v) for u, v in shapes.items()} == {u: _expected_segment(recordings, u).size for u in segments}


def test_header_only_lengths_of_segments(tmp_path, recordings):
    d = _data_dir(tmp_path, recordings)
    out = tmp_path / "out"
    _run(_stats_cfg(d, out, "allow_pipes=true", "frontend.type=none"))
    shapes = dict(line.split(" ", 1) for line in (out / "train/speech_shape").read_text().splitlines())
    assert {u: int(v) for u, v in shapes.items()} == {u: _expected_segment(recordings, u).size for u in shapes}
    assert len(shapes) == 7


def test_commands_are_refused_without_allow_pipes(tmp_path, recordings):
    d = _data_dir(tmp_path, recordings)
    with pytest.raises(ManifestError, match=r"wav\.scp:3: the entry .*cat .* is a command; .*allow_pipes=true"):
        _run(_stats_cfg(d, tmp_path / "out"))
    with pytest.raises(ManifestError, match=r"valid\.tsv:1: utt 'u1': the audio entry .* is a command"):
        manifest = tmp_path / "valid.tsv"
        manifest.write_text("u1\tcat /dev/null |\n")
        _run(_stats_cfg(manifest, tmp_path / "out2", "on_error=skip"))
    # and the worker refuses too, whatever planned the shard
    with pytest.raises(AudioError, match="allow_pipes is false"):
        load_audio(Utterance("u1", "cat x.wav |"), AudioConfig())


def test_command_failure_and_timeout(tmp_path):
    cfg = AudioConfig(allow_pipes=True, pipe_timeout=1.0)
    with pytest.raises(AudioError, match=r"exit status 3; stderr: sph2pipe: cannot open X\.sph"):
        run_pipe("sh -c 'echo sph2pipe: cannot open X.sph >&2; exit 3' |", cfg)
    with pytest.raises(AudioError, match="wrote no audio"):
        run_pipe("true |", cfg)
    marker, pid_file = tmp_path / "still-running", tmp_path / "child.pid"
    with pytest.raises(TimeoutError, match="pipe_timeout=1 s"):
        # a child of the shell that would outlive a kill of the shell alone
        run_pipe(f"sh -c 'echo $$ > {pid_file}; sleep 3; touch {marker}' & wait |", cfg)
    import time

    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child), "the command's children were not killed"
    assert not marker.exists()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_streamed_wav_from_a_command(tmp_path):
    """sox and sph2pipe write to a pipe with unknown sizes (0xFFFFFFFF); the bytes received count."""
    x = _tone(0.5, 4)
    buf = io.BytesIO()
    sf.write(buf, x, SR, format="WAV", subtype="PCM_16")
    data = bytearray(buf.getvalue())
    pos = data.index(b"data")
    data[pos + 4:pos + 8] = struct.pack("<I", 0xFFFFFFFF)
    data[4:8] = struct.pack("<I", 0xFFFFFFFF)
    streamed = tmp_path / "streamed.bin"
    streamed.write_bytes(bytes(data))
    got, rate = load_audio(Utterance("u", f"cat {streamed} |"), AudioConfig(allow_pipes=True))
    assert rate == SR
    np.testing.assert_array_equal(got, x.astype(np.float32) / 32768.0)


def test_archive_entries_that_are_not_audio_are_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ark = tmp_path / "evil.ark"
    ark.write_bytes(b"utt1 PKL" + pickle.dumps(Evil()))
    with pytest.raises(AudioError, match="holds a pickle, not audio"):
        load_audio(Utterance("utt1", f"ark:{ark}:5"), AudioConfig())
    assert not marker.exists()
    mat = tmp_path / "feats.ark"
    kaldiio.save_ark(str(mat), {"utt1": np.zeros((3, 2), dtype=np.float32)})
    with pytest.raises(AudioError, match="holds a Kaldi matrix"):
        load_audio(Utterance("utt1", f"ark:{mat}:5"), AudioConfig())


def test_bad_lines_named_under_fail_and_listed_under_skip(tmp_path, recordings):
    d = _data_dir(tmp_path, recordings)
    (d / "segments").write_text(
        "recA-000-050 recA 0.00 0.50\n"
        "recA-bad-order recA 0.80 0.80\n"      # end not after start
        "recA-past-end recA 1.50 3.50\n"        # past the end of a 2 s recording (found by the worker)
        "recB-000-070 recB 0.00 0.70\n"
        "recZ-000-010 recZ 0.00 0.10\n")       # recording missing from wav.scp
    (d / "wav.scp").write_text((d / "wav.scp").read_text().splitlines()[0] + "\n"
                               + (d / "wav.scp").read_text().splitlines()[1] + "\n")
    seg = d / "segments"
    with pytest.raises(ManifestError, match=rf"{seg}:2: utt 'recA-bad-order': end 0.80 must be after start 0.80"):
        _run(_stats_cfg(d, tmp_path / "fail"))
    out = tmp_path / "skip"
    outcome = _run(_stats_cfg(d, out, "on_error=skip"))
    assert outcome.merged["utterances"] == 2
    rows = [line.split("\t") for line in (out / "train/skipped.tsv").read_text().splitlines()[1:]]
    by_utt = {r[1]: r for r in rows}
    assert set(by_utt) == {"recA-bad-order", "recA-past-end", "recZ-000-010"}
    assert by_utt["recZ-000-010"][2] == "5" and "recording 'recZ' is not in wav.scp" in by_utt["recZ-000-010"][4]
    assert by_utt["recA-bad-order"][2] == "2"
    assert by_utt["recA-past-end"][2] == "3" and "past the end of recording 'recA' (2.000 s)" in by_utt[
        "recA-past-end"][4]
    # the worker's error under fail names the segments file and line too
    (d / "segments").write_text("recA-past-end recA 1.50 3.50\n")
    with pytest.raises(Exception, match=rf"{seg}:1, utt 'recA-past-end'.*past the end"):
        _run(_stats_cfg(d, tmp_path / "fail2"))


def test_duplicates_and_malformed_lines(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    wav = _write_wav(tmp_path / "a.wav", _tone(0.3, 1))
    (d / "wav.scp").write_text(f"u1 {wav}\nu1 {wav}\nu2\nu3 {wav}\n")
    with pytest.raises(ManifestError, match=r"wav\.scp:2: utt 'u1': duplicate utterance id 'u1' \(first on line 1\)"):
        _join(d)
    buf = io.BytesIO()
    res = kaldi_dir.join_data_dir(str(d), "train", buf, on_error="skip")
    assert [(s.utt_id, s.line) for s in res.skipped] == [("u1", 2), ("u2", 3)]
    assert [ln.split("\t")[0] for ln in buf.getvalue().decode().splitlines()] == ["u1", "u3"]
    (d / "wav.scp").write_text("")
    with pytest.raises(ManifestError, match="has no usable utterance"):
        _join(d)
    (d / "wav.scp").unlink()
    with pytest.raises(ManifestError, match="is a directory without wav.scp"):
        _run(_stats_cfg(d, tmp_path / "out"))


def _join(d: Path, on_error: str = "fail") -> list[Utterance]:
    buf = io.BytesIO()
    kaldi_dir.join_data_dir(str(d), "train", buf, on_error=on_error)
    return [kaldi_dir.parse_joined_line(line) for line in buf.getvalue().decode().splitlines()]


def test_unsorted_files_are_joined_in_key_order(tmp_path, monkeypatch):
    monkeypatch.setattr(external_sort, "CHUNK_ROWS", 3)  # several runs merged from disk
    d = tmp_path / "d"
    d.mkdir()
    wav = _write_wav(tmp_path / "a.wav", _tone(0.3, 1))
    ids = [f"utt{i:02d}" for i in range(10)]
    order = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
    (d / "wav.scp").write_text("".join(f"{ids[i]} {wav}\n" for i in order))
    (d / "utt2spk").write_text("".join(f"{ids[i]} s{i % 3}\n" for i in reversed(order)))
    (d / "text").write_text("".join(f"{ids[i]}\tword\t{i}\n" for i in order[::2]))  # tabs, some missing
    utts = _join(d)
    assert [u.utt_id for u in utts] == ids
    assert [u.speaker for u in utts] == [f"s{i % 3}" for i in range(10)]
    assert [u.text for u in utts] == [f"word {i}" if i in order[::2] else "" for i in range(10)]
    assert [u.line for u in utts] == [order.index(i) + 1 for i in range(10)]


def test_adding_wav_scp_lines_recomputes_only_new_shards(tmp_path):
    wavs = [_write_wav(tmp_path / f"w{i}.wav", _tone(0.2 + 0.01 * i, i)) for i in range(10)]
    d = tmp_path / "data"
    d.mkdir()
    ids = [f"spk{i % 4}-utt{i:04d}" for i in range(300)]
    keep = sorted(ids[::2])
    (d / "wav.scp").write_text("".join(f"{u} {wavs[int(u[-4:]) % 10]}\n" for u in keep))
    out = tmp_path / "out"
    first = _run(_stats_cfg(d, out, "frontend.type=none", "shard_size=10"))
    assert first.computed == len(first.shards) > 5
    grown = sorted(keep + ids[1:30:2])  # new lines inserted among the first ones: later line numbers shift
    (d / "wav.scp").write_text("".join(f"{u} {wavs[int(u[-4:]) % 10]}\n" for u in grown))
    again = _run(_stats_cfg(d, out, "frontend.type=none", "shard_size=10"))
    assert again.merged["utterances"] == len(grown)
    new = set(ids[1:30:2])
    receiving = [s for s in again.plan.shards if any(u.utt_id in new for u in read_manifest_slice(s.source, "train"))]
    assert 0 < again.computed <= len(receiving) + 2
    assert again.cached >= len(again.shards) - len(receiving) - 2 > 0


def test_join_is_reused_until_a_file_changes(tmp_path, recordings, monkeypatch):
    d = _data_dir(tmp_path, recordings)
    store = Storage(tmp_path / "out")
    calls = []
    real = kaldi_dir.join_data_dir
    monkeypatch.setattr(kaldi_dir, "join_data_dir", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = kaldi_dir.prepare_joined(str(d), "train", store, "inputs")
    b = kaldi_dir.prepare_joined(str(d), "train", store, "inputs")
    assert a.path == b.path and len(calls) == 1
    (d / "utt2spk").write_text((d / "utt2spk").read_text().replace("spk2", "spk9"))
    c = kaldi_dir.prepare_joined(str(d), "train", store, "inputs")
    assert c.path != a.path and len(calls) == 2
    # a join that left lines out under skip is an error when the next run says fail
    (d / "segments").write_text((d / "segments").read_text() + "recZ-000-010 recZ 0.00 0.10\n")
    kaldi_dir.prepare_joined(str(d), "train", store, "inputs", on_error="skip")
    with pytest.raises(ManifestError, match=r"segments:8: utt 'recZ-000-010': recording 'recZ' is not in wav.scp"):
        kaldi_dir.prepare_joined(str(d), "train", store, "inputs", on_error="fail")


def test_entries_and_fingerprint_targets(tmp_path):
    cwd = str(tmp_path)
    assert kaldi_dir.normalize_entry("/x/a.ark:12", cwd) == "ark:/x/a.ark:12"
    assert kaldi_dir.normalize_entry("ark:rel/a.ark:12", cwd) == f"ark:{tmp_path}/rel/a.ark:12"
    assert kaldi_dir.normalize_entry("downloads/a.wav", cwd) == f"{tmp_path}/downloads/a.wav"
    assert kaldi_dir.normalize_entry("s3://b/a.wav", cwd) == "s3://b/a.wav"
    assert kaldi_dir.normalize_entry("sph2pipe -f wav x.sph |", cwd) == "sph2pipe -f wav x.sph |"
    assert fingerprint_target("ark:/x/a.ark:12") == "/x/a.ark"
    assert fingerprint_target("sph2pipe -f wav /d/x.sph |") == "/d/x.sph"
    assert fingerprint_target("sox X.flac -t wav - |") == "X.flac"
    assert fingerprint_target("gen-noise --seconds 3 |") == ""


def test_recording_cache_decodes_once_and_drops_after_last_use():
    cache = RecordingCache({"r": 2}, max_bytes=1 << 20)
    decode = lambda: (np.zeros((1, 10), dtype=np.float32), SR)  # noqa: E731
    cache.get("r", decode)
    cache.done("r")
    cache.get("r", decode)
    cache.done("r")
    assert cache.decodes == 1 and cache._bytes == 0


def test_xvector_speakers_come_from_utt2spk(tmp_path, recordings):
    from espnet3_flows.xvector.job import XVectorJobConfig, XVectorRunner
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    d = _data_dir(tmp_path, recordings)
    model = build_random_ecapa_dir(tmp_path / "ecapa")
    out = tmp_path / "xv"
    cfg = load_config(XVectorJobConfig, overrides=[
        f"xvector.pretrained_model={model}", f"xvector.manifest_paths.train={d}", f"xvector.save_path={out}",
        "allow_pipes=true", "parallel.env=serial"])
    summary = XVectorRunner(cfg, "train").run(progress=False).merged
    assert summary["utterances"] == 7 and summary["speakers"] == 2
    utt = kaldiio.load_scp(str(out / "xvector/train/xvector.scp"))
    spk = kaldiio.load_scp(str(out / "xvector/train/spk_xvector.scp"))
    assert sorted(spk) == ["spk1", "spk2"]
    members = [u for u in utt if u.startswith(("recA", "recC"))]
    np.testing.assert_allclose(spk["spk1"], np.mean([utt[u] for u in members], axis=0), rtol=1e-5, atol=1e-6)


def test_config_checks_pipe_timeout(tmp_path):
    with pytest.raises(ConfigError, match="pipe_timeout must be a positive number"):
        _stats_cfg(tmp_path, tmp_path / "out", "pipe_timeout=0")


def test_data_dir_and_audio_on_s3(tmp_path, recordings, s3_output, dask_client):
    """A data directory in an object store, its wav.scp naming audio URLs and an archive there,
    planned on the driver and read by Dask workers through s3fs."""
    import fsspec

    url, options = s3_output
    fs = fsspec.filesystem("s3", **options)
    root = url.rsplit("/", 1)[0]
    local = _data_dir(tmp_path, recordings)
    fs.put_file(str(tmp_path / "audio/recA.wav"), f"{root}/audio/recA.wav")
    fs.put_file(str(tmp_path / "audio/recB.ark"), f"{root}/audio/recB.ark")
    offset = (tmp_path / "audio/recB.scp").read_text().rsplit(":", 1)[1].strip()
    fs.pipe_file(f"{root}/data/train/wav.scp",
                 f"recA {root}/audio/recA.wav\nrecB ark:{root}/audio/recB.ark:{offset}\n".encode())
    segments = "".join(line + "\n" for line in (local / "segments").read_text().splitlines() if line.startswith("recA")
                       or line.startswith("recB"))
    fs.pipe_file(f"{root}/data/train/segments", segments.encode())
    fs.pipe_file(f"{root}/data/train/utt2spk", (local / "utt2spk").read_bytes())
    cfg = _stats_cfg(f"{root}/data/train", "", "frontend.type=none", f"output_dir={url}", "shard_size=2",
                     *[f"storage_options.{k}={v}" for k, v in options.items() if not isinstance(v, dict)],
                     *[f"storage_options.client_kwargs.{k}={v}" for k, v in options.get("client_kwargs", {}).items()])
    outcome = CollectStatsRunner(cfg, "train").run(client=dask_client, progress=False)
    assert outcome.merged["utterances"] == 5
    shapes = dict(line.split(" ", 1) for line in fs.cat_file(f"{url}/train/speech_shape").decode().splitlines())
    assert {u: int(v) for u, v in shapes.items()} == {u: _expected_segment(recordings, u).size for u in shapes}
    # a changed file in the store is a new join (its ETag changed)
    fs.pipe_file(f"{root}/data/train/utt2spk", (local / "utt2spk").read_text().replace("spk2", "spk9").encode())
    again = CollectStatsRunner(cfg, "train").run(client=dask_client, progress=False)
    assert again.merged["utterances"] == 5
    assert len([p for p in fs.ls(f"{url}/train/shards/inputs") if p.endswith(".kaldi.tsv")]) == 2


def test_unsorted_files_keep_carriage_returns_out_of_the_join(tmp_path, monkeypatch):
    monkeypatch.setattr(external_sort, "CHUNK_ROWS", 1)
    d = tmp_path / "d"
    d.mkdir()
    wav = _write_wav(tmp_path / "a.wav", _tone(0.3, 1))
    (d / "wav.scp").write_text(f"a {wav}\nb {wav}\n")
    (d / "text").write_bytes(b"b hello\rworld\na hi\r\n")  # out of order, a \r inside and one at the end
    utts = _join(d)
    assert [(u.utt_id, u.text) for u in utts] == [("a", "hi"), ("b", "hello world")]


def test_ids_starting_with_a_hash_are_utterances_on_both_sides(tmp_path):
    """Kaldi files have no comments: '#u0' is an id. Planning and the worker must agree on it."""
    d = tmp_path / "d"
    d.mkdir()
    wav = _write_wav(tmp_path / "a.wav", _tone(0.3, 1))
    (d / "wav.scp").write_text(f"#u0 {wav}\nu1 {wav}\n")
    out = tmp_path / "out"
    outcome = _run(_stats_cfg(d, out, "frontend.type=none"))
    assert outcome.merged["utterances"] == 2
    assert sorted(line.split()[0] for line in (out / "train/speech_shape").read_text().splitlines()) == ["#u0", "u1"]


def test_flac_and_wav_records_in_one_archive_read_only_their_bytes(tmp_path, monkeypatch):
    """ESPnet's flac.ark: kaldiio AUDIO records (a length, then FLAC); each entry is read alone."""
    x, y = _tone(0.4, 1), _tone(0.6, 2)
    ark = tmp_path / "flac.ark"
    kaldiio.save_ark(str(ark), {"a": (SR, x), "b": (SR, y)}, scp=str(tmp_path / "flac.scp"),
                     write_function="soundfile", write_kwargs={"format": "flac"})
    entries = dict(line.split() for line in (tmp_path / "flac.scp").read_text().splitlines())
    reads = []
    import contextlib

    import espnet3_flows.inputs.audio as audio_module

    real_open = audio_module.fsspec.open

    class Recorded:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def recording_open(*args, **kwargs):
        with real_open(*args, **kwargs) as f:
            yield Recorded(f)

    monkeypatch.setattr(audio_module.fsspec, "open", recording_open)
    for key, want in (("a", x), ("b", y)):
        got, rate = load_audio(Utterance(key, "ark:" + entries[key]), AudioConfig())
        np.testing.assert_array_equal(got, want.astype(np.float32) / 32768.0)
    assert reads and -1 not in reads, "an archive entry was read to the end of the archive"
    monkeypatch.setattr(audio_module.fsspec, "open", real_open)
    truncated = tmp_path / "cut.ark"
    kaldiio.save_ark(str(truncated), {"a": (SR, x)}, scp=str(tmp_path / "cut.scp"))
    truncated.write_bytes(truncated.read_bytes()[:200])
    offset = (tmp_path / "cut.scp").read_text().split()[1]
    with pytest.raises(AudioError, match="truncated"):
        load_audio(Utterance("a", "ark:" + offset), AudioConfig())
