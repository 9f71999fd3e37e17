"""How good a batch plan is: batch count, sizes, and the padding it wastes."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from espnet3_flows.batching.lengths import LengthTable
from espnet3_flows.batching.plan import BatchPlan


@dataclass
class BatchReport:
    """Summary of a :class:`BatchPlan` measured on the first length column.

    Attributes:
        num_utterances: Distinct utterances in the plan.
        num_batches: Batches in the plan.
        mean_batch_size: Mean rows per batch.
        min_batch_size: Smallest batch.
        max_batch_size: Largest batch.
        real_frames: Sum of the lengths of every row of every batch.
        padded_frames: Sum over batches of ``batch size * longest row``.
        padding_efficiency: ``real_frames / padded_frames`` (1.0 is no padding).
        padding_fraction: ``(padded_frames - real_frames) / padded_frames``.
        num_oversized: Batches over the budget (utterances longer than it).
        num_dropped: Utterances left out by ``uneven='drop'``.
        num_repeated: Extra occurrences of utterances borrowed to fill a batch.
        config: The plan's settings.
    """

    num_utterances: int
    num_batches: int
    mean_batch_size: float
    min_batch_size: int
    max_batch_size: int
    real_frames: float
    padded_frames: float
    padding_efficiency: float
    padding_fraction: float
    num_oversized: int = 0
    num_dropped: int = 0
    num_repeated: int = 0
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchReport:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def format(self) -> str:
        """A few human-readable lines."""
        return "\n".join(
            [
                f"batches:            {self.num_batches}",
                f"utterances:         {self.num_utterances}",
                f"batch size:         mean {self.mean_batch_size:.2f}, "
                f"min {self.min_batch_size}, max {self.max_batch_size}",
                f"padding efficiency: {self.padding_efficiency:.4f} (real / padded frames)",
                f"padding fraction:   {self.padding_fraction:.4f} ((padded - real) / padded)",
                f"oversized batches:  {self.num_oversized}",
                f"dropped / repeated: {self.num_dropped} / {self.num_repeated}",
            ]
        )


def padding_stats(lengths: np.ndarray, batches: list[list[int]]) -> tuple[float, float]:
    """Real and padded length totals of ``batches`` over ``lengths``.

    Args:
        lengths: Length of every row.
        batches: Row indices of each batch.

    Returns:
        ``(real, padded)`` where padded sums ``len(batch) * max length`` per batch.
    """
    real = 0.0
    padded = 0.0
    for batch in batches:
        values = lengths[batch]
        real += float(values.sum())
        padded += float(len(batch) * values.max())
    return real, padded


def summarize_plan(plan: BatchPlan, table: LengthTable) -> BatchReport:
    """Measure a plan against the table it was built from.

    Args:
        plan: The plan.
        table: The table (the plan's row indices refer to it).

    Returns:
        The report.
    """
    if plan.ids != table.ids:
        raise ValueError("the plan was not built from this table (ids differ)")
    sizes = [len(b) for b in plan.batches]
    real, padded = padding_stats(table.primary, plan.batches)
    occurrences = Counter(row for batch in plan.batches for row in batch)
    return BatchReport(
        num_utterances=len(occurrences),
        num_batches=len(plan.batches),
        mean_batch_size=float(np.mean(sizes)) if sizes else 0.0,
        min_batch_size=min(sizes, default=0),
        max_batch_size=max(sizes, default=0),
        real_frames=real,
        padded_frames=padded,
        padding_efficiency=real / padded if padded else 1.0,
        padding_fraction=(padded - real) / padded if padded else 0.0,
        num_oversized=len(plan.oversized),
        num_dropped=len(plan.dropped),
        num_repeated=sum(count - 1 for count in occurrences.values()),
        config=plan.config.to_dict(),
    )
