"""Batching view over collected lengths: length-sorted and budgeted batch plans for training.

Read lengths (:class:`LengthTable` from ESPnet2 shape files or a lhotse CutSet), plan
batches (:func:`build_batch_plan` with a :class:`BatchConfig`), schedule them per epoch
and rank (:class:`EpochSchedule`), and feed PyTorch (:class:`BatchSampler`,
:func:`build_loader`). No Prefect here; the orchestration layer wraps these.
"""

from espnet3_flows.batching.cli import export_batches
from espnet3_flows.batching.config import BatchConfig, BatchConfigError
from espnet3_flows.batching.lengths import (
    LengthFileError,
    LengthTable,
    ShapeColumn,
    read_group_file,
    read_shape_file,
    read_shape_files,
)
from espnet3_flows.batching.plan import (
    BatchBudgetError,
    BatchPlan,
    OversizedBatchWarning,
    batch_cost,
    build_batch_plan,
    read_batch_file,
)
from espnet3_flows.batching.report import BatchReport, padding_stats, summarize_plan
from espnet3_flows.batching.schedule import EpochSchedule

_TORCH_NAMES = ("BatchSampler", "WorkerSeeder", "build_loader", "worker_seed")


def __getattr__(name: str) -> object:
    # the sampler imports torch; loading it lazily keeps the CLI and planning light
    if name in _TORCH_NAMES:
        from espnet3_flows.batching import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchBudgetError",
    "BatchConfig",
    "BatchConfigError",
    "BatchPlan",
    "BatchReport",
    "BatchSampler",
    "EpochSchedule",
    "LengthFileError",
    "LengthTable",
    "OversizedBatchWarning",
    "ShapeColumn",
    "WorkerSeeder",
    "batch_cost",
    "build_batch_plan",
    "build_loader",
    "export_batches",
    "padding_stats",
    "read_batch_file",
    "read_group_file",
    "read_shape_file",
    "read_shape_files",
    "summarize_plan",
    "worker_seed",
]
