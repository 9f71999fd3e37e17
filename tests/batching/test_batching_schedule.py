"""Epoch schedules: seeded shuffles, equal per-rank steps, clip/extend over epochs, resume."""

from __future__ import annotations

import numpy as np
import pytest

from espnet3_flows.batching import EpochSchedule


def test_same_seed_same_order_and_epochs_differ():
    schedule = EpochSchedule(num_batches=50, seed=3)
    again = EpochSchedule.from_dict(schedule.to_dict())
    assert np.array_equal(schedule.epoch_order(4), again.epoch_order(4))
    orders = {tuple(schedule.epoch_order(e)) for e in range(5)}
    assert len(orders) == 5
    assert not np.array_equal(schedule.epoch_order(0), EpochSchedule(50, seed=4).epoch_order(0))
    # the documented seeding rule: epoch e is default_rng(seed + e)'s permutation
    assert np.array_equal(
        schedule.epoch_order(2), np.random.default_rng(5).permutation(50)
    )
    for epoch in range(3):
        assert sorted(schedule.epoch_order(epoch)) == list(range(50))


def test_no_shuffle_is_plan_order():
    assert EpochSchedule(7, shuffle=False).epoch_order(3).tolist() == list(range(7))


def test_shuffle_does_not_touch_global_random_state():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    EpochSchedule(20, seed=1).epoch_order(0)
    assert np.array_equal(np.random.get_state()[1], before)


@pytest.mark.parametrize("num_batches", [10, 11, 13])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_take_equal_steps_borrow(num_batches, world_size):
    schedule = EpochSchedule(num_batches, seed=0, world_size=world_size, uneven="borrow")
    views = [schedule.rank_order(1, rank) for rank in range(world_size)]
    assert {len(v) for v in views} == {schedule.steps_per_epoch}
    assert schedule.steps_per_epoch == -(-num_batches // world_size)
    taken = np.concatenate(views)
    assert set(taken.tolist()) == set(range(num_batches))
    assert len(taken) - num_batches == (-num_batches) % world_size


@pytest.mark.parametrize("num_batches", [10, 11, 13])
def test_ranks_take_equal_steps_drop(num_batches):
    schedule = EpochSchedule(num_batches, seed=0, world_size=4, uneven="drop")
    views = [schedule.rank_order(0, rank) for rank in range(4)]
    assert {len(v) for v in views} == {num_batches // 4}
    taken = np.concatenate(views)
    assert len(set(taken.tolist())) == len(taken) == 4 * (num_batches // 4)


def test_drop_with_fewer_batches_than_ranks_is_an_error():
    with pytest.raises(ValueError, match="cannot give each of 4 ranks"):
        EpochSchedule(3, world_size=4, uneven="drop")


def test_clip_continues_where_previous_epoch_stopped():
    schedule = EpochSchedule(10, seed=7, batches_per_epoch=4)
    epochs = np.concatenate([schedule.epoch_order(e) for e in range(5)])
    passes = np.concatenate([schedule.pass_order(p) for p in range(2)])
    assert np.array_equal(epochs, passes)
    assert all(len(schedule.epoch_order(e)) == 4 for e in range(5))


def test_clip_with_ranks_counts_steps_per_rank():
    schedule = EpochSchedule(12, seed=0, batches_per_epoch=3, world_size=2)
    first_two = np.concatenate([schedule.epoch_order(0), schedule.epoch_order(1)])
    assert sorted(first_two.tolist()) == list(range(12))
    assert [len(schedule.rank_order(0, r)) for r in range(2)] == [3, 3]


def test_extend_repeats_the_epoch_from_its_start():
    schedule = EpochSchedule(5, seed=1, batches_per_epoch=12)
    order = schedule.epoch_order(2)
    base = schedule.pass_order(2)
    assert order.tolist() == np.concatenate([base, base, base[:2]]).tolist()


@pytest.mark.parametrize("start_step", [0, 1, 4, 6])
def test_resume_gives_the_rest_of_the_same_epoch(start_step):
    schedule = EpochSchedule(13, seed=2, world_size=2)
    full = schedule.rank_order(3, rank=1)
    resumed = schedule.rank_order(3, rank=1, start_step=start_step)
    assert resumed.tolist() == full[start_step:].tolist()


def test_bad_arguments():
    schedule = EpochSchedule(6, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        schedule.rank_order(0, rank=2)
    with pytest.raises(ValueError, match="start_step"):
        schedule.rank_order(0, rank=0, start_step=4)
    with pytest.raises(ValueError, match="seed"):
        EpochSchedule(6, seed=-1)
