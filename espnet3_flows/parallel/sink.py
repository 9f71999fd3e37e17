"""A shard's writer: opened on the shard's staging directory, given every result, finished once."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ShardSink:
    """Writes one shard's files: ``open`` (the constructor, on the shard's local staging
    directory) → :meth:`add` for each ``forward`` result → :meth:`finish`.

    Every file left under ``staging`` after :meth:`finish` is published, then the shard's
    ``done`` record (the runner's ``publish_rel`` says where each file goes). A shard that fails
    is never published: its staging directory is removed, finished or not.

    Args:
        staging: The shard's staging directory (local, empty, removed after publishing).
    """

    def __init__(self, staging: Path):
        self.staging = Path(staging)

    def add(self, idx: Any, result: Any) -> None:
        """Write one ``forward`` result (``idx``: the item index, or the list of a batch)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Complete the files (close, flush, write what was buffered)."""
