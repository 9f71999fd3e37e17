"""``load_many`` on decoding threads (``decode_threads``): the same audio, in order, as one at a
time, for every kind of entry; the first bad utterance's error; the threads the config picks; the
shard's next call's files decoded ahead while the caller works on this call's."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.config import ConfigError
from espnet3_flows.inputs.audio import AudioConfig, AudioError, RecordingCache, load_audio, load_many, recording_key
from espnet3_flows.inputs.records import Utterance
from espnet3_flows.stats.job import CollectStatsConfig
from espnet3_flows.utterance_job import GPU_DECODE_THREADS, audio_resources

SR = 16000


@pytest.fixture
def utterances(tmp_path) -> list[Utterance]:
    """Whole files (WAV and FLAC at two rates), segments of one recording, and a command."""
    rng = np.random.default_rng(0)
    utts = []
    for i in range(12):
        rate = 22050 if i % 4 == 3 else SR
        path = tmp_path / f"u{i}.{'flac' if i % 2 else 'wav'}"
        sf.write(path, (0.2 * rng.standard_normal(int(rate * rng.uniform(0.5, 2)))).astype(np.float32), rate)
        utts.append(Utterance(f"u{i}", str(path), line=i + 1))
    long = tmp_path / "rec.wav"
    sf.write(long, (0.2 * rng.standard_normal(5 * SR)).astype(np.float32), SR)
    utts += [Utterance(f"s{k}", str(long), line=20 + k, start=k * 1.0, end=k * 1.0 + 0.8, recording="rec")
             for k in range(3)]
    utts.append(Utterance("p0", f"cat {tmp_path / 'u0.wav'} |", line=30))
    return utts


def _cache(utts: list[Utterance], cwd: str = "", order: bool = False) -> RecordingCache:
    uses: dict[str, int] = {}
    for u in utts:
        if u.recording:
            uses[recording_key(u)] = uses.get(recording_key(u), 0) + 1
    return RecordingCache(uses, cwd, order=utts if order else ())


def test_threads_give_the_serial_result_in_order(utterances, tmp_path):
    serial_cfg = AudioConfig(allow_pipes=True)
    serial = [load_audio(u, serial_cfg, None, c) for c in [_cache(utterances, str(tmp_path))] for u in utterances]
    for threads in (2, 4):
        cache = _cache(utterances, str(tmp_path))
        got = load_many(utterances, AudioConfig(allow_pipes=True, decode_threads=threads), None, cache)
        assert len(got) == len(serial)
        for (a, ra), (b, rb) in zip(got, serial, strict=True):
            assert ra == rb
            np.testing.assert_array_equal(a, b)
        assert cache.decodes == 1  # the segments' recording, decoded once
    assert any(t.name.startswith("espnet3-decode") for t in threading.enumerate())


def test_the_first_bad_utterance_is_the_error(utterances, tmp_path):
    (tmp_path / "u3.flac").write_bytes(b"not audio")
    (tmp_path / "u7.flac").unlink()
    with pytest.raises(AudioError, match="u3"):
        load_many(utterances[:10], AudioConfig(decode_threads=4), None, _cache(utterances))


def test_decode_threads_config(tmp_path):
    manifest = tmp_path / "m.tsv"
    manifest.write_text("")
    base = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out")}
    with pytest.raises(ConfigError, match="decode_threads must be >= 0"):
        CollectStatsConfig(**base, decode_threads=-1)
    auto = CollectStatsConfig(**base)
    assert audio_resources(auto, SR, None, None)["audio"].decode_threads == 1
    assert audio_resources(auto, SR, None, None, device="cuda:0")["audio"].decode_threads == GPU_DECODE_THREADS
    assert audio_resources(CollectStatsConfig(**base, decode_threads=3), SR, None, None)["audio"].decode_threads == 3


def test_the_earlier_names_of_the_job_resource_builders_still_import():
    """Job plugins written before the rename import ``audio_env`` and ``build_env``."""
    from espnet3_flows.features.job import build_env, build_resources
    from espnet3_flows.utterance_job import audio_env, audio_resources

    assert audio_env is audio_resources and build_env is build_resources


def test_the_next_calls_files_are_decoded_ahead_and_taken_by_that_call(utterances, tmp_path):
    config = AudioConfig(allow_pipes=True, decode_threads=2)
    serial = [load_audio(u, AudioConfig(allow_pipes=True), None, _cache(utterances, str(tmp_path)))
              for u in utterances]
    cache = _cache(utterances, str(tmp_path), order=True)
    calls = [utterances[i:i + 4] for i in range(0, len(utterances), 4)]  # (the last: the segments and the command)
    got = load_many(calls[0], config, None, cache)
    assert sorted(cache.ahead) == sorted((u.utt_id, u.path) for u in calls[1])
    for future, _ in cache.ahead.values():
        future.result()
    for u in calls[1]:  # decoded already: the files may go
        os.remove(u.path)
    got += load_many(calls[1], config, None, cache)
    assert sorted(cache.ahead) == sorted((u.utt_id, u.path) for u in calls[2])
    got += load_many(calls[2], config, None, cache)
    assert cache.ahead == {}  # segments and commands are read in the calling thread, never ahead
    got += load_many(calls[3], config, None, cache)
    assert cache.ahead == {} and cache.decodes == 1
    for (a, ra), (b, rb) in zip(got, serial, strict=True):
        assert ra == rb
        np.testing.assert_array_equal(a, b)


def test_a_bad_file_decoded_ahead_fails_the_call_that_reads_it(utterances, tmp_path):
    (tmp_path / "u5.flac").write_bytes(b"not audio")
    cache = _cache(utterances, order=True)
    config = AudioConfig(decode_threads=2)
    assert len(load_many(utterances[:4], config, None, cache)) == 4  # u5 is decoded ahead, and fails there
    with pytest.raises(AudioError, match="u5"):
        load_many(utterances[4:8], config, None, cache)


def test_nothing_is_decoded_ahead_serially_after_the_shards_last_call_or_without_the_shards_order(utterances):
    whole = [u for u in utterances if not u.recording and not u.path.endswith("|")]
    for config, cache, call in ((AudioConfig(), _cache(whole, order=True), whole[:4]),
                                (AudioConfig(decode_threads=2), _cache(whole, order=True), whole[-4:]),
                                (AudioConfig(decode_threads=2), _cache(whole), whole[:4])):
        load_many(call, config, None, cache)
        assert cache.ahead == {}


def test_a_decode_ahead_is_taken_with_the_same_settings_only_and_dropped_when_no_call_takes_it(utterances):
    whole = utterances[:12]
    cache = _cache(whole, order=True)
    load_many(whole[:2], AudioConfig(decode_threads=2), None, cache)
    assert sorted(cache.ahead) == [("u2", whole[2].path), ("u3", whole[3].path)]
    eight = AudioConfig(sampling_rate=8000, decode_threads=2)  # other settings: decoded again, with these
    got = load_many(whole[2:4], eight, None, cache)
    for (a, _), u in zip(got, whole[2:4], strict=True):
        np.testing.assert_array_equal(a, load_audio(u, eight)[0])
    load_many(whole[8:10], AudioConfig(decode_threads=2), None, cache)  # u4, u5 were never read: dropped
    assert sorted(cache.ahead) == [("u10", whole[10].path), ("u11", whole[11].path)]


def test_decodes_still_queued_when_the_shard_goes_are_cancelled(utterances):
    from espnet3_flows.inputs.audio import _decode_pool

    release = threading.Event()
    blockers = [_decode_pool(2).submit(release.wait) for _ in range(2)]  # both threads busy
    try:
        segments = [u for u in utterances if u.recording]
        shard = [*segments, *utterances[:4]]
        cache = _cache(shard, order=True)
        load_many(segments, AudioConfig(decode_threads=2), None, cache)  # read here; u0..u2 queued ahead
        queued = [future for future, _ in cache.ahead.values()]
        assert len(queued) == 3 and not any(f.done() for f in queued)
        del cache  # the shard ended (or failed): nothing reads them
        assert all(f.cancelled() for f in queued)
    finally:
        release.set()
        for b in blockers:
            b.result()
