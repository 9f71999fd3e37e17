"""Settings of a batch plan (strategy, budget, GPU split), checked when constructed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from espnet3_flows.errors import Espnet3FlowsError

BatchType = Literal["sorted", "numel", "length"]
UnevenPolicy = Literal["borrow", "drop"]
SortOrder = Literal["descending", "ascending"]

_BUDGET_OF = {
    "sorted": ("batch_size",),
    "numel": ("batch_bins",),
    "length": ("batch_bins", "max_frames", "max_duration"),
}
_SORT_ORDERS = ("descending", "ascending", None)


class BatchConfigError(Espnet3FlowsError, ValueError):
    """A batch setting that cannot work, found before any batching is done."""


@dataclass(frozen=True)
class BatchConfig:
    """How utterances are grouped into batches.

    Attributes:
        batch_type: ESPnet2's batch types, with ESPnet2's meaning of ``batch_bins``.
            ``sorted``: fixed ``batch_size`` on length-sorted rows. ``numel``: as many rows as
            fit ``batch_bins`` padded elements, ``n * sum_c(max_len_c * dim_c)`` over the shape
            columns. ``length``: as many rows as fit a length budget: ``batch_bins`` over every
            shape column, ``n * sum_c(max_len_c)`` (ESPnet2's ``length`` with its default
            ``padding``); or the first column only, ``n * max_len`` ≤ ``max_frames`` (its
            units), or ``n * max_len * frame_shift`` ≤ ``max_duration`` seconds (lhotse's
            ``max_duration``: the batch's padded duration).
        batch_size: Rows per batch for ``sorted``.
        batch_bins: Budget of ``numel`` (padded elements) or ``length`` (padded lengths,
            summed over the shape columns), as ESPnet2's ``--batch_bins``.
        max_frames: Padded length budget of ``length`` on the first column, in its units.
        max_duration: Padded duration budget of ``length`` in seconds, as lhotse's
            ``max_duration`` (needs the table's ``frame_shift``).
        padding: For ``length``: count each row at the batch's longest length (``True``, what a
            padded tensor costs; ESPnet2's default), or at its own (``False``: sums of real
            lengths, ESPnet2's ``padding: false``, lhotse's concatenated cuts).
        is_descending: Sort longest first (``True``), shortest first (``False``), or keep
            file order (``None``) before filling batches.
        sort_in_batch: ESPnet2's ``sort_in_batch``: ids within each batch longest first
            (``descending``) or shortest first (``ascending``); ``None`` keeps the fill order.
        sort_batch: ESPnet2's ``sort_batch``: batches in the file from short to long
            (``ascending``) or long to short (``descending``), by their longest row; ``None``
            keeps the fill order.
        ngpu: Devices one batch is split across (DataParallel). Batch sizes are kept
            multiples of ``ngpu``; see :func:`build_batch_plan` for the remainder.
        uneven: What to do with rows (for ``ngpu``) or batches (for ``world_size``) that
            do not divide evenly: ``borrow`` repeats neighbours to fill the gap, ``drop``
            leaves them out.
        group_by: Never mix groups (from a group file) in one batch.
        strict: Make an utterance longer than the budget an error instead of a warning.
    """

    batch_type: BatchType = "numel"
    batch_size: int | None = None
    batch_bins: int | None = None
    max_frames: float | None = None
    max_duration: float | None = None
    padding: bool = True
    is_descending: bool | None = True
    sort_in_batch: SortOrder | None = None
    sort_batch: SortOrder | None = None
    ngpu: int = 1
    uneven: UnevenPolicy = "borrow"
    group_by: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        if self.batch_type not in _BUDGET_OF:
            raise BatchConfigError(
                f"batch_type must be one of {sorted(_BUDGET_OF)}, got {self.batch_type!r}"
            )
        allowed = _BUDGET_OF[self.batch_type]
        given = [
            name
            for name in ("batch_size", "batch_bins", "max_frames", "max_duration")
            if getattr(self, name) is not None
        ]
        if len(given) != 1 or given[0] not in allowed:
            raise BatchConfigError(
                f"batch_type={self.batch_type!r} needs exactly one of {' / '.join(allowed)}, "
                f"got {given or 'none'}"
            )
        budget = getattr(self, given[0])
        if not budget > 0:
            raise BatchConfigError(f"{given[0]} must be positive, got {budget}")
        if self.ngpu < 1:
            raise BatchConfigError(f"ngpu must be >= 1, got {self.ngpu}")
        if self.batch_size is not None and self.batch_size < self.ngpu:
            raise BatchConfigError(
                f"batch_size={self.batch_size} cannot be split across ngpu={self.ngpu} devices"
            )
        if self.uneven not in ("borrow", "drop"):
            raise BatchConfigError(f"uneven must be 'borrow' or 'drop', got {self.uneven!r}")
        if self.is_descending not in (True, False, None):
            raise BatchConfigError(f"is_descending must be True, False or None, got {self.is_descending!r}")
        for name in ("sort_in_batch", "sort_batch"):
            if getattr(self, name) not in _SORT_ORDERS:
                raise BatchConfigError(f"{name} must be 'descending', 'ascending' or None, got {getattr(self, name)!r}")
        if self.padding not in (True, False):
            raise BatchConfigError(f"padding must be True or False, got {self.padding!r}")

    @property
    def budget_name(self) -> str:
        """The name of the budget setting in use (``batch_bins``, ``max_frames``...)."""
        return next(n for n in _BUDGET_OF[self.batch_type] if getattr(self, n) is not None)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BatchConfigError(f"unknown batch settings: {sorted(unknown)}")
        return cls(**data)
