"""A run's last step: the completed shard directories, in plan order, handed to the runner's
``merge`` — as local directories for a local output, as local copies (with ``output_dir`` a local
directory published afterwards) for a remote one, or as URLs for runners that read remote
shard directories themselves."""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from espnet3_flows.confinement import confine
from espnet3_flows.errors import ShardFailure
from espnet3_flows.parallel.results import ShardResult, ShardStatus
from espnet3_flows.parallel.shard_lifecycle import DONE
from espnet3_flows.storage import Storage

#: Files downloaded or published at once around a remote merge
_IO_THREADS = 16


def read_done_records(runner: Any, statuses: Sequence[ShardStatus]) -> list[ShardResult]:
    """The ``done`` records of ``statuses``' shards, read 16 at a time.

    Raises:
        ShardFailure: naming a shard whose record is missing (removed while the run was merging?).
    """
    def read(status: ShardStatus) -> ShardResult:
        found = runner.read_done(status.hash, status.cached)
        if found is None:
            raise ShardFailure(f"{runner.shard_rel(status)} (shard {status.index} of the plan): no done record "
                               "(removed while the run was merging?); rerun to recompute it")
        return found

    with ThreadPoolExecutor(_IO_THREADS) as pool:
        return list(pool.map(read, statuses))


def merge_runner(runner: Any, statuses: Sequence[ShardStatus]) -> Any:
    """Check that every shard of the run is done, then call ``runner.merge(shard_dirs)``.

    During ``merge``, ``runner.run_shards`` holds the shards' statuses and
    ``runner.done_record(shard_dir)`` their ``done`` records.

    Args:
        runner: The runner.
        statuses: Every shard of the plan, in plan order.

    Returns:
        What ``merge`` returned (paths it returns inside local copies of a remote output are
        turned into the published files' URLs).
    """
    store = runner.storage
    assert store is not None, "a merge runs with an output location"
    records = read_done_records(runner, statuses)
    with runner.merging(statuses, records):
        if store.is_local:
            return runner.merge([Path(store.path(runner.shard_rel(s))) for s in statuses])
        if not runner.download_shards_for_merge:
            return runner.merge([store.uri(runner.shard_rel(s)) for s in statuses])
        return _merge_local_copies(runner, store, statuses, records)


def _merge_local_copies(runner: Any, store: Storage, statuses: Sequence[ShardStatus],
                        records: Sequence[ShardResult]) -> Any:
    """``merge`` over local copies of the shard directories of a remote output, with
    ``output_dir`` a local mirror; then every file it wrote there is published to the same place
    under the remote output."""
    mirror = Path(tempfile.mkdtemp(prefix="espnet3-merge-"))
    try:
        fetched: set[str] = set()
        wanted = [rel for rec in records for rel in rec.files]
        with ThreadPoolExecutor(_IO_THREADS) as pool:
            list(pool.map(lambda rel: _fetch(store, rel, mirror), wanted))
        fetched.update(wanted)
        for status, rec in zip(statuses, records, strict=True):  # the done marker, as ESPnet3's merge may look for it
            done = runner.shard_rel(status, DONE)
            (mirror / done).parent.mkdir(parents=True, exist_ok=True)
            (mirror / done).write_text(_json(rec.to_dict()), encoding="utf-8")
            fetched.add(done)
        remote = runner.output_dir
        runner.output_dir = mirror
        try:
            merged = runner.merge([mirror / runner.shard_rel(s) for s in statuses])
        finally:
            runner.output_dir = remote
        written = sorted(rel for rel in (p.relative_to(mirror).as_posix() for p in mirror.rglob("*") if p.is_file())
                         if rel not in fetched)
        with ThreadPoolExecutor(_IO_THREADS) as pool:
            list(pool.map(lambda rel: store.publish_file(mirror / rel, rel), written))
        return _relocated(merged, mirror, store)
    finally:
        shutil.rmtree(mirror, ignore_errors=True)


def _fetch(store: Storage, rel: str, mirror: Path) -> None:
    """Download the published file ``rel`` (a name from a ``done`` record) into ``mirror``; a name
    that leads out of ``mirror`` is refused (:func:`~espnet3_flows.confinement.confine`)."""
    dest = Path(confine(str(mirror), posixpath.join(str(mirror), rel)))
    dest.parent.mkdir(parents=True, exist_ok=True)
    store.get_file(rel, dest)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _relocated(obj: Any, mirror: Path, store: Storage) -> Any:
    """``obj`` with every path inside ``mirror`` replaced by the published file's URL."""
    if isinstance(obj, Path) or (isinstance(obj, str) and obj.startswith(str(mirror) + os.sep)):
        try:
            return store.uri(Path(obj).relative_to(mirror).as_posix())
        except ValueError:
            return obj
    if isinstance(obj, dict):
        return {k: _relocated(v, mirror, store) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_relocated(v, mirror, store) for v in obj)
    return obj
