"""PyTorch integration: the batch sampler in a DataLoader; epochs, ranks, resume, seeded workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from espnet3_flows.batching import BatchConfig, BatchSampler, build_batch_plan, build_loader
from espnet3_flows.batching.sampler import worker_seed


class LengthDataset(Dataset):
    """Item i is (i, a tensor of its length, one draw from numpy's and torch's global RNG)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[int, int, float, float]:
        return index, int(self.lengths[index]), float(np.random.random()), float(torch.rand(()))


def collate(items):
    return items


@pytest.fixture
def plan_and_lengths(make_table, lognormal_frames):
    frames = lognormal_frames(200, seed=5)
    table = make_table(frames)
    return build_batch_plan(table, BatchConfig(batch_bins=4000)), frames


def test_sampler_yields_plan_batches_in_epoch_order(plan_and_lengths):
    plan, _ = plan_and_lengths
    sampler = BatchSampler(plan, seed=1)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == len(plan)
    assert sorted(map(sorted, epoch0)) == sorted(map(sorted, plan.batches))
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0
    assert list(BatchSampler(plan, seed=1, epoch=1)) == epoch1


def test_sampler_ids_and_custom_index(plan_and_lengths):
    plan, _ = plan_and_lengths
    by_ids = list(BatchSampler(plan, seed=0, output="ids"))
    assert by_ids[0] == [plan.ids[r] for r in next(iter(BatchSampler(plan, seed=0)))]
    reverse = {utt: len(plan.ids) - 1 - i for i, utt in enumerate(plan.ids)}
    remapped = list(BatchSampler(plan, seed=0, index_of=reverse))
    assert remapped[0] == [reverse[u] for u in by_ids[0]]
    with pytest.raises(KeyError, match="no index"):
        BatchSampler(plan, index_of={})


def test_sampler_resume_and_state(plan_and_lengths):
    plan, _ = plan_and_lengths
    full = list(BatchSampler(plan, seed=4, epoch=2))
    resumed = BatchSampler(plan, seed=4, epoch=2, start_step=5)
    assert len(resumed) == len(full) - 5
    assert list(resumed) == full[5:]
    resumed.set_epoch(2)  # a trainer calling set_epoch again keeps the resume point
    assert list(resumed) == full[5:]
    resumed.set_epoch(3)
    assert len(list(resumed)) == len(full)
    restored = BatchSampler(plan, seed=4)
    restored.load_state_dict({"epoch": 2, "start_step": 5})
    assert list(restored) == full[5:] and restored.state_dict() == {"epoch": 2, "start_step": 5}


def test_sampler_ranks_are_even(plan_and_lengths):
    plan, _ = plan_and_lengths
    views = [list(BatchSampler(plan, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert len({len(v) for v in views}) == 1
    assert {tuple(b) for v in views for b in v} == {tuple(b) for b in plan.batches}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_delivers_plan_batches_with_seeded_workers(plan_and_lengths, num_workers):
    plan, frames = plan_and_lengths
    dataset = LengthDataset(frames)

    def run(epoch: int, start_step: int = 0):
        loader = build_loader(
            dataset, plan, epoch, start_step, num_workers, seed=11, collate_fn=collate
        )
        return [[tuple(item) for item in batch] for batch in loader]

    def indices(batches):
        return [[item[0] for item in batch] for batch in batches]

    first = run(0)
    assert indices(first) == list(BatchSampler(plan, seed=11))
    assert all(item[1] == frames[item[0]] for batch in first for item in batch)
    assert indices(run(0, start_step=3)) == indices(first)[3:]
    if num_workers:
        # seeded workers make even the global-RNG draws of the dataset reproducible
        assert run(0) == first
        draws = [item[2:] for batch in first for item in batch]
        assert sorted(draws) != sorted(item[2:] for batch in run(1) for item in batch)


def test_reused_loader_reseeds_workers_per_epoch(plan_and_lengths):
    plan, frames = plan_and_lengths
    loader = build_loader(LengthDataset(frames), plan, num_workers=2, seed=3, collate_fn=collate)
    epoch0 = [item[2] for batch in loader for item in batch]
    loader.batch_sampler.set_epoch(1)
    epoch1 = [item[2] for batch in loader for item in batch]
    fresh = build_loader(LengthDataset(frames), plan, 1, 0, 2, seed=3, collate_fn=collate)
    assert epoch1 == [item[2] for batch in fresh for item in batch]
    assert epoch0 != epoch1


def test_worker_seeds_differ():
    seeds = {worker_seed(0, e, r, w) for e in range(3) for r in range(2) for w in range(4)}
    assert len(seeds) == 24
    assert worker_seed(5, 1, 0, 2) == worker_seed(5, 1, 0, 2)
