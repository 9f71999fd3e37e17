"""Batch plans: length-sorted fixed-size or budgeted batches built from a :class:`LengthTable`."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from espnet3_flows.batching.config import BatchConfig, BatchConfigError
from espnet3_flows.batching.lengths import LengthTable
from espnet3_flows.errors import Espnet3FlowsError
from espnet3_flows.storage import replace_atomically

PathLike = Union[str, "os.PathLike[str]"]


class BatchBudgetError(Espnet3FlowsError, ValueError):
    """Under ``strict=True``: an utterance (or ``ngpu`` of them) does not fit the budget."""


class OversizedBatchWarning(UserWarning):
    """An utterance longer than the budget was given a batch of its own (ESPnet2 behaviour)."""


@dataclass
class BatchPlan:
    """A fixed list of batches over the rows of a :class:`LengthTable`.

    Attributes:
        ids: Utterance id of every row; batches hold row indices into this list.
        batches: Row indices of each batch, in plan order (sorted by length unless
            ``is_descending`` is ``None``). A row appears once, except rows repeated to
            fill the last batch under ``uneven='borrow'``.
        config: The settings that produced the plan.
        groups: Group name of every row, or ``None``.
        dropped: Ids left out under ``uneven='drop'``.
        oversized: Indices of batches whose cost exceeds the budget.
    """

    ids: list[str]
    batches: list[list[int]]
    config: BatchConfig
    groups: list[str] | None = None
    dropped: list[str] = field(default_factory=list)
    oversized: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.batches)

    def batch_ids(self, index: int) -> list[str]:
        """Utterance ids of batch ``index``."""
        return [self.ids[row] for row in self.batches[index]]

    def batch_groups(self, index: int) -> list[str]:
        """Sorted distinct groups in batch ``index`` (empty when the plan has no groups)."""
        if self.groups is None:
            return []
        return sorted({self.groups[row] for row in self.batches[index]})

    def id_batches(self) -> list[list[str]]:
        """All batches as lists of utterance ids."""
        return [self.batch_ids(i) for i in range(len(self.batches))]

    def write_text(self, path: PathLike) -> None:
        """Write one batch a line, ids separated by spaces (the ``batches/<split>.txt`` format).

        The file is written beside its final name and renamed, so a reader never sees
        half of it.
        """
        lines = "".join(" ".join(batch) + "\n" for batch in self.id_batches())
        replace_atomically(path, lambda f: f.write(lines.encode("utf-8")))

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "ids": list(self.ids),
            "batches": [list(map(int, b)) for b in self.batches],
            "config": self.config.to_dict(),
            "groups": None if self.groups is None else list(self.groups),
            "dropped": list(self.dropped),
            "oversized": list(self.oversized),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            ids=list(data["ids"]),
            batches=[list(b) for b in data["batches"]],
            config=BatchConfig.from_dict(data["config"]),
            groups=None if data.get("groups") is None else list(data["groups"]),
            dropped=list(data.get("dropped", [])),
            oversized=list(data.get("oversized", [])),
        )


def read_batch_file(path: PathLike) -> list[list[str]]:
    """Read a ``batches/<split>.txt`` file back into lists of ids (blank lines skipped).

    Args:
        path: The batch file.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.split() for line in lines if line.strip()]


def _budget_in_units(table: LengthTable, config: BatchConfig) -> float:
    if config.batch_type == "sorted":
        return float(config.batch_size)  # type: ignore[arg-type]
    if config.batch_bins is not None:  # numel, or length over every column (ESPnet2)
        return float(config.batch_bins)
    if config.max_frames is not None:
        return float(config.max_frames)
    if table.frame_shift is None:
        raise BatchConfigError(
            "max_duration needs the table's frame_shift (seconds per length unit); "
            "pass frame_shift when reading the shape files or use max_frames"
        )
    return float(config.max_duration) / table.frame_shift  # type: ignore[arg-type]


def _sorted_rows(table: LengthTable, is_descending: bool | None) -> np.ndarray:
    if is_descending is None:
        return np.arange(len(table))
    key = -table.primary if is_descending else table.primary
    # a stable sort keeps file order among equal lengths, so plans are reproducible
    return np.argsort(key, kind="stable")


