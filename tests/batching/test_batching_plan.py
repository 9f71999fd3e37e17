"""Batch plans: every strategy respects its budget, covers each id once, and keeps length order."""

from __future__ import annotations

import warnings
from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from espnet3_flows.batching import (
    BatchBudgetError,
    BatchConfig,
    BatchConfigError,
    BatchPlan,
    LengthTable,
    OversizedBatchWarning,
    batch_cost,
    build_batch_plan,
    read_batch_file,
    summarize_plan,
)


def flat(plan: BatchPlan) -> list[int]:
    return [row for batch in plan.batches for row in batch]


def assert_each_row_once(plan: BatchPlan, count: int) -> None:
    assert sorted(flat(plan)) == list(range(count))


@pytest.mark.parametrize("descending", [True, False])
def test_sorted_fixed_batch_size(make_table, descending):
    lengths = [5, 3, 9, 1, 7, 2, 8]
    table = make_table(lengths)
    plan = build_batch_plan(
        table, BatchConfig(batch_type="sorted", batch_size=3, is_descending=descending)
    )
    assert [len(b) for b in plan.batches] == [3, 3, 1]
    order = [lengths[r] for r in flat(plan)]
    assert order == sorted(lengths, reverse=descending)
    assert_each_row_once(plan, len(lengths))


def test_unsorted_keeps_file_order(make_table):
    table = make_table([5, 3, 9, 1, 7])
    config = BatchConfig(batch_type="sorted", batch_size=2, is_descending=None)
    plan = build_batch_plan(table, config)
    assert plan.batches == [[0, 1], [2, 3], [4]]


def test_equal_lengths_keep_file_order(make_table):
    table = make_table([4, 4, 4, 4])
    plan = build_batch_plan(table, BatchConfig(batch_type="sorted", batch_size=4))
    assert plan.batches == [[0, 1, 2, 3]]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=120),
    budget=st.integers(min_value=1, max_value=3000),
    descending=st.sampled_from([True, False, None]),
)
def test_numel_property(lengths, budget, descending):
    table = LengthTable(ids=[f"u{i}" for i in range(len(lengths))], lengths=[lengths],
                        dims=[1], column_names=["x"])
    config = BatchConfig(batch_type="numel", batch_bins=budget, is_descending=descending)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizedBatchWarning)
        plan = build_batch_plan(table, config)
    assert_each_row_once(plan, len(lengths))
    for index, batch in enumerate(plan.batches):
        padded = len(batch) * max(lengths[r] for r in batch)
        if index in plan.oversized:
            assert len(batch) == 1 and padded > budget
        else:
            assert padded <= budget
    if descending is not None:
        order = [lengths[r] for r in flat(plan)]
        assert order == sorted(lengths, reverse=descending)
        # greedy fill: the next row would not have fit in any closed batch
        for batch, following in pairwise(plan.batches):
            grown = batch + following[:1]
            assert len(grown) * max(lengths[r] for r in grown) > budget


def test_numel_counts_every_column_times_its_dim():
    table = LengthTable(ids=["a", "b", "c"], lengths=[[100, 90, 80], [10, 30, 5]],
                        dims=[80, 500], column_names=["feats", "text"])
    config = BatchConfig(batch_type="numel", batch_bins=2 * (100 * 80 + 30 * 500))
    assert batch_cost(table, config, [0, 1]) == 2 * (100 * 80 + 30 * 500)
    plan = build_batch_plan(table, config)
    assert plan.batches == [[0, 1], [2]]


