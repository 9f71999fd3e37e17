"""``frontends.wave_frontends.TorchFrontend``'s padded batches."""

from __future__ import annotations

import numpy as np

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
