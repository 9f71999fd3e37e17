"""The fast path of ESPnet2's ``default`` frontend against ESPnet2's own ``DefaultFrontend`` class:
the same mel matrix as librosa's (to the bit), the same features to float32 rounding for every
option it covers, at every length down to the shortest ESPnet2 accepts, the same statistics; and
the class (with one warning) for what it does not cover."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from espnet3_flows.config import ConfigError
from espnet3_flows.errors import BadItemError
from espnet3_flows.frontends import espnet2_default
from espnet3_flows.frontends.espnet2_type import fast_default
from espnet3_flows.frontends.espnet2_default import (Espnet2FrontendTooShortError, FastDefaultFrontend,
                                                     build_fast_default, mel_matrix, read_default_conf)
from espnet3_flows.frontends.frontend import (ESPNET2_DEFAULT_IMPLEMENTATION, FrontendConfig, PerUtterance,
                                              TorchFrontend, build_frontend, frontend_modules)

# measured <= 1.9e-6, one float32 ulp of log-mel values of magnitude 8-16 (99.7 % of values are equal to the
# bit): the banded mel sums add in another order than ESPnet2's dense product
ATOL = 5e-6

#: every option DefaultFrontend has that the fast path computes, alone and combined
CONFS = [
    {},
    {"n_fft": 400, "win_length": 400, "hop_length": 160},
    {"n_fft": 512, "win_length": 400, "hop_length": 160, "window": "hamming"},
    {"window": None},
    {"window": None, "win_length": 320},
    {"window": "blackman", "win_length": 511},
    {"window": "bartlett"},
    {"window": "kaiser"},
    {"center": False},
    {"center": False, "n_fft": 400, "win_length": 320, "hop_length": 100},
    {"normalized": True},
    {"n_mels": 40, "fs": "8k", "n_fft": 256, "hop_length": 80},
    {"fmin": 80, "fmax": 7600},
    {"htk": True},
    {"htk": True, "fmin": 20, "fmax": 4000, "n_mels": 64},
    {"fs": 22050, "n_fft": 1024, "hop_length": 256, "n_mels": 128},
    {"fs": "24k", "n_fft": 1024, "hop_length": 240, "n_mels": 100},
    {"fs": "44.1k", "n_fft": 2048, "win_length": 1764, "hop_length": 441, "n_mels": 128, "fmin": 30},
    {"n_fft": 511, "hop_length": 100},
    {"fs": 800, "n_fft": 2, "hop_length": 1, "n_mels": 1},
    {"frontend_conf": None},
    {"frontend_conf": {"use_wpe": False, "use_beamformer": False}, "onesided": True, "apply_stft": True},
]


def _ids(conf: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items()) or "default"


def _espnet2(conf: dict):
    from espnet2.asr.frontend.default import DefaultFrontend

    return DefaultFrontend(**conf).eval()


def _reference(frontend, wave: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        feats, lengths = frontend(torch.from_numpy(wave)[None], torch.tensor([len(wave)]))
    return feats[0, : int(lengths[0])].numpy()


def speech_like(n: int, fs: int, seed: int) -> np.ndarray:
    """Harmonics of a moving pitch under a syllable-rate envelope, with a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / fs
    f0 = 120 + 60 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / fs) / k for k in range(1, 12)) * 0.1
    return (x * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) + 0.005 * rng.standard_normal(n)).astype(np.float32)


