"""Audio loading: decoding, resampling, channel choice, header checks and clear errors."""

from __future__ import annotations

import io
import uuid

import fsspec
import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.inputs.audio import AudioConfig, AudioError, read_audio, resample
from espnet3_flows.inputs.records import Utterance
from tests.support.audio_files import sparse_wav


def _sine(freq: float, seconds: float, sr: int) -> np.ndarray:
    return (0.4 * np.sin(2 * np.pi * freq * np.arange(int(seconds * sr)) / sr)).astype(np.float32)


def _utt(path, utt_id: str = "u1") -> Utterance:
    return Utterance(utt_id, str(path), line=3)


def test_mono_16k_is_read_as_is(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, _sine(440, 0.5, 16000), 16000, subtype="PCM_16")
    x = read_audio(_utt(path), AudioConfig())
    ref, _ = sf.read(path, dtype="float32")
    assert x.dtype == np.float32 and x.ndim == 1
    np.testing.assert_array_equal(x, ref)
    assert read_audio(_utt(f"file://{path}"), AudioConfig()).tobytes() == x.tobytes()


def test_resampling_to_the_target_rate(tmp_path):
    path = tmp_path / "a8k.wav"
    sf.write(path, _sine(440, 0.5, 8000), 8000, subtype="FLOAT")
    x = read_audio(_utt(path), AudioConfig(sampling_rate=16000))
    assert len(x) == 8000
    np.testing.assert_allclose(x[200:-200], _sine(440, 0.5, 16000)[200:-200], atol=2e-3)
    np.testing.assert_array_equal(x, resample(sf.read(path, dtype="float32")[0], 8000, 16000))


@pytest.mark.parametrize("orig,target", [(44100, 16000), (22050, 16000), (48000, 16000), (16000, 8000)])
def test_resample_uses_the_exact_ratio(orig, target):
    x = _sine(300, 0.3, orig)
    y = resample(x, orig, target)
    assert y.dtype == np.float32
    assert len(y) == -(-len(x) * target // orig)
    np.testing.assert_allclose(y[100:-100], _sine(300, 0.3, target)[100:-100][: len(y) - 200], atol=5e-3)


def test_channel_choice(tmp_path):
    path = tmp_path / "stereo.wav"
    data = np.stack([_sine(300, 0.2, 16000), _sine(1200, 0.2, 16000)], axis=1)
    sf.write(path, data, 16000, subtype="FLOAT")
    mean = read_audio(_utt(path), AudioConfig())
    np.testing.assert_allclose(mean, data.mean(axis=1), atol=1e-7)
    np.testing.assert_array_equal(read_audio(_utt(path), AudioConfig(channel=1)), data[:, 1])
    np.testing.assert_array_equal(read_audio(_utt(path), AudioConfig(channel=0)), data[:, 0])
    with pytest.raises(AudioError, match=r"utt 'u1' .*stereo\.wav.*channel 2 requested but the audio has 2 channel"):
        read_audio(_utt(path), AudioConfig(channel=2))
    # a mono file in a corpus read with channel=1 keeps its only channel
    mono = tmp_path / "mono.wav"
    sf.write(mono, data[:, 0], 16000, subtype="FLOAT")
    np.testing.assert_array_equal(read_audio(_utt(mono), AudioConfig(channel=1)), data[:, 0])


def test_errors_name_the_utterance(tmp_path):
    assert issubclass(AudioError, ValueError)  # the runner treats it as a bad item
    with pytest.raises(AudioError, match=r"utt 'u1': audio file not found: .*missing\.wav"):
        read_audio(_utt(tmp_path / "missing.wav"), AudioConfig())
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF" + np.random.default_rng(1).bytes(500))
    with pytest.raises(AudioError, match=r"utt 'u1' \(.*corrupt\.wav\): cannot decode audio"):
        read_audio(_utt(corrupt), AudioConfig())
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with pytest.raises(AudioError, match="zero-length audio"):
        read_audio(_utt(empty), AudioConfig())
    inf = tmp_path / "inf.wav"
    x = _sine(300, 0.1, 16000)
    x[7] = np.inf
    sf.write(inf, x, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN or Inf"):
        read_audio(_utt(inf), AudioConfig())


def test_max_duration_is_checked_from_the_header(tmp_path):
    path = tmp_path / "long.wav"
    sparse_wav(path, 3 * 3600, 8000)
    with pytest.raises(AudioError, match=r"utt 'u1' .*duration 10800\.0 s exceeds max_duration 3600 s"):
        read_audio(_utt(path), AudioConfig())
    short = tmp_path / "short.wav"
    sparse_wav(short, 2, 8000)
    with pytest.raises(AudioError, match="exceeds max_duration 1 s"):
        read_audio(_utt(short), AudioConfig(max_duration=1.0))
    assert len(read_audio(_utt(short), AudioConfig(sampling_rate=8000, max_duration=None))) == 16000


def test_remote_audio_through_fsspec(tmp_path):
    buf = io.BytesIO()
    x = _sine(500, 0.25, 16000)
    sf.write(buf, x, 16000, format="WAV", subtype="FLOAT")
    url = f"memory://audio-{uuid.uuid4().hex}/a.wav"
    with fsspec.open(url, "wb") as f:
        f.write(buf.getvalue())
    np.testing.assert_array_equal(read_audio(_utt(url), AudioConfig()), x)
    with pytest.raises(AudioError, match="audio file not found"):
        read_audio(_utt(url.replace("a.wav", "b.wav")), AudioConfig())


def test_lhotse_cut_audio(tmp_path):
    from lhotse import MonoCut, Recording

    path = tmp_path / "a8k.wav"
    sf.write(path, _sine(440, 0.5, 8000), 8000, subtype="FLOAT")
    rec = Recording.from_file(path, recording_id="r")
    cut = MonoCut(id="c", start=0.0, duration=rec.duration, channel=0, recording=rec).to_dict()
    via_lhotse = read_audio(Utterance("c", str(path), payload=cut, format="lhotse"), AudioConfig())
    np.testing.assert_allclose(via_lhotse, read_audio(_utt(path), AudioConfig()), atol=1e-6)

    long = tmp_path / "long.wav"
    sparse_wav(long, 2 * 3600, 8000)
    rec = Recording.from_file(long, recording_id="long")
    cut = MonoCut(id="long", start=0.0, duration=rec.duration, channel=0, recording=rec).to_dict()
    with pytest.raises(AudioError, match=r"utt 'long' .*duration 7200\.0 s exceeds max_duration"):
        read_audio(Utterance("long", str(long), payload=cut, format="lhotse"), AudioConfig())
