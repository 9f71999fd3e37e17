"""StatsAccumulator: exactness against a float64 two-pass reference, shard-merge invariance, JSON round trip."""

from __future__ import annotations

import json
import math
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from espnet3_flows.stats.accumulator import StatsAccumulator
from espnet3_flows.stats.outputs import espnet_mvn

N_FRAMES = 100_000_000
CHUNK = 2_000_000
UTT_FRAMES = 500  # ESPnet2 adds one float32 sum per utterance (here: 5 s of 10 ms frames)


def _chunk(seed: int, k: int) -> np.ndarray:
    """Chunk ``k`` of the feature stream: one dimension, mean 10, sd 0.05, float32 like real features."""
    rng = np.random.default_rng([seed, k])
    return (10.0 + 0.05 * rng.standard_normal(CHUNK)).astype(np.float32).reshape(-1, 1)


def _float32_running_sum(start: np.float32, values: np.ndarray) -> np.float32:
    """``start + v0 + v1 + ...`` added one by one in float32 (what ``sum_dict[k] += v.sum(0)`` does)."""
    return np.cumsum(np.concatenate([[start], values]).astype(np.float32), dtype=np.float32)[-1]


def test_espnet_float32_weakness_case_is_exact():
    seed = 1234
    acc = StatsAccumulator()
    chunk_sums: list[float] = []
    naive_sum = np.float32(0.0)
    naive_sq = np.float32(0.0)
    for k in range(N_FRAMES // CHUNK):
        x = _chunk(seed, k)
        acc.update(x)
        chunk_sums.append(float(x.sum(dtype=np.float64)))
        per_utt = x.reshape(-1, UTT_FRAMES)
        naive_sum = _float32_running_sum(naive_sum, per_utt.sum(axis=1, dtype=np.float32))
        naive_sq = _float32_running_sum(naive_sq, np.square(per_utt).sum(axis=1, dtype=np.float32))
    ref_mean = math.fsum(chunk_sums) / N_FRAMES
    ssd = math.fsum(float(np.square(_chunk(seed, k).astype(np.float64) - ref_mean).sum())
                    for k in range(N_FRAMES // CHUNK))
    ref_std = math.sqrt(ssd / N_FRAMES)
    assert abs(ref_std - 0.05) < 1e-3 and abs(ref_mean - 10.0) < 1e-3  # the data are what we meant

    stats = acc.to_espnet()
    assert int(stats["count"]) == N_FRAMES
    assert stats["sum"].dtype == np.float64 and stats["sum_square"].dtype == np.float64
    mean, std = espnet_mvn(stats)
    assert abs(mean[0] - ref_mean) / ref_mean <= 1e-9
    assert abs(std[0] - ref_std) / ref_std <= 1e-9

    # ESPnet2's float32 sum / sum_square lose the spread entirely at this scale
    naive = {"count": np.array(N_FRAMES), "sum": np.array([naive_sum], dtype=np.float32),
             "sum_square": np.array([naive_sq], dtype=np.float32)}
    n_mean = naive["sum"] / np.float32(N_FRAMES)
    n_var = naive["sum_square"] / np.float32(N_FRAMES) - n_mean * n_mean
    n_std = float(np.sqrt(np.maximum(n_var, np.float32(1e-20)))[0])
    assert abs(n_std - ref_std) / ref_std > 0.10


def _reference(data: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    x = data.astype(np.float64)
    mean = np.array([math.fsum(col) / len(col) for col in x.T])
    var = np.array([math.fsum((col - m) ** 2) / len(col) for col, m in zip(x.T, mean, strict=True)])
    return len(x), mean, var


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(20, 400),
    dim=st.integers(1, 4),
    scale=st.sampled_from([1e-3, 0.05, 1.0, 1e3]),
    # |mean| / sd up to 300 (log-mel features: |mean| <= ~30, sd >= ~0.1); float64 itself
    # bounds any variance algorithm's relative error by about eps * (|mean| / sd)
    ratio=st.floats(1.0, 300.0),
    sign=st.sampled_from([-1.0, 1.0]),
    cuts=st.lists(st.floats(0.0, 1.0), max_size=12),
    order_seed=st.integers(0, 2**32 - 1),
)
def test_any_shard_partition_and_merge_order_gives_the_same_stats(seed, n, dim, scale, ratio, sign, cuts,
                                                                  order_seed):
    offset = sign * ratio * scale
    rng = np.random.default_rng(seed)
    data = offset + scale * rng.standard_normal((n, dim))
    points = sorted({int(c * n) for c in cuts} | {0, n})
    shards = []
    for a, b in pairwise(points):
        acc = StatsAccumulator()
        # each shard itself folds several utterance blocks
        inner = sorted({a, b, *rng.integers(a, b + 1, size=2).tolist()})
        for c, d in pairwise(inner):
            acc.update(data[c:d])
        shards.append(acc)
    order = np.random.default_rng(order_seed).permutation(len(shards))
    merged = StatsAccumulator()
    for i in order:
        merged.merge(StatsAccumulator.from_dict(json.loads(json.dumps(shards[i].to_dict()))))

    count, mean, var = _reference(data)
    assert merged.count == count
    assert _rel(merged.mean, mean) <= 1e-12
    assert _rel(merged.variance(), var) <= 1e-12

    single = StatsAccumulator()
    single.update(data)
    assert single.count == merged.count
    assert _rel(merged.mean, single.mean) <= 1e-12
    assert _rel(merged.variance(), single.variance()) <= 1e-12


def test_json_round_trip_is_bit_exact():
    rng = np.random.default_rng(7)
    acc = StatsAccumulator()
    for _ in range(5):
        acc.update(10.0 + 0.05 * rng.standard_normal((rng.integers(1, 300), 80)).astype(np.float32))
    text = json.dumps(acc.to_dict())
    back = StatsAccumulator.from_dict(json.loads(text))
    assert back.count == acc.count
    assert back.mean.dtype == np.float64 and back.m2.dtype == np.float64
    assert back.mean.tobytes() == acc.mean.tobytes()
    assert back.m2.tobytes() == acc.m2.tobytes()
    for key, value in acc.to_espnet().items():
        assert np.array_equal(back.to_espnet()[key], value)
    assert json.dumps(back.to_dict()) == text


def test_empty_accumulator_round_trips_and_refuses_views():
    empty = StatsAccumulator.from_dict(json.loads(json.dumps(StatsAccumulator().to_dict())))
    assert empty.count == 0 and empty.mean is None and empty.dim is None
    with pytest.raises(ValueError, match="no frames"):
        empty.to_espnet()
    # merging an empty accumulator is a no-op either way round
    acc = StatsAccumulator()
    acc.update(np.arange(6.0).reshape(3, 2))
    before = acc.to_dict()
    assert acc.merge(StatsAccumulator()).to_dict() == before
    assert StatsAccumulator().merge(acc).to_dict() == before


def test_shape_errors_are_clear():
    acc = StatsAccumulator()
    acc.update(np.zeros((0, 3)))  # an empty block is ignored
    assert acc.count == 0
    acc.update(np.ones((2, 3)))
    with pytest.raises(ValueError, match="dimension 4 differs"):
        acc.update(np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"\(frames, dim\)"):
        acc.update(np.ones(5))
    other = StatsAccumulator()
    other.update(np.ones((2, 5)))
    with pytest.raises(ValueError, match="cannot merge dimension 5"):
        acc.merge(other)