def _signals(n: int, fs: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / fs
    return [(0.1 * rng.standard_normal(n)).astype(np.float32), speech_like(n, fs, seed),
            np.zeros(n, np.float32), np.clip(2 * np.sin(2 * np.pi * 440 * t), -1, 1).astype(np.float32),
            (0.3 + 1e-6 * rng.standard_normal(n)).astype(np.float32)]


def _lengths(fast: FastDefaultFrontend) -> list[int]:
    """The shortest, the next, lengths around a hop, and 0.5, 1 and 4 s."""
    s = fast.spec
    short = [fast.min_samples, fast.min_samples + 1, s.n_fft + s.hop_length - 1, s.n_fft + s.hop_length]
    return sorted({n for n in short if n >= fast.min_samples} | {s.fs // 2 + 3, s.fs, 4 * s.fs + 7})


@pytest.mark.parametrize("conf", CONFS, ids=_ids)
def test_same_mel_matrix_as_librosa_to_the_bit(conf):
    import librosa

    spec, _ = read_default_conf(conf)
    ours = mel_matrix(spec.fs, spec.n_fft, spec.n_mels, spec.fmin, spec.fmax, spec.htk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (n_fft=2: empty filters, warned by both)
        ref = librosa.filters.mel(sr=spec.fs, n_fft=spec.n_fft, n_mels=spec.n_mels, fmin=spec.fmin, fmax=spec.fmax,
                                  htk=spec.htk)
    assert ours.dtype == ref.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(ours.T, _espnet2(conf).logmel.melmat.numpy())


def test_empty_mel_filters_are_warned_as_librosa_warns():
    with pytest.warns(UserWarning, match="empty filters"):
        mel_matrix(8000, 64, 80, 0, 4000.0, False)


@pytest.mark.filterwarnings("ignore:A window was not provided")  # torch.stft's, for ESPnet2's window=None
@pytest.mark.filterwarnings("ignore:.*mpty filters")
@pytest.mark.parametrize("conf", CONFS, ids=_ids)
def test_same_features_as_espnet2_default_frontend(conf):
    spec, uncovered = read_default_conf(conf)
    assert spec is not None and uncovered == []
    fast, ref = FastDefaultFrontend(spec), _espnet2(conf)
    for n in _lengths(fast):
        for wave in _signals(n, spec.fs, seed=n):
            expected, got = _reference(ref, wave), fast(wave)
            assert got.shape == expected.shape and got.dtype == np.float32 and got.flags.c_contiguous
            np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL, err_msg=f"{n} samples")


@pytest.mark.parametrize("conf", [{}, {"n_fft": 511}, {"center": False}, {"n_fft": 400, "win_length": 300}], ids=_ids)
def test_too_short_is_a_bad_item_exactly_where_espnet2_fails(conf):
    fast, ref = FastDefaultFrontend(read_default_conf(conf)[0]), _espnet2(conf)
    shortest = np.zeros(fast.min_samples, np.float32)
    assert fast(shortest).shape == _reference(ref, shortest).shape
    with pytest.raises(RuntimeError):
        _reference(ref, shortest[:-1])
    with pytest.raises(Espnet2FrontendTooShortError, match=f"audio of {fast.min_samples - 1} samples is too short"):
        fast(shortest[:-1])
    assert issubclass(Espnet2FrontendTooShortError, BadItemError)  # subject to on_error


def test_input_is_never_modified_and_may_be_read_only():
    fast = FastDefaultFrontend(read_default_conf({})[0])
    wave = speech_like(16000, 16000, 1)
    kept = wave.copy()
    wave.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(fast(wave), _reference(_espnet2({}), kept), rtol=0, atol=ATOL)
    np.testing.assert_array_equal(wave, kept)
    with pytest.raises(ValueError, match="mono"):
        fast(np.zeros((2, 16000), np.float32))


def test_statistics_equal_espnet2s_class_over_a_small_set():
    """count, sum and sum of squares (float64, as collect-stats accumulates them) of 24 utterances
    of 0.02-3 s, from the fast path and from ESPnet2's class."""
    conf = {"n_fft": 512, "hop_length": 128, "n_mels": 80, "fs": "16k"}
    fast, ref = FastDefaultFrontend(read_default_conf(conf)[0]), _espnet2(conf)
    rng = np.random.default_rng(7)
    waves = [speech_like(int(rng.uniform(0.02, 3) * 16000), 16000, i) for i in range(24)]
    stats = []
    for extract in (fast, lambda w: _reference(ref, w)):
        feats = np.concatenate([extract(w) for w in waves]).astype(np.float64)
        stats.append((len(feats), feats.sum(0), (feats ** 2).sum(0)))
    (count, total, squares), (ref_count, ref_total, ref_squares) = stats
    assert count == ref_count
    np.testing.assert_allclose(total, ref_total, rtol=1e-7)  # measured ~1e-9
    np.testing.assert_allclose(squares, ref_squares, rtol=1e-7)


# ---- what the fast path does not cover: ESPnet2's class, one warning naming the option -------------
@pytest.mark.parametrize("conf, named", [
    ({"apply_stft": False}, "apply_stft=False"),
    ({"onesided": False}, "onesided=False"),
    ({"frontend_conf": {"use_wpe": True}}, "frontend_conf.use_wpe=True"),
    ({"frontend_conf": {"use_beamformer": True, "bnmask": 3}}, "frontend_conf.use_beamformer=True"),
    ({"upsample": 2}, "upsample=2"),
])
def test_uncovered_options_run_espnet2s_class_with_one_warning(conf, named):
    spec, uncovered = read_default_conf(conf)
    assert spec is None and uncovered == [named]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        cfg = FrontendConfig(type="espnet2", conf=conf)
        FrontendConfig(type="espnet2", conf=conf)  # (the early start and main each read the config)
    [warning] = [w for w in caught if "fast path" in str(w.message)]
    assert named in str(warning.message) and "DefaultFrontend class runs instead" in str(warning.message)
    assert not fast_default(cfg)
    assert frontend_modules(cfg) == ("espnet2.asr.frontend.default", "librosa.filters")
    assert cfg.hashed()["implementation"] != ESPNET2_DEFAULT_IMPLEMENTATION
    if "upsample" not in conf:  # (ESPnet 202511 has no such option: its class rejects it when built)
        assert isinstance(build_frontend(cfg), TorchFrontend)


def test_espnet2_class_switch_and_gpu_run_the_class_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forced = FrontendConfig(type="espnet2", espnet2_class=True, conf={"n_fft": 400})
        gpu = FrontendConfig(type="espnet2", device="cuda", conf={"apply_stft": False})
    fast = FrontendConfig(type="espnet2", conf={"n_fft": 400})
    assert fast_default(fast) and not fast_default(forced) and not fast_default(gpu)
    assert isinstance(build_frontend(fast), PerUtterance) and isinstance(build_frontend(forced), TorchFrontend)
    assert fast.hashed()["implementation"] == ESPNET2_DEFAULT_IMPLEMENTATION
    assert forced.hashed() == {**fast.hashed(), "implementation": forced.hashed()["implementation"],
                               "max_batch_samples": 0}
    assert frontend_modules(fast) == ("torch", "espnet3_flows.frontends.espnet2_default")
    with pytest.raises(ConfigError, match="frontend.espnet2_class are for type=espnet2, not type=fbank"):
        FrontendConfig(espnet2_class=True)


@pytest.mark.parametrize("conf, message", [
    ({"n_fft": 512.0}, r"frontend.conf.n_fft=512.0 must be an int"),
    ({"center": 1}, r"frontend.conf.center=1 must be a bool"),
    ({"fmin": 20.5}, r"frontend.conf.fmin=20.5 must be null or an int"),
    ({"fs": 16000.0}, r"frontend.conf.fs=16000.0 must be an int or a string"),
    ({"win_length": 600}, r"win_length=600 must be in \(0, n_fft=512\]"),
    ({"hop_length": 0}, r"must be positive"),
    ({"window": "hanning"}, r"window='hanning': ESPnet2's Stft knows torch's windows"),
    ({"frontend_conf": [1]}, r"frontend_conf must be a mapping or null"),
])
def test_values_espnet2_rejects_are_config_errors(conf, message):
    with pytest.raises(ConfigError, match=message):
        FrontendConfig(type="espnet2", conf=conf)


def test_fs_strings_read_as_espnet2_reads_them():
    import humanfriendly

    for fs in ("16k", "16K", "8k", "16000", 16000, "22.05k", "44.1k", "24k"):
        expected = humanfriendly.parse_size(fs) if isinstance(fs, str) else fs
        assert read_default_conf({"fs": fs})[0].fs == expected
        assert FrontendConfig(type="espnet2", conf={"fs": fs}).sampling_rate == expected


def test_an_espnet_release_not_checked_here_is_compared_on_a_probe(monkeypatch):
    import espnet3_flows.frontends.espnet2_frontend as espnet2_frontend

    monkeypatch.setattr(espnet2_frontend, "espnet_version", lambda: "209912")
    cfg = FrontendConfig(type="espnet2")
    assert frontend_modules(cfg) == ("torch", "espnet3_flows.frontends.espnet2_default",
                                     "espnet2.asr.frontend.default", "librosa.filters")
    assert isinstance(build_fast_default({}), FastDefaultFrontend)  # it agrees: the fast path runs
    monkeypatch.setattr(espnet2_default, "LOG_FLOOR", 1e-5)  # as if that release floored the mel energies higher
    with pytest.warns(RuntimeWarning, match="ESPnet 209912's DefaultFrontend computes other features"):
        assert build_fast_default({}) is None
    with pytest.warns(RuntimeWarning):
        assert isinstance(build_frontend(cfg), TorchFrontend)
