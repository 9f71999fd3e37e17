"""``frontend.bucket_shapes``: padded batches in a few fixed shapes, features as without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espnet3_flows.config import ConfigError
from espnet3_flows.frontends.bucket_shapes import (LADDER_ALIGN, LADDER_BASE, LADDER_STEP, ROW_STEPS,
                                                   bucket_capacity, bucket_length, bucket_shape)
from espnet3_flows.frontends.config import FrontendConfig
from espnet3_flows.frontends.wave_frontends import TorchFrontend

MODEL = {"_target_": "espnet3_flows.frontends.ssl.SSLFeatures", "arch": "hubert_base"}


def test_the_ladder_holds_every_length_with_little_padding_in_few_steps():
    lengths = range(1, 30 * 16000, 7)
    ladder = sorted({bucket_length(n) for n in lengths})
    assert all(bucket_length(n) >= n for n in lengths)
    assert all(bucket_length(n) <= LADDER_STEP * n + LADDER_ALIGN for n in lengths if n > LADDER_BASE)
    assert ladder[0] == LADDER_BASE and all(length % LADDER_ALIGN == 0 for length in ladder)
    assert len(ladder) <= 120  # 0.1 s to 30 s (measured: 114)


@pytest.mark.parametrize(("rows", "max_batch_samples"), [(1, 400_000), (3, 400_000), (5, 400_000), (8, 400_000),
                                                        (9, 400_000), (17, 400_000), (30, 400_000), (3, 30_000),
                                                        (9, 16_000_000), (97, 16_000_000), (600, 16_000_000)])
def test_a_batch_is_padded_to_a_few_row_counts_of_its_length(rows, max_batch_samples):
    rows_of, length = bucket_shape([12_345] * rows, max_batch_samples)
    capacity = bucket_capacity(length, max_batch_samples)
    assert length == bucket_length(12_345) and capacity == max(1, max_batch_samples // length)
    assert rows <= rows_of <= max(rows, capacity)
    if rows <= 8:  # 1, 2, 4 or 8 (or the capacity, if less)
        assert rows_of == min(max(capacity, rows), 1 << (rows - 1).bit_length())
    else:  # a multiple of a sixteenth of the capacity (at least 8 rows), or the capacity
        step = max(8, capacity // ROW_STEPS)
        assert rows_of - rows < step and (rows_of % step == 0 or rows_of == capacity)


def echo(speech, lengths, kwargs):
    """Frames of 160 samples as (sum, first sample) features, recording each batch's shape."""
    kwargs["shapes"].append(tuple(speech.shape))
    rows, t = speech.shape
    frames = speech[:, : t // 160 * 160].reshape(rows, t // 160, 160)
    return torch.stack([frames.sum(-1), frames[..., 0]], dim=-1), lengths // 160


def test_batches_take_few_shapes_and_give_the_features_of_batches_as_they_are():
    rng = np.random.default_rng(3)
    plain = TorchFrontend(echo, object(), "cpu", max_batch_samples=400_000)
    fixed = TorchFrontend(echo, object(), "cpu", max_batch_samples=400_000, bucket_shapes=True)
    shapes: list[tuple[int, int]] = []
    for _ in range(20):
        waves = [rng.standard_normal(n).astype(np.float32) for n in rng.integers(16_000, 160_000, size=64)]
        ref = plain(waves, {"shapes": []})
        seen: list[tuple[int, int]] = []
        got = fixed(waves, {"shapes": seen})
        for a, b in zip(ref, got, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-5)
        groups = fixed.batches([len(w) for w in waves])
        assert seen == [fixed.shape([len(waves[i]) for i in g]) for g in groups]
        assert all(rows * length <= 400_000 for rows, length in seen)
        shapes += seen
    assert len(set(shapes)) < len(shapes) / 4  # (measured: 80 shapes for 438 batches; as they are, one each)


def test_the_padding_fraction_counts_the_fixed_shapes():
    waves = [np.ones(n, dtype=np.float32) for n in (16_000, 16_100, 30_000)]
    fixed = TorchFrontend(echo, object(), "cpu", max_batch_samples=100_000, bucket_shapes=True)
    moments = fixed.moments(waves, {"shapes": []})
    expected = sum(rows * length for rows, length in (fixed.shape([len(waves[i]) for i in g])
                                                       for g in fixed.batches([len(w) for w in waves])))
    assert moments.computed_samples == expected > sum(len(w) for w in waves)


def test_the_key_is_for_padded_batches_and_changes_the_hash():
    padded = FrontendConfig(type="model", model=MODEL, max_batch_samples=4_000_000)
    fixed = FrontendConfig(type="model", model=MODEL, max_batch_samples=4_000_000, bucket_shapes=True)
    assert padded.hashed() != fixed.hashed()
    with pytest.raises(ConfigError, match="bucket_shapes is for padded batches"):
        FrontendConfig(bucket_shapes=True)  # fbank
    with pytest.raises(ConfigError, match="bucket_shapes is for padded batches"):
        FrontendConfig(type="model", model=MODEL, bucket_shapes=True)  # one utterance at a time


def test_an_utterance_that_fits_the_cap_alone_is_never_padded_past_it():
    assert bucket_shape([99_990], max_batch_samples=100_000) == (1, 100_000)  # (its ladder length: 101,280)
    assert bucket_shape([150_000], max_batch_samples=100_000) == (1, 150_000)  # alone, as without the key


def test_a_frontend_without_feature_lengths_is_refused_rather_than_padded():
    def no_lengths(speech, lengths, kwargs):
        return speech[:, :, None], None

    fixed = TorchFrontend(no_lengths, object(), "cpu", max_batch_samples=100_000, bucket_shapes=True)
    with pytest.raises(ValueError, match="needs a frontend that gives its features' lengths"):
        fixed([np.ones(16_000, dtype=np.float32)], {})
