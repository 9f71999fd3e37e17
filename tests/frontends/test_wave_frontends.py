"""``frontends.wave_frontends.TorchFrontend``'s padded batches."""

from __future__ import annotations

import numpy as np

from espnet3_flows.frontends.wave_frontends import MAX_PADDING, TorchFrontend


def test_padded_batches_hold_at_most_five_percent_of_padding_and_max_batch_samples():
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 50_000, size=500)]
    frontend = TorchFrontend(lambda s, n, kw: (s, n), object(), "cpu", max_batch_samples=400_000)
    groups = frontend.batches(lengths)
    assert sorted(i for g in groups for i in g) == list(range(500))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 400_000 and sum(lengths[i] for i in g) >= (1 - MAX_PADDING) * padded
    assert len(groups) < 100  # (and still batches: 500 utterances in fewer than 100 calls)
