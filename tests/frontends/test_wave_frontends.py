"""``frontends.wave_frontends.TorchFrontend``'s padded batches and the features it hands back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espnet3_flows.errors import BadItemError
from espnet3_flows.frontends.checked import CheckedFeatures
from espnet3_flows.frontends.frontend import extract_features
from espnet3_flows.frontends.wave_frontends import FULL_ENOUGH, MAX_PADDING, TorchFrontend


def padding(groups, lengths) -> float:
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1 - sum(lengths) / computed


def test_a_many_utterance_call_is_padded_by_at_most_five_percent_and_a_few_utterance_call_still_batches():
    frontend = TorchFrontend(lambda s, n, kw: (s, n), object(), "cpu", max_batch_samples=400_000)
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 50_000, size=500)]
    groups = frontend.batches(lengths)
    assert sorted(i for g in groups for i in g) == list(range(500))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 400_000
        full = sum(lengths[i] for i in g[:-1]) >= FULL_ENOUGH * 400_000  # before its last utterance
        assert not full or sum(lengths[i] for i in g) >= (1 - MAX_PADDING) * padded
    assert padding(groups, lengths) <= MAX_PADDING and len(groups) <= 40  # (measured: 2.6 %, 40)
    # 16 utterances of scattered lengths: batches as before the bound, not one or two at a time
    few = lengths[:16]
    assert len(frontend.batches(few)) <= 4  # (16 x 50k does not fit in 400k: two at least)


def framed(speech, lengths, kwargs):
    """Frames of 4 samples as 2-dim features (their sum and first sample), NaN in every padded
    frame, and NaN in the valid frames of a waveform whose first sample is 7."""
    rows, t = speech.shape
    frames = speech[:, : t // 4 * 4].view(rows, t // 4, 4)
    feats = torch.stack([frames.sum(-1), frames[..., 0]], dim=-1)
    flens = lengths // 4
    feats[torch.arange(t // 4)[None, :] >= flens[:, None]] = float("nan")
    feats[speech[:, 0] == 7.0] = float("nan")
    return feats, flens


def test_features_come_back_per_waveform_with_nan_found_in_valid_frames_only():
    frontend = TorchFrontend(framed, object(), "cpu", max_batch_samples=100)
    rng = np.random.default_rng(1)
    waves = [rng.standard_normal(n).astype(np.float32) for n in (8, 40, 12, 36, 20)]
    waves[3][0] = 7.0
    got = frontend(waves, {})
    assert isinstance(got, CheckedFeatures) and got.nonfinite == [False, False, False, True, False]
    assert len(frontend.batches([len(w) for w in waves])) > 1  # batches whose padding holds NaN
    for i, (f, w) in enumerate(zip(got, waves, strict=True)):
        assert f.dtype == np.float32 and f.shape == (len(w) // 4, 2)
        if i != 3:
            np.testing.assert_allclose(f[:, 0], w.reshape(-1, 4).sum(1), rtol=1e-6)


def test_extract_features_takes_the_frontends_own_nan_check(tmp_path, monkeypatch):
    import soundfile as sf

    from espnet3_flows.inputs.audio_config import AudioConfig
    from espnet3_flows.inputs.recording_cache import RecordingCache
    from espnet3_flows.inputs.records import Utterance

    utts = []
    for i, first in enumerate((0.25, 0.5)):
        wave = np.full(1600, first, np.float32)
        sf.write(tmp_path / f"{i}.wav", wave, 16000, subtype="FLOAT")
        utts.append(Utterance(f"u{i}", str(tmp_path / f"{i}.wav")))

    def frontend(waves, kwargs):  # finite arrays, the second flagged where they were computed
        return CheckedFeatures([np.ones((3, 2), np.float32) for _ in waves], [False, True])

    with pytest.raises(BadItemError, match="utt 'u1': features contain NaN or Inf"):
        extract_features(utts, frontend, AudioConfig(), None, RecordingCache(cwd=str(tmp_path)))
    ok = extract_features(utts[:1], lambda waves, kw: [np.ones((3, 2), np.float32)], AudioConfig(), None,
                          RecordingCache(cwd=str(tmp_path)))
    assert ok[0]["utt_id"] == "u0" and ok[0]["feats"].shape == (3, 2)


def test_features_beyond_float32_are_flagged_as_the_float32_arrays_handed_back_hold_inf():
    def wide(speech, lengths, kwargs):
        feats = speech[:, :, None].double()
        feats[0, 0, 0] = 1e300  # finite in float64, Inf once cast to the float32 handed back
        return feats, lengths

    got = TorchFrontend(wide, object(), "cpu", max_batch_samples=100)([np.ones(5, np.float32)], {})
    assert got.nonfinite == [True] and np.isinf(got[0][0, 0])