def _segments(table: LengthTable, rows: np.ndarray, group_by: bool) -> list[np.ndarray]:
    if not group_by:
        return [rows]
    if table.groups is None:
        raise BatchConfigError("group_by=True needs a table with groups (pass a group file)")
    labels = np.asarray(table.groups, dtype=object)[rows]
    order: dict[str, list[int]] = {}
    for row, label in zip(rows.tolist(), labels.tolist(), strict=True):
        order.setdefault(label, []).append(row)
    return [np.asarray(members, dtype=np.int64) for members in order.values()]


class _CostMeter:
    """Measures batch costs over one segment of sorted rows for the configured batch type."""

    def __init__(self, table: LengthTable, config: BatchConfig, rows: np.ndarray):
        self.table = table
        self.config = config
        self.kind = config.batch_type
        self.cols = table.lengths[:, rows].astype(np.float64)
        self.dims = np.asarray(table.dims, dtype=np.float64)

    def cost(self, batch: list[int]) -> float:
        """Cost of a batch given as table row indices."""
        return batch_cost(self.table, self.config, batch)

    def fit_count(self, start: int, budget: float) -> int:
        """Largest n such that the segment's rows[start:start+n] fit (0 if one row does not)."""
        total = self.cols.shape[1]
        if self.kind == "sorted":
            return min(int(budget), total - start)
        if self.kind == "length":
            return self._length_fit(start, budget)
        maxes = np.zeros(self.cols.shape[0])
        weight = 0.0
        n = 0
        for j in range(start, total):
            column = self.cols[:, j]
            if (column > maxes).any():
                maxes = np.maximum(maxes, column)
                weight = float((maxes * self.dims).sum())
            if (n + 1) * weight > budget:
                break
            n += 1
        return n

    def _length_fit(self, start: int, budget: float) -> int:
        """``fit_count`` of ``length``, vectorised over a window that doubles until the budget
        is crossed (work proportional to the batch, not to the rest of the segment)."""
        cols = self.cols if self.config.batch_bins is not None else self.cols[:1]  # ESPnet2: every column
        total = cols.shape[1]
        window = 256
        while True:
            block = cols[:, start:min(total, start + window)]
            if self.config.padding:  # n * sum_c(max_len_c) of the first n rows
                cost = np.arange(1, block.shape[1] + 1) * np.maximum.accumulate(block, axis=1).sum(axis=0)
            else:  # sum of real lengths
                cost = np.cumsum(block.sum(axis=0))
            over = np.flatnonzero(cost > budget)
            if over.size:
                return int(over[0])
            if start + window >= total:
                return block.shape[1]
            window *= 2


def _plan_segment(
    meter: _CostMeter, rows: np.ndarray, budget: float, config: BatchConfig
) -> tuple[list[list[int]], list[int]]:
    """Greedy fill of one segment of sorted rows; returns (batches, dropped rows)."""
    ngpu = config.ngpu
    batches: list[list[int]] = []
    start = 0
    while start < len(rows):
        remaining = len(rows) - start
        fit = meter.fit_count(start, budget)
        if fit >= remaining:
            size = remaining
        elif fit >= ngpu:
            size = fit - fit % ngpu
        else:
            size = min(ngpu, remaining)
        batches.append(rows[start : start + size].tolist())
        start += size

    last = batches[-1]
    extra = len(last) % ngpu
    if not extra:
        return batches, []
    if config.uneven == "drop":
        batches[-1] = last[:-extra]
        if not batches[-1]:
            batches.pop()
        return batches, last[-extra:]
    need = ngpu - extra
    filled = last + [last[i % len(last)] for i in range(need)]
    if len(last) < ngpu or meter.cost(filled) <= budget:
        batches[-1] = filled
    else:
        head, tail = last[:-extra], last[-extra:]
        batches[-1] = head
        batches.append(tail + head[-need:])
    return batches, []


