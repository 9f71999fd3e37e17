"""A runner's ``done`` records: whether a shard is done (its marker, its shard hash), reading
them for resume and planning (concurrently, an unreadable one named once and computed again),
and holding them for the block a ``merge`` runs in (:meth:`ShardRecords.merging`). A mixin of
:class:`~espnet3_flows.parallel.base_runner.BaseRunner`, which gives it ``storage``,
``shard_subdir``, ``shard_location``, ``storage_options``, ``resume`` and ``on_error``.

``on_error`` is not part of a shard's hash: it changes no output of a shard without a bad item.
A shard done under ``skip`` that left items out is not done for a run under ``fail`` (it is
computed again and fails on its bad item); every other done shard is reused under either."""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

import fsspec

from espnet3_flows.errors import clip
from espnet3_flows.parallel.results import ShardResult, ShardStatus
from espnet3_flows.parallel.shard_lifecycle import DONE, RECORDS
from espnet3_flows.sharding import Shard, ShardPlan, shard_name

_LOG = logging.getLogger("espnet3_flows.parallel.base_runner")  # (where these warnings always came from)
#: ``done`` records this process has warned about (each is named once)
_UNREADABLE_WARNED: set[str] = set()


def is_local_url(url: str) -> bool:
    """Whether ``url`` is a local path (no protocol, or ``file://``)."""
    return fsspec.utils.get_protocol(url) in ("file", "local")


class ShardRecords:
    """The ``done``-record half of a runner (see the module's docstring)."""

    _done_memo: dict[str, ShardResult]
    run_shards: list[ShardStatus]
    on_error: str

    @classmethod
    def is_shard_done(cls, shard_dir: Path | str) -> bool:
        """Whether ``shard_dir`` holds a ``done`` marker (the engine also checks its shard hash)."""
        text = str(shard_dir)
        if is_local_url(text):
            return (Path(fsspec.core.strip_protocol(text)) / DONE).exists()
        fs, path = fsspec.core.url_to_fs(text)
        return bool(fs.exists(posixpath.join(path, DONE)))

    def load_done(self, shard: Shard) -> ShardResult | None:
        """The shard's ``done`` record if resuming and it matches the current shard hash (and,
        under ``on_error: fail``, left no item out)."""
        if not self.resume:
            return None
        found = self.read_done(shard.hash, cached=True)
        if found is not None and found.skipped and self.on_error == "fail":
            return None  # done under skip: a fail run computes it again and stops on its bad item
        overridden = type(self).is_shard_done.__func__ is not ShardRecords.is_shard_done.__func__
        if found is not None and overridden and not type(self).is_shard_done(self.shard_location(shard)):
            return None  # the runner's own condition too
        return found

    def read_done(self, shard_hash: str, cached: bool = False) -> ShardResult | None:
        """The ``done`` record of the shard with ``shard_hash``, if one exists (resume or not). A
        record that cannot be read (truncated, empty, not JSON) means "not done": a warning names
        it, and the shard is computed again. A store that cannot be reached raises."""
        store = self.storage
        if store is None:
            return None
        rel = posixpath.join(self.shard_subdir, shard_name(shard_hash), DONE)
        try:
            rec = store.read_json(rel)
            if not rec or rec.get("shard_hash") != shard_hash:
                return None
            return ShardResult.from_dict(rec, cached=cached)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # truncated, empty, not ours
            uri = store.uri(rel)
            if uri not in _UNREADABLE_WARNED:  # planning reads it, then the shard's task again
                _UNREADABLE_WARNED.add(uri)
                _LOG.warning("%s is unreadable (%s): the shard is not done and is computed again", uri,
                             clip(f"{type(exc).__name__}: {exc}"))
            return None

    @contextlib.contextmanager
    def merging(self, statuses: Sequence[ShardStatus], records: Sequence[ShardResult]) -> Iterator[None]:
        """The block a ``merge`` runs in: ``run_shards`` holds the shards' statuses and
        :meth:`done_record` / :meth:`read_records` answer from their ``records`` (read once,
        by the merge step), forgotten after it."""
        self.run_shards = list(statuses)
        self._done_memo = {status.name: rec for status, rec in zip(statuses, records, strict=True)}
        try:
            yield
        finally:
            self._done_memo = {}

    def done_record(self, shard_dir: Path | str) -> ShardResult:
        """The ``done`` record of a completed shard directory (one ``merge`` received)."""
        name = posixpath.basename(str(shard_dir).rstrip("/"))
        found = self._done_memo.get(name)
        if found is None:
            raise LookupError(f"{shard_dir} is not a completed shard of this run")
        return found

    def read_records(self, shard_dir: Path | str) -> list[Any]:
        """The ``records`` a shard kept (ESPnet3's default ``write_record``), in order."""
        rec = self._done_memo.get(posixpath.basename(str(shard_dir).rstrip("/")))
        if rec is not None and rec.records_error:
            raise TypeError(f"{shard_dir}: the shard's records could not be kept ({rec.records_error}); "
                            "write them with writers (open_writers / write_record) and read them in merge")
        if isinstance(shard_dir, Path):
            path = shard_dir / RECORDS
            return json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        fs, root = fsspec.core.url_to_fs(str(shard_dir), **self.storage_options)
        path = posixpath.join(root, RECORDS)
        return json.loads(fs.cat_file(path).decode("utf-8")) if fs.exists(path) else []

    def collect_done(self, plan: ShardPlan) -> dict[int, ShardResult]:
        """``done`` records of the plan's shards that match (read concurrently)."""
        if self.storage is None or not self.resume:
            return {}
        with ThreadPoolExecutor(max_workers=16) as pool:
            found = list(pool.map(self.load_done, plan.shards))
        return {s.index: r for s, r in zip(plan.shards, found, strict=True) if r is not None}
