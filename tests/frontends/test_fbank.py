"""FastFbank against lhotse's own Fbank.extract: same features, clear errors, the fallback path."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from lhotse import Fbank, FbankConfig

from espnet3_flows.frontends.fbank import FastFbank, FbankTooShortError, mel_bands

# measured 9.5e-7: float32 rounding of re²+im² (lhotse: |X|² through hypot) and of the banded mel sums
ATOL = 1e-5

CONFIGS = [
    {},
    {"num_mel_bins": 40, "sampling_rate": 8000},
    {"frame_shift": 0.02, "frame_length": 0.05},
    {"snip_edges": True},
    {"remove_dc_offset": False},
    {"preemph_coeff": 0.0},
    {"round_to_power_of_two": False},
    {"window_type": "hamming"},
    {"torchaudio_compatible_mel_scale": False, "norm_filters": True},
    {"low_freq": 100.0, "high_freq": 3000.0},
]


def _lengths(fbank: FastFbank) -> list[int]:
    return [fbank.min_samples, fbank.min_samples + 1, 399, 400, 401, 12345, 3 * fbank.sampling_rate + 7]


@pytest.mark.patch
@pytest.mark.filterwarnings("ignore:.*snip_edges")
def test_the_fast_path_reads_lhotses_layout_for_every_config():
    assert all(FastFbank(Fbank(FbankConfig(dither=0.0, **config))).fast for config in CONFIGS)


@pytest.mark.filterwarnings("ignore:.*snip_edges")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_same_features_as_lhotse(config):
    """The features of the fast path (and, with ``fbank_layout`` off, of lhotse's own path)."""
    extractor = Fbank(FbankConfig(dither=0.0, **config))
    fbank = FastFbank(extractor)
    rng = np.random.default_rng(len(config))
    for n in _lengths(fbank):
        if n < fbank.min_samples:
            continue
        wave = (0.1 * rng.standard_normal(n)).astype(np.float32)
        ref = extractor.extract(wave, fbank.sampling_rate)
        ours = fbank(wave)
        assert ours.shape == ref.shape and ours.dtype == np.float32 and ours.flags.c_contiguous
        np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)


def test_speech_like_levels_and_silence():
    extractor = Fbank(FbankConfig(dither=0.0))
    fbank = FastFbank(extractor)
    t = np.arange(16000) / 16000
    for wave in (0.5 * np.sin(2 * np.pi * 440 * t), np.zeros(16000), 1e-4 * np.sign(np.sin(2 * np.pi * 50 * t))):
        wave = wave.astype(np.float32)
        np.testing.assert_allclose(fbank(wave), extractor.extract(wave, 16000), rtol=0, atol=ATOL)


@pytest.mark.parametrize("config", [{"use_energy": True}, {"use_fft_mag": True}])
def test_configs_outside_the_fast_path_run_lhotse_itself(config):
    extractor = Fbank(FbankConfig(dither=0.0, **config))
    fbank = FastFbank(extractor)
    assert not fbank.fast
    wave = np.random.default_rng(1).standard_normal(8000).astype(np.float32)
    np.testing.assert_array_equal(fbank(wave), extractor.extract(wave, 16000))


def test_dither_draws_the_same_noise_as_lhotse():
    extractor = Fbank(FbankConfig(dither=1.0))
    fbank = FastFbank(extractor)
    wave = (0.01 * np.random.default_rng(2).standard_normal(16000)).astype(np.float32)
    torch.manual_seed(7)
    ref = extractor.extract(wave, 16000)
    torch.manual_seed(7)
    ours = fbank(wave)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
    assert np.abs(ours - fbank(wave)).max() > 1e-3  # the noise is really there


@pytest.mark.filterwarnings("ignore:.*snip_edges")
@pytest.mark.parametrize("snip_edges", [False, True])
def test_min_samples_is_where_lhotse_stops_working(snip_edges):
    extractor = Fbank(FbankConfig(dither=0.0, snip_edges=snip_edges))
    fbank = FastFbank(extractor)
    shortest = np.ones(fbank.min_samples, dtype=np.float32)
    assert fbank(shortest).shape == extractor.extract(shortest, 16000).shape
    with pytest.raises(RuntimeError):  # lhotse reads past the end (or snips everything away)
        extractor.extract(shortest[:-1], 16000)
    with pytest.raises(FbankTooShortError, match=f"{fbank.min_samples - 1} samples is shorter"):
        fbank(shortest[:-1])
    assert issubclass(FbankTooShortError, ValueError)  # a bad item, subject to on_error


