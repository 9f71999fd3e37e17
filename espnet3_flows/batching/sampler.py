"""PyTorch glue: a batch sampler over a :class:`BatchPlan` and a DataLoader with seeded workers."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from espnet3_flows.batching.config import UnevenPolicy
from espnet3_flows.batching.plan import BatchPlan
from espnet3_flows.batching.schedule import EpochSchedule

Batch = list[int] | list[str]


def _default_rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class BatchSampler(Sampler[Batch]):
    """Yields this rank's batches of a plan for the current epoch (a DataLoader ``batch_sampler``).

    Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``; Lightning
    does this itself. To resume in the middle of an epoch, pass ``epoch`` and
    ``start_step`` (or call ``set_epoch(epoch, start_step=...)``): that epoch skips its
    first ``start_step`` steps, later epochs start from their beginning.

    Args:
        plan: The batches.
        shuffle: Shuffle batch order each epoch (seeded by ``seed + epoch``).
        seed: Base seed, the same on every rank.
        batches_per_epoch: Steps per epoch per rank; see :class:`EpochSchedule`.
        rank: This rank; defaults to ``torch.distributed``'s, or 0.
        world_size: Number of ranks; defaults to ``torch.distributed``'s, or 1.
        uneven: Policy for a batch count not divisible by ``world_size``; defaults to
            the plan's ``config.uneven``.
        epoch: Initial epoch.
        start_step: Steps of ``epoch`` already done.
        output: ``indices`` yields lists of dataset indices, ``ids`` lists of utterance ids.
        index_of: Maps an utterance id to the dataset index; defaults to the plan's row
            order (``plan.ids[i]`` is index ``i``).
    """

    def __init__(
        self,
        plan: BatchPlan,
        *,
        shuffle: bool = True,
        seed: int = 0,
        batches_per_epoch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        uneven: UnevenPolicy | None = None,
        epoch: int = 0,
        start_step: int = 0,
        output: Literal["indices", "ids"] = "indices",
        index_of: Mapping[str, int] | None = None,
    ) -> None:
        if output not in ("indices", "ids"):
            raise ValueError(f"output must be 'indices' or 'ids', got {output!r}")
        default_rank, default_world = _default_rank_and_world()
        self.plan = plan
        self.rank = default_rank if rank is None else rank
        self.schedule = EpochSchedule(
            num_batches=len(plan),
            shuffle=shuffle,
            seed=seed,
            batches_per_epoch=batches_per_epoch,
            world_size=default_world if world_size is None else world_size,
            uneven=plan.config.uneven if uneven is None else uneven,
        )
        if not 0 <= self.rank < self.schedule.world_size:
            raise ValueError(f"rank must be in [0, {self.schedule.world_size}), got {self.rank}")
        self.output = output
        self._index = self._resolve_index(index_of) if output == "indices" else None
        self.epoch = epoch
        self._resume_epoch = epoch
        self._resume_step = start_step
        self.schedule.rank_order(epoch, self.rank, start_step)

    def _resolve_index(self, index_of: Mapping[str, int] | None) -> list[int] | None:
        if index_of is None:
            return None
        missing = [utt for utt in self.plan.ids if utt not in index_of]
        if missing:
            raise KeyError(f"index_of has no index for {len(missing)} id(s), e.g. {missing[0]!r}")
        return [index_of[utt] for utt in self.plan.ids]

    @property
    def seed(self) -> int:
        """The base seed."""
        return self.schedule.seed

    @property
    def start_step(self) -> int:
        """Steps skipped at the start of the current epoch."""
        return self._resume_step if self.epoch == self._resume_epoch else 0

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Select the epoch to iterate; optionally resume it from ``start_step``.

        Args:
            epoch: Epoch number.
            start_step: Steps of this epoch already done; ``None`` keeps a resume point
                set earlier for this epoch, if any.
        """
        self.schedule.rank_order(epoch, self.rank, start_step or 0)
        self.epoch = epoch
        if start_step is not None:
            self._resume_epoch, self._resume_step = epoch, start_step

    def batch_indices(self) -> list[int]:
        """Plan batch indices this rank takes in the current epoch (after ``start_step``)."""
        return self.schedule.rank_order(self.epoch, self.rank, self.start_step).tolist()

    def __iter__(self) -> Iterator[Batch]:
        for index in self.batch_indices():
            rows = self.plan.batches[index]
            if self.output == "ids":
                yield [self.plan.ids[r] for r in rows]
            elif self._index is None:
                yield list(rows)
            else:
                yield [self._index[r] for r in rows]

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch - self.start_step

    def state_dict(self) -> dict[str, Any]:
        """Epoch and resume point, for checkpoints."""
        return {"epoch": self.epoch, "start_step": self.start_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.set_epoch(int(state["epoch"]), int(state["start_step"]))


def worker_seed(seed: int, epoch: int, rank: int, worker_id: int) -> int:
    """A 32-bit seed for one DataLoader worker, distinct per (seed, epoch, rank, worker).

    Args:
        seed: Base seed.
        epoch: Epoch number.
        rank: Process rank.
        worker_id: DataLoader worker id.
    """
    sequence = np.random.SeedSequence([seed, epoch, rank, worker_id])
    return int(sequence.generate_state(1, dtype=np.uint32)[0])


class WorkerSeeder:
    """``worker_init_fn`` seeding ``random``, ``numpy.random`` and ``torch`` in each worker.

    It reads the sampler's epoch when the worker starts, so a DataLoader reused across
    epochs reseeds its (non-persistent) workers for each epoch.

    Args:
        sampler: The batch sampler the loader iterates.
    """

    def __init__(self, sampler: BatchSampler) -> None:
        self.seed = sampler.seed
        self.rank = sampler.rank
        self.sampler = sampler

    def __call__(self, worker_id: int) -> None:
        value = worker_seed(self.seed, self.sampler.epoch, self.rank, worker_id)
        random.seed(value)
        np.random.seed(value)
        torch.manual_seed(value)


def build_loader(
    dataset: Dataset[Any],
    plan: BatchPlan,
    epoch: int = 0,
    start_step: int = 0,
    num_workers: int = 0,
    *,
    shuffle: bool = True,
    seed: int = 0,
    batches_per_epoch: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    output: Literal["indices", "ids"] = "indices",
    index_of: Mapping[str, int] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader over ``dataset`` that takes its batches from ``plan``.

    Args:
        dataset: Map-style dataset; with ``output='ids'`` it is indexed by utterance id.
        plan: The batches.
        epoch: Epoch to iterate first.
        start_step: Steps of ``epoch`` already done (resume).
        num_workers: DataLoader worker processes.
        shuffle: Shuffle batch order per epoch.
        seed: Base seed for batch order and for the workers.
        batches_per_epoch: Steps per epoch per rank (clip or extend).
        rank: This rank (default: from ``torch.distributed`` or 0).
        world_size: Number of ranks (default: from ``torch.distributed`` or 1).
        output: What the sampler yields, ``indices`` or ``ids``.
        index_of: Utterance id to dataset index, when the dataset's order is not the plan's.
        collate_fn: Passed to the DataLoader.
        **loader_kwargs: Further DataLoader arguments (``pin_memory``...).

    Returns:
        The DataLoader; its ``batch_sampler`` is the :class:`BatchSampler` (call
        ``loader.batch_sampler.set_epoch(e)`` each epoch).
    """
    sampler = BatchSampler(
        plan,
        shuffle=shuffle,
        seed=seed,
        batches_per_epoch=batches_per_epoch,
        rank=rank,
        world_size=world_size,
        epoch=epoch,
        start_step=start_step,
        output=output,
        index_of=index_of,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        worker_init_fn=WorkerSeeder(sampler) if num_workers > 0 else None,
        collate_fn=collate_fn,
        **loader_kwargs,
    )
