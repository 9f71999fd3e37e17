"""The fast 16-bit PCM WAV reader against libsndfile (soundfile): the same float32 samples to the bit
for every layout soundfile writes and a few it reads, and ``None`` (soundfile's turn, with its
errors) for anything else, so that a user's file is never read differently from before."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.inputs import pcm_wav
from espnet3_flows.inputs.audio import AudioConfig, AudioError, read_audio
from espnet3_flows.inputs.pcm_wav import read_pcm16_wav
from espnet3_flows.inputs.records import Utterance


def _soundfile(path) -> tuple[np.ndarray, int]:
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    return data.T, rate


def _noise(frames: int, channels: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(-32768, 32767, size=(frames, channels), endpoint=True, dtype=np.int16)
    x[:2] = [[-32768] * channels, [32767] * channels]  # both extremes
    return x


@pytest.mark.parametrize("channels", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["WAV", "WAVEX"])
@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_equals_soundfile_to_the_bit(tmp_path, channels, fmt, rate):
    path = tmp_path / "a.wav"
    sf.write(str(path), _noise(12345, channels), rate, subtype="PCM_16", format=fmt)
    got = read_pcm16_wav(str(path))
    assert got is not None, "a file soundfile wrote as 16-bit PCM must take the fast path"
    expected, expected_rate = _soundfile(path)
    assert got[1] == expected_rate
    assert got[0].dtype == np.float32 and got[0].shape == expected.shape
    np.testing.assert_array_equal(got[0], expected)


def _riff(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"WAVE" + b"".join(cid + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")
                              for cid, data in chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _fmt(tag: int = 1, channels: int = 1, rate: int = 16000, bits: int = 16) -> bytes:
    block = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)


def test_chunks_before_data_and_odd_sized_chunks_are_skipped(tmp_path):
    samples = _noise(1001, 1, seed=1)
    path = tmp_path / "list.wav"
    path.write_bytes(_riff([(b"fmt ", _fmt()), (b"LIST", b"INFOISFT\x05\x00\x00\x00odd!\x00"),
                            (b"junk", b"abc"), (b"data", samples.tobytes())]))
    got = read_pcm16_wav(str(path))
    assert got is not None
    np.testing.assert_array_equal(got[0], _soundfile(path)[0])


@pytest.mark.parametrize("subtype", ["PCM_24", "PCM_32", "FLOAT", "PCM_U8", "ULAW", "ALAW"])
def test_other_encodings_are_left_to_soundfile(tmp_path, subtype):
    path = tmp_path / "a.wav"
    sf.write(str(path), np.zeros(100, dtype=np.float32), 16000, subtype=subtype)
    assert read_pcm16_wav(str(path)) is None


def test_other_containers_are_left_to_soundfile(tmp_path):
    for name, fmt in (("a.flac", "FLAC"), ("a.ogg", "OGG"), ("a.aiff", "AIFF")):
        path = tmp_path / name
        sf.write(str(path), np.zeros(1000, dtype=np.float32), 16000, format=fmt)
        assert read_pcm16_wav(str(path)) is None, name
    (tmp_path / "empty.wav").write_bytes(b"")
    assert read_pcm16_wav(str(tmp_path / "empty.wav")) is None


@pytest.mark.parametrize("case", ["truncated", "data claims more", "empty data", "odd data", "no fmt",
                                  "data before fmt", "8-bit fmt", "block mismatch", "header too long"])
def test_suspicious_files_are_left_to_soundfile(tmp_path, case):
    data = _noise(500, 1).tobytes()
    chunks = {"truncated": None,
              "data claims more": None,
              "empty data": [(b"fmt ", _fmt()), (b"data", b"")],
              "odd data": [(b"fmt ", _fmt()), (b"data", data[:-1])],
              "no fmt": [(b"data", data)],
              "data before fmt": [(b"data", data), (b"fmt ", _fmt())],
              "8-bit fmt": [(b"fmt ", _fmt(bits=8)), (b"data", data)],
              "block mismatch": [(b"fmt ", struct.pack("<HHIIHH", 1, 1, 16000, 32000, 4, 16)), (b"data", data)],
              "header too long": [(b"fmt ", _fmt()), (b"LIST", b"x" * pcm_wav.HEADER_BYTES), (b"data", data)]}[case]
    raw = _riff(chunks) if chunks else _riff([(b"fmt ", _fmt()), (b"data", data)])
    if case == "truncated":
        raw = raw[:-100]
    if case == "data claims more":
        raw = raw[:-len(data) - 4] + struct.pack("<I", len(data) + 64) + data
    path = tmp_path / "x.wav"
    path.write_bytes(raw)
    assert read_pcm16_wav(str(path)) is None


def test_max_seconds_refuses_before_reading(tmp_path):
    path = tmp_path / "long.wav"
    sf.write(str(path), np.zeros(16000 * 3, dtype=np.int16), 16000, subtype="PCM_16")
    assert read_pcm16_wav(str(path), max_seconds=2.5) is None
    assert read_pcm16_wav(str(path), max_seconds=3.0) is not None


def test_the_loader_reads_through_it_and_keeps_its_errors(tmp_path):
    """``read_audio`` gives what it gave through soundfile, channel choice, resampling and the
    truncated-file and max-duration verdicts included."""
    stereo = tmp_path / "s.wav"
    sf.write(str(stereo), _noise(8000, 2, seed=3), 8000, subtype="PCM_16")
    for channel in (None, 0, 1):
        config = AudioConfig(sampling_rate=16000, channel=channel)
        got = read_audio(Utterance("u", str(stereo)), config)
        ref = _soundfile(stereo)[0]
        mono = ref.mean(axis=0, dtype=np.float64).astype(np.float32) if channel is None else ref[channel]
        from espnet3_flows.inputs.audio import resample

        np.testing.assert_array_equal(got, resample(mono, 8000, 16000))
    broken = tmp_path / "t.wav"
    broken.write_bytes(stereo.read_bytes()[:-1000])
    with pytest.raises(AudioError, match="truncated or corrupt"):
        read_audio(Utterance("t", str(broken)), AudioConfig(sampling_rate=8000))
    with pytest.raises(AudioError, match="exceeds max_duration"):
        read_audio(Utterance("l", str(stereo)), AudioConfig(sampling_rate=8000, max_duration=0.5))
