"""Which batches of a plan each rank takes in an epoch: shuffling, clipping, rank split, resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from espnet3_flows.batching.config import UnevenPolicy


@dataclass(frozen=True)
class EpochSchedule:
    """Deterministic epoch orders over ``num_batches`` planned batches.

    The order of an epoch depends only on the fields below and the epoch number, so
    every process computes the same order without talking to the others.

    * **Shuffle.** Pass ``p`` over the plan is the permutation drawn by
      ``numpy.random.default_rng(seed + p)`` (plan order when ``shuffle=False``).
      Without ``batches_per_epoch``, epoch ``e`` is pass ``e``.
    * **Clip** (``batches_per_epoch * world_size < num_batches``): the passes are laid
      end to end and epoch ``e`` takes the next ``batches_per_epoch * world_size`` of them,
      so each epoch continues where the previous one stopped (SpeechChain's iterator).
    * **Extend** (``batches_per_epoch * world_size > num_batches``): epoch ``e`` is pass ``e``
      repeated from its start until it is long enough.
    * **Ranks.** Rank ``r`` takes positions ``r, r + world_size, ...`` of the epoch order,
      whole batches each, so all ranks take the same number of steps. Without
      ``batches_per_epoch`` an order whose length is not a multiple of ``world_size`` is
      made one: ``uneven='borrow'`` appends the first batches of the same order again,
      ``uneven='drop'`` leaves the last ones out of that epoch.
    * **Resume.** ``start_step`` skips a rank's first steps of the epoch.

    Attributes:
        num_batches: Batches in the plan.
        shuffle: Shuffle batch order each pass.
        seed: Base seed (non-negative).
        batches_per_epoch: Steps per epoch *per rank*, or ``None`` for one pass.
        world_size: Number of ranks (processes) sharing the plan.
        uneven: ``borrow`` or ``drop``, for a batch count not divisible by ``world_size``.
    """

    num_batches: int
    shuffle: bool = True
    seed: int = 0
    batches_per_epoch: int | None = None
    world_size: int = 1
    uneven: UnevenPolicy = "borrow"

    def __post_init__(self) -> None:
        if self.num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {self.num_batches}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.batches_per_epoch is not None and self.batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch must be >= 1, got {self.batches_per_epoch}")
        if self.uneven not in ("borrow", "drop"):
            raise ValueError(f"uneven must be 'borrow' or 'drop', got {self.uneven!r}")
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_batches} batches cannot give each of {self.world_size} ranks a batch "
                "with uneven='drop'; use 'borrow' or smaller batches"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Batches each rank takes per epoch."""
        if self.batches_per_epoch is not None:
            return self.batches_per_epoch
        whole, rest = divmod(self.num_batches, self.world_size)
        return whole + (1 if rest and self.uneven == "borrow" else 0)

    def pass_order(self, index: int) -> np.ndarray:
        """Batch order of pass ``index`` over the plan."""
        if not self.shuffle:
            return np.arange(self.num_batches)
        return np.random.default_rng(self.seed + index).permutation(self.num_batches)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Batch indices of ``epoch`` over all ranks (length ``steps_per_epoch * world_size``).

        Args:
            epoch: Epoch number (non-negative).
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        total = self.steps_per_epoch * self.world_size
        if self.batches_per_epoch is None or total > self.num_batches:
            return np.resize(self.pass_order(epoch), total)
        begin = epoch * total
        pieces = []
        pass_index, offset = divmod(begin, self.num_batches)
        while total > 0:
            take = min(total, self.num_batches - offset)
            pieces.append(self.pass_order(pass_index)[offset : offset + take])
            total -= take
            pass_index, offset = pass_index + 1, 0
        return np.concatenate(pieces)

    def rank_order(self, epoch: int, rank: int = 0, start_step: int = 0) -> np.ndarray:
        """Batch indices rank ``rank`` takes in ``epoch``, from step ``start_step`` on.

        Args:
            epoch: Epoch number.
            rank: This process's rank, ``0 <= rank < world_size``.
            start_step: Steps of this epoch already done (resume); ``0`` for a fresh epoch.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(
                f"start_step must be in [0, {self.steps_per_epoch}], got {start_step}"
            )
        return self.epoch_order(epoch)[rank :: self.world_size][start_step:]

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpochSchedule:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)
