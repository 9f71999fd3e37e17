"""Moments computed where the features are (:mod:`espnet3_flows.frontends.device_moments`): on the
CPU here, by the code a GPU runs, against the host's float64 accumulator over the same frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espnet3_flows.frontends.device_moments import Moments, nonfinite_rows
from espnet3_flows.frontends.wave_frontends import TorchFrontend
from espnet3_flows.stats.accumulator import StatsAccumulator

#: what the issue asks of device statistics against the host's float64 run
REL = 1e-6


def _host(frames: list[np.ndarray]) -> StatsAccumulator:
    acc = StatsAccumulator()
    for f in frames:
        acc.update(f)
    return acc


def _same(moments: Moments, acc: StatsAccumulator, rel: float = REL) -> None:
    count, mean, m2 = moments.to_host()
    assert count == acc.count
    np.testing.assert_allclose(mean, acc.mean, rtol=rel, atol=rel * float(np.abs(acc.mean).max()))
    np.testing.assert_allclose(m2, acc.m2, rtol=rel)


def _padded(rng: np.random.Generator, lengths: list[int], dim: int, mean: float = 300.0,
            spread: float = 0.01) -> tuple[torch.Tensor, list[np.ndarray]]:
    """float32 features with a large mean and a small spread (where float32 sums lose every digit),
    padded with garbage, NaN included: nothing of the padding may count."""
    rows = [(mean + spread * rng.standard_normal((n, dim))).astype(np.float32) for n in lengths]
    feats = torch.full((len(lengths), max(lengths) + 3, dim), float("nan"))
    for i, r in enumerate(rows):
        feats[i, : len(r)] = torch.from_numpy(r)
    return feats, rows


def test_padded_moments_are_the_host_accumulators_over_the_valid_frames():
    rng = np.random.default_rng(0)
    lengths = [5, 17, 1, 40]
    feats, rows = _padded(rng, lengths, 6)
    got = Moments.of_padded(feats, torch.tensor(lengths), sum(lengths))
    _same(got, _host(rows))
    assert not nonfinite_rows(feats, torch.tensor(lengths)).any()


def test_merged_batches_equal_one_batch_and_the_host_in_any_order():
    rng = np.random.default_rng(1)
    batches = [_padded(rng, lengths, 3) for lengths in ([3, 9], [30], [2, 2, 2], [11, 4])]
    parts = [Moments.of_padded(f, torch.tensor([len(r) for r in rows]), sum(len(r) for r in rows))
             for f, rows in batches]
    forward, backward = Moments(), Moments()
    for p in parts:
        forward = forward.merge(p)
    for p in reversed(parts):
        backward = backward.merge(p)
    host = _host([r for _, rows in batches for r in rows])
    _same(forward, host)
    _same(backward, host)
    _same(Moments.of_rows(torch.from_numpy(np.concatenate([r for _, rows in batches for r in rows]))), host)
    assert Moments().merge(Moments()).to_host() == (0, None, None)


def test_a_nan_in_a_valid_frame_is_found_in_its_row_only():
    feats, _ = _padded(np.random.default_rng(2), [4, 6, 5], 2)
    feats[1, 3, 1] = float("inf")
    feats[2, 4, 0] = float("nan")
    assert nonfinite_rows(feats, torch.tensor([4, 6, 4])).tolist() == [False, True, False]  # row 2's NaN is padding


def test_moments_of_other_dimensions_do_not_merge():
    a = Moments.of_rows(torch.ones(3, 2))
    with pytest.raises(ValueError, match="3-dim features into 2-dim"):
        a.merge(Moments.of_rows(torch.ones(3, 3)))


class _Frames(torch.nn.Module):
    """Frames of ``hop`` samples, their first ``dim`` samples plus a large offset; the last row of a
    batch gets NaN where ``poison`` says."""

    def __init__(self, hop: int = 40, dim: int = 5, poison: bool = False):
        super().__init__()
        self.hop, self.dim, self.poison = hop, dim, poison

    def forward(self, speech: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = speech.shape[1] // self.hop
        feats = 1000.0 + speech[:, : frames * self.hop].reshape(speech.shape[0], frames, self.hop)[:, :, : self.dim]
        if self.poison:
            feats[-1, 0, 0] = float("nan")
        return feats, lengths // self.hop


@pytest.mark.parametrize("max_batch_samples", [0, 2000, 10 ** 6])
def test_a_torch_frontends_moments_equal_its_features_accumulated_on_the_host(max_batch_samples):
    rng = np.random.default_rng(3)
    waves = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (400, 1234, 81, 999, 40, 3000)]
    module = _Frames()
    frontend = TorchFrontend(lambda s, n, kw: module(s, n), module, "cpu", max_batch_samples)
    features = frontend(waves, {})
    got = frontend.moments(waves, {})
    assert got.frames == [f.shape[0] for f in features] and got.dim == 5 and not any(got.nonfinite)
    _same(got.moments, _host(features))


def test_a_torch_frontends_nan_is_flagged_and_its_batch_not_counted():
    waves = [np.zeros(780, np.float32), np.ones(800, np.float32)]  # (one batch: 2.5 % padding)
    module = _Frames(poison=True)
    frontend = TorchFrontend(lambda s, n, kw: module(s, n), module, "cpu", 10 ** 6)
    got = frontend.moments(waves, {})
    assert got.nonfinite == [False, True] and got.moments.count == 0


def test_fbank_moments_of_gathered_frames_equal_each_utterance_alone():
    """fbank's GPU path (frames of every waveform gathered into one matrix), run on the CPU."""
    from lhotse import Fbank, FbankConfig

    from espnet3_flows.frontends.fbank import FastFbank

    rng = np.random.default_rng(4)
    fbank = FastFbank(Fbank(FbankConfig(dither=0.0)))
    waves = [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in (4000, 16000, 401, 9999)]
    alone = [fbank(w) for w in waves]
    got = fbank.moments(waves, "cpu", max_batch_samples=20000)  # two batches
    assert got.frames == [a.shape[0] for a in alone] and got.dim == 80 and not any(got.nonfinite)
    # the two compute the float32 features in other orders (banded and dense mel products): they
    # agree to float32 rounding, not bit for bit; the accumulation itself is exact (the test above)
    _same(got.moments, _host(alone), rel=1e-5)


