"""Settings of a batch plan (strategy, budget, GPU split), checked when constructed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from espnet3_flows.errors import Espnet3FlowsError

BatchType = Literal["sorted", "numel", "length"]
UnevenPolicy = Literal["borrow", "drop"]

_BUDGET_OF = {
    "sorted": ("batch_size",),
    "numel": ("batch_bins",),
    "length": ("max_frames", "max_duration"),
}


class BatchConfigError(Espnet3FlowsError, ValueError):
    """A batch setting that cannot work, found before any batching is done."""


@dataclass(frozen=True)
class BatchConfig:
    """How utterances are grouped into batches.

    Attributes:
        batch_type: ``sorted``: fixed ``batch_size`` on length-sorted rows.
            ``numel``: as many rows as fit the padded budget ``batch_bins``:
            ``n * sum_c(max_len_c * dim_c) <= batch_bins`` over the shape columns
            (ESPnet2 ``numel``). ``length``: as many rows as fit a total real length
            (first column) of ``max_frames`` units, or ``max_duration`` seconds
            (ESPnet2 ``length`` without padding).
        batch_size: Rows per batch for ``sorted``.
        batch_bins: Padded-element budget for ``numel``.
        max_frames: Total-length budget for ``length``, in the table's units.
        max_duration: Total-length budget for ``length`` in seconds (needs the table's
            ``frame_shift``).
        is_descending: Sort longest first (``True``), shortest first (``False``), or keep
            file order (``None``).
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
    is_descending: bool | None = True
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