def test_length_budgets_mean_what_lhotse_and_espnet2_read_them_as(make_table, lognormal_frames):
    from lhotse.dataset.sampling.base import TimeConstraint
    from lhotse.testing.dummies import dummy_cut

    frames = lognormal_frames(500)
    table = make_table(frames)
    # max_duration is lhotse's: the batch's padded duration, n * longest <= max_duration
    plan = build_batch_plan(table, BatchConfig(batch_type="length", max_duration=60.0))
    assert_each_row_once(plan, len(frames))
    order, seen = flat(plan), 0
    for i, batch in enumerate(plan.batches):
        constraint = TimeConstraint(max_duration=60.0)
        for row in batch:
            constraint.add(dummy_cut(row, duration=frames[row] * 0.01))
        assert not constraint.exceeded(), batch  # lhotse accepts every batch of ours
        seen += len(batch)
        if i + 1 < len(plan.batches):  # and ours are full: the next row would exceed it
            constraint.add(dummy_cut(-1, duration=frames[order[seen]] * 0.01))
            assert constraint.exceeded()
    assert build_batch_plan(table, BatchConfig(batch_type="length", max_frames=6000)).batches == plan.batches
    # padding=False sums real lengths: fuller batches, none over the budget
    real = build_batch_plan(table, BatchConfig(batch_type="length", max_frames=6000, padding=False))
    assert all(frames[b].sum() <= 6000 for b in real.batches) and len(real) < len(plan)


def test_length_batch_bins_counts_every_shape_column_as_espnet2():
    table = LengthTable(ids=["a", "b", "c", "d"], lengths=[[100, 90, 80, 10], [10, 30, 5, 2]],
                        dims=[80, 500], column_names=["feats", "text"])
    config = BatchConfig(batch_type="length", batch_bins=2 * (100 + 30))  # n * sum_c(max_len_c), dims ignored
    assert batch_cost(table, config, [0, 1]) == 2 * (100 + 30)
    assert build_batch_plan(table, config).batches == [[0, 1], [2, 3]]
    unpadded = BatchConfig(batch_type="length", batch_bins=250, padding=False)
    assert batch_cost(table, unpadded, [0, 1]) == 100 + 90 + 10 + 30


def test_sort_in_batch_and_sort_batch_order_as_espnet2(make_table):
    table = make_table([5, 3, 9, 1, 7, 2, 8, 4])
    base = build_batch_plan(table, BatchConfig(batch_type="sorted", batch_size=3))
    plan = build_batch_plan(table, BatchConfig(batch_type="sorted", batch_size=3, sort_in_batch="ascending",
                                               sort_batch="ascending"))
    lengths = [[table.primary[r] for r in b] for b in plan.batches]
    assert lengths == [[1, 2], [3, 4, 5], [7, 8, 9]]
    assert sorted(map(sorted, plan.batches)) == sorted(map(sorted, base.batches))  # same batches, reordered
    with pytest.raises(BatchConfigError, match="sort_batch"):
        BatchConfig(batch_bins=10, sort_batch="up")


def test_max_duration_needs_frame_shift(make_table):
    table = make_table([10, 20], frame_shift=None)
    with pytest.raises(BatchConfigError, match="frame_shift"):
        build_batch_plan(table, BatchConfig(batch_type="length", max_duration=1.0))


def test_dynamic_batches_waste_little_padding(make_table, lognormal_frames):
    frames = lognormal_frames(3000)
    table = make_table(frames)
    plan = build_batch_plan(table, BatchConfig(batch_bins=10_000))
    report = summarize_plan(plan, table)
    assert report.padding_fraction < 0.01
    # batches are filled: on average the padded budget is more than 95 % used
    assert report.padded_frames / (report.num_batches * 10_000) > 0.95
    shuffled = build_batch_plan(table, BatchConfig(batch_bins=10_000, is_descending=None))
    assert summarize_plan(shuffled, table).padding_fraction > 0.2


def test_oversized_utterance_warns_and_gets_own_batch(make_table):
    table = make_table([10, 500, 20, 30])
    with pytest.warns(OversizedBatchWarning, match="utt0001"):
        plan = build_batch_plan(table, BatchConfig(batch_bins=100))
    assert [1] in plan.batches
    assert plan.oversized == [plan.batches.index([1])]
    assert_each_row_once(plan, 4)
    with pytest.raises(BatchBudgetError, match="utt0001"):
        build_batch_plan(table, BatchConfig(batch_bins=100, strict=True))