def test_dithered_fbank_moments_take_each_utterance_alone():
    from lhotse import Fbank, FbankConfig

    from espnet3_flows.frontends.fbank import FastFbank

    fbank = FastFbank(Fbank(FbankConfig(dither=1.0)))
    waves = [np.full(n, 0.01, np.float32) for n in (4000, 801)]
    got = fbank.moments(waves, "cpu")
    assert got.frames == [fbank(w).shape[0] for w in waves] and got.dim == 80
    assert got.moments.count == sum(got.frames) and not any(got.nonfinite)


def test_a_torch_frontend_counts_the_samples_it_computed_padding_included():
    module = _Frames()
    frontend = TorchFrontend(lambda s, n, kw: module(s, n), module, "cpu", max_batch_samples=700)
    waves = [np.zeros(n, np.float32) for n in (1000, 290, 300)]
    assert frontend.batches([len(w) for w in waves]) == [[1, 2], [0]]  # 2 x 300 fit in 700, 3 x 1000 do not
    got = frontend.moments(waves, {})
    assert (got.samples, got.computed_samples) == (1590, 2 * 300 + 1000)


def test_gathered_fbank_frames_compute_no_padding():
    from lhotse import Fbank, FbankConfig

    from espnet3_flows.frontends.fbank import FastFbank

    got = FastFbank(Fbank(FbankConfig(dither=0.0))).moments([np.zeros(n, np.float32) for n in (4000, 801)], "cpu")
    assert got.samples == got.computed_samples == 4801
