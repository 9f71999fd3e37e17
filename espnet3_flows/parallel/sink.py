"""A shard's writer: opened on the shard's staging directory, given every result, finished once."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ShardSink:
    """Writes one shard's files: ``open`` (the constructor, on the shard's local staging
    directory) → :meth:`add` for each ``forward`` result → :meth:`finish`.

    Every file left under ``staging`` after :meth:`finish` is published, then the shard's
    ``done`` record: in the shard's directory, or where :meth:`destination` says. A shard that
    fails is never published: its staging directory is removed, finished or not.

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

    def destination(self, name: str) -> str | None:
        """Where the staged file ``name`` (a path relative to ``staging``) is published, relative
        to the output location; ``None`` (the default) puts it in the shard's directory."""
        return None

    def listed(self, name: str) -> bool:
        """Whether the shard's ``done`` record lists the file (the default); files written one
        per item say no, and are only counted, so that ``done`` records stay small."""
        return True