@pytest.mark.filterwarnings("ignore:.*snip_edges")
def test_the_input_is_never_modified_and_may_be_read_only():
    # snip_edges with shift == length makes the frames a plain view of the samples
    config = FbankConfig(dither=0.0, snip_edges=True, frame_shift=0.025, remove_dc_offset=False)
    extractor, fbank = Fbank(config), FastFbank(Fbank(config))
    wave = np.random.default_rng(3).standard_normal(16000).astype(np.float32)
    kept = wave.copy()
    np.testing.assert_allclose(fbank(wave), extractor.extract(kept, 16000), rtol=0, atol=ATOL)
    np.testing.assert_array_equal(wave, kept)
    wave.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(fbank(wave), extractor.extract(kept, 16000), rtol=0, atol=ATOL)


def test_rejects_multichannel_input():
    fbank = FastFbank(Fbank(FbankConfig()))
    with pytest.raises(ValueError, match="mono"):
        fbank(np.zeros((2, 16000), dtype=np.float32))


def test_mel_bands_cover_every_nonzero_weight():
    fb = Fbank(FbankConfig()).extractor._fb.detach()
    rebuilt = torch.zeros_like(fb)
    for first, last, low, high, weights in mel_bands(fb):
        rebuilt[low:high, first:last] = weights.T
    assert torch.equal(rebuilt, fb)
    work = sum(w.numel() for *_, w in mel_bands(fb))
    assert work < fb.numel() / 4


class _Renamed:
    """An lhotse extractor module whose private attributes moved (a future lhotse release)."""

    def __init__(self, module):
        self.__dict__["_module"] = module

    def __getattr__(self, name):
        if name == "wav2win":
            raise AttributeError("'Wav2LogFilterBank' object has no attribute 'wav2win'")
        return getattr(self.__dict__["_module"], name)

    def __call__(self, *args, **kwargs):
        return self.__dict__["_module"](*args, **kwargs)


@pytest.fixture
def layout_switched_on(monkeypatch):
    """The fallbacks below are those of a layout read that is allowed (whatever the suite's switch)."""
    monkeypatch.delenv("ESPNET3_FLOWS_PATCHES", raising=False)


@pytest.mark.usefixtures("layout_switched_on")
def test_a_changed_private_layout_falls_back_to_lhotse_with_a_warning():
    extractor = Fbank(FbankConfig(dither=0.0))
    extractor.extractor = _Renamed(extractor.extractor)
    with pytest.warns(RuntimeWarning, match="private layout"):
        fbank = FastFbank(extractor)
    assert not fbank.fast
    wave = np.random.default_rng(3).standard_normal(8000).astype(np.float32)
    np.testing.assert_array_equal(fbank(wave), extractor.extract(wave, 16000))
    # from the public config, the same bound the private layout gives
    assert fbank.min_samples == FastFbank(Fbank(FbankConfig(dither=0.0))).min_samples


@pytest.mark.usefixtures("layout_switched_on")
def test_a_fast_path_that_disagrees_with_lhotse_is_not_used(monkeypatch):
    monkeypatch.setattr(FastFbank, "_features", lambda self, wave: torch.zeros(3, 80))
    extractor = Fbank(FbankConfig(dither=0.0))
    with pytest.warns(RuntimeWarning, match="differ from lhotse"):
        fbank = FastFbank(extractor)
    assert not fbank.fast
    wave = np.random.default_rng(4).standard_normal(8000).astype(np.float32)
    np.testing.assert_array_equal(fbank(wave), extractor.extract(wave, 16000))


def test_with_the_layout_switched_off_lhotse_computes_the_features_without_a_warning(monkeypatch, recwarn):
    monkeypatch.setenv("ESPNET3_FLOWS_PATCHES", "-fbank_layout")
    extractor = Fbank(FbankConfig(dither=0.0))
    fbank = FastFbank(extractor)
    assert not fbank.fast and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    wave = np.random.default_rng(5).standard_normal(8000).astype(np.float32)
    np.testing.assert_array_equal(fbank(wave), extractor.extract(wave, 16000))


@pytest.mark.usefixtures("layout_switched_on")
def test_an_lhotse_whose_layout_was_not_checked_is_not_read(monkeypatch):
    import lhotse

    monkeypatch.setattr(lhotse, "__version__", "1.40.0")
    with pytest.warns(RuntimeWarning, match="lhotse 1.40.0 is not one whose fbank layout was checked"):
        fbank = FastFbank(Fbank(FbankConfig(dither=0.0)))
    assert not fbank.fast