@pytest.mark.parametrize("ngpu", [2, 3, 4])
def test_ngpu_borrow_keeps_every_batch_divisible(make_table, lognormal_frames, ngpu):
    frames = lognormal_frames(401)
    table = make_table(frames)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizedBatchWarning)
        plan = build_batch_plan(table, BatchConfig(batch_bins=4000, ngpu=ngpu))
    assert all(len(b) % ngpu == 0 for b in plan.batches)
    counts = Counter(flat(plan))
    assert set(counts) == set(range(len(frames)))
    assert sum(counts.values()) - len(frames) == (-len(frames)) % ngpu
    for index, batch in enumerate(plan.batches):
        if index not in plan.oversized:
            assert len(batch) * frames[batch].max() <= 4000
    assert all(len(plan.batches[i]) == ngpu for i in plan.oversized)


def test_ngpu_drop_leaves_out_the_remainder(make_table):
    table = make_table(list(range(1, 12)))
    plan = build_batch_plan(
        table, BatchConfig(batch_type="sorted", batch_size=4, ngpu=4, uneven="drop")
    )
    assert [len(b) for b in plan.batches] == [4, 4]
    assert len(plan.dropped) == 3
    assert sorted(set(flat(plan)) | {table.ids.index(u) for u in plan.dropped}) == list(range(11))


def test_batch_size_rounds_down_to_multiple_of_ngpu(make_table):
    table = make_table(list(range(1, 13)))
    plan = build_batch_plan(table, BatchConfig(batch_type="sorted", batch_size=5, ngpu=2))
    assert [len(b) for b in plan.batches] == [4, 4, 4]


def test_group_by_never_mixes_groups(make_table, lognormal_frames):
    frames = lognormal_frames(300)
    groups = [f"spk{i % 7}" for i in range(300)]
    table = make_table(frames, groups=groups)
    plan = build_batch_plan(table, BatchConfig(batch_bins=5000, group_by=True))
    assert_each_row_once(plan, 300)
    assert all(len(plan.batch_groups(i)) == 1 for i in range(len(plan)))
    mixed = build_batch_plan(table, BatchConfig(batch_bins=5000))
    assert any(len(mixed.batch_groups(i)) > 1 for i in range(len(mixed)))
    with pytest.raises(BatchConfigError, match="group"):
        build_batch_plan(make_table(frames), BatchConfig(batch_bins=5000, group_by=True))


def test_plan_round_trips_through_dict_and_text(make_table, tmp_path):
    table = make_table([3, 1, 2, 5, 4], groups=list("aabba"))
    plan = build_batch_plan(table, BatchConfig(batch_type="sorted", batch_size=2))
    assert BatchPlan.from_dict(plan.to_dict()) == plan
    path = tmp_path / "batches" / "train.txt"
    plan.write_text(path)
    assert read_batch_file(path) == plan.id_batches()
    assert path.read_text().splitlines()[0] == "utt0003 utt0004"
    assert not list(path.parent.glob(".*"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_type": "numel"}, "needs exactly one of batch_bins"),
        ({"batch_type": "numel", "batch_size": 3}, "needs exactly one of batch_bins"),
        ({"batch_type": "length", "max_frames": 10, "max_duration": 1.0}, "exactly one"),
        ({"batch_type": "sorted", "batch_size": 0}, "must be positive"),
        ({"batch_type": "sorted", "batch_size": 2, "ngpu": 4}, "cannot be split"),
        ({"batch_type": "bucket", "batch_size": 2}, "batch_type must be"),
        ({"batch_bins": 10, "uneven": "pad"}, "uneven"),
    ],
)
def test_config_rejects_bad_settings(kwargs, message):
    with pytest.raises(BatchConfigError, match=message):
        BatchConfig(**kwargs)


def test_config_round_trip_and_unknown_keys():
    config = BatchConfig(batch_type="length", max_duration=50.0, ngpu=2, group_by=True)
    assert BatchConfig.from_dict(config.to_dict()) == config
    with pytest.raises(BatchConfigError, match="unknown"):
        BatchConfig.from_dict({**config.to_dict(), "bogus": 1})