def build_batch_plan(table: LengthTable, config: BatchConfig) -> BatchPlan:
    """Group the table's rows into batches.

    Rows are sorted by the first column (``is_descending``; ties keep file order), split
    by group when ``group_by``, then filled greedily: a batch takes as many following
    rows as fit the budget, so neighbours of near-equal length share a batch and padding
    is close to zero. With ``ngpu > 1`` a batch that stops short of the budget is cut
    back to a multiple of ``ngpu`` (the rows cut off start the next batch), and a batch
    always holds at least ``ngpu`` rows even if that exceeds the budget. Only the last
    batch of a segment can then be uneven: ``uneven='drop'`` leaves its extra rows out
    (recorded in ``plan.dropped``); ``uneven='borrow'`` repeats rows of that batch to
    fill it, or, when that would break the budget, splits the extra rows off into a
    batch of their own topped up with their nearest neighbours. Last, ``sort_in_batch`` and
    ``sort_batch`` order the ids within each batch and the batches, as ESPnet2's samplers do.

    Args:
        table: Lengths to batch.
        config: Strategy and budget.

    Returns:
        The plan.

    Raises:
        BatchBudgetError: Under ``config.strict``, when a batch of the minimum size
            (one row, or ``ngpu`` rows) exceeds the budget.
        BatchConfigError: ``max_duration`` without a frame shift, or ``group_by``
            without groups.
    """
    budget = _budget_in_units(table, config)
    rows = _sorted_rows(table, config.is_descending)
    batches: list[list[int]] = []
    dropped: list[int] = []
    for segment in _segments(table, rows, config.group_by):
        meter = _CostMeter(table, config, segment)
        seg_batches, seg_dropped = _plan_segment(meter, segment, budget, config)
        batches.extend(seg_batches)
        dropped.extend(seg_dropped)
    batches = _espnet2_order(table, config, batches)
    oversized = _find_oversized(table, config, batches, budget)
    return BatchPlan(
        ids=list(table.ids),
        batches=batches,
        config=config,
        groups=None if table.groups is None else list(table.groups),
        dropped=[table.ids[r] for r in dropped],
        oversized=oversized,
    )


def _espnet2_order(table: LengthTable, config: BatchConfig, batches: list[list[int]]) -> list[list[int]]:
    """Apply ``sort_in_batch`` (ids within a batch) and ``sort_batch`` (batches in the plan) by
    the first column's length, as ESPnet2's samplers do; stable, so equal lengths keep their order."""
    primary = table.primary
    if config.sort_in_batch is not None:
        sign = -1 if config.sort_in_batch == "descending" else 1
        batches = [sorted(b, key=lambda r: sign * primary[r]) for b in batches]
    if config.sort_batch is not None:
        sign = -1 if config.sort_batch == "descending" else 1
        batches = sorted(batches, key=lambda b: sign * max(primary[r] for r in b))
    return batches


def batch_cost(table: LengthTable, config: BatchConfig, batch: list[int]) -> float:
    """The budget a batch uses under ``config.batch_type`` (rows, padded bins or lengths).

    Args:
        table: The table the batch indexes.
        config: Decides the cost measure.
        batch: Row indices.
    """
    if config.batch_type == "sorted":
        return float(len(batch))
    block = table.lengths[:, batch]
    if config.batch_type == "length":
        cols = block if config.batch_bins is not None else block[:1]
        return float(len(batch) * cols.max(axis=1).sum()) if config.padding else float(cols.sum())
    return float(len(batch) * (block.max(axis=1) * np.asarray(table.dims)).sum())


def _find_oversized(
    table: LengthTable, config: BatchConfig, batches: list[list[int]], budget: float
) -> list[int]:
    oversized = [i for i, b in enumerate(batches) if batch_cost(table, config, b) > budget]
    for index in oversized:
        names = [table.ids[r] for r in batches[index]]
        limit = f"{config.budget_name}={getattr(config, config.budget_name)}"
        message = (
            f"utterance(s) {names} exceed {limit} even in a batch of the minimum size"
            f" ({config.ngpu})"
        )
        if config.strict:
            raise BatchBudgetError(f"{message}; raise the budget or drop them (strict=True)")
        warnings.warn(f"{message}; they get a batch of their own", OversizedBatchWarning,
                      stacklevel=3)
    return oversized
