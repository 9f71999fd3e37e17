"""Input file fingerprints (size and mtime, or the object store's ETag), at the speed of the storage.

``strict`` adds a local file's ctime and inode number (the same ``stat`` call): a file replaced by
other content of the same size with its mtime restored (``cp -p``, ``rsync -t``, an archive whose
files all carry one fixed mtime) is seen, as no tool can set a ctime. It is not the default: a
changed fingerprint changes its shard's hash, so upgrading would recompute every corpus computed
under ``stat``, and a ``chmod``/``chown``, a new hard link, a restore or a remount that renumbers
inodes (FUSE mounts of object stores) would recompute unchanged files.

Local files are stat-ed by a bounded thread pool (a cold NFS/Lustre stat takes 0.1-1 ms, so
one at a time would take hours on 10 M files). Object stores are listed, several requests at
once, into a bounded cache of the listings' fingerprints. On S3 the parents a batch of paths
needs are read as a few ordered key streams (``list_objects_v2`` pages of 1,000 keys, jumping
over key ranges no wanted parent holds) rather than one delimiter listing per parent: a corpus
of 100 files per directory costs ~10x fewer requests, and no key outside the wanted
directories' ranges is fetched except at the edges of a page. Other stores list each parent.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
import posixpath
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from collections.abc import Mapping, Sequence

import fsspec

from espnet3_flows.deadlines import with_deadlines
from espnet3_flows.inputs.settings import FINGERPRINT_MODES

MISSING = "missing"
_CHUNK = 256
_PROBE = 64
_SLOW_STAT_S = 20e-6


def _local_path(p: str) -> str:
    return p[len("file://"):] if p.startswith("file://") else p


def _print(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}"


def _strict_print(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def _stat_chunk(paths: Sequence[str], strict: bool = False) -> list[str]:
    stat = os.stat  # follows symlinks, as fsspec's info does
    fingerprint = _strict_print if strict else _print
    try:
        return [fingerprint(st) for st in map(stat, paths)]
    except (OSError, ValueError):
        pass  # a missing (or unstat-able) file in this chunk: one at a time
    out = []
    for p in paths:
        try:
            st = stat(_local_path(p))
        except (OSError, ValueError):
            out.append(MISSING)
            continue
        out.append(fingerprint(st))
    return out


def entry_fingerprint(entry: Mapping[str, Any]) -> str:
    """The fingerprint of an fsspec listing entry: ``size:etag`` or ``size:mtime``."""
    etag = entry.get("ETag") or entry.get("etag")
    size = entry.get("size")
    if etag:
        return f"{size}:{str(etag).strip(chr(34))}"
    mtime = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
    return f"{size}:{mtime}"


class Fingerprinter:
    """Fingerprints batches of input paths; one instance serves a whole planning pass.

    Args:
        mode: ``stat`` (default), ``strict`` (local files' ctime and inode number too) or
            ``manifest`` (no file system access: every fingerprint is empty, so a shard's hash
            covers only its manifest lines).
        storage_options: fsspec options for remote inputs.
        threads: Concurrent stats or listings.
        cache_entries: Most listing entries kept for object stores (least recently used
            prefixes are dropped first).
    """

    def __init__(self, mode: str = "stat", storage_options: Mapping[str, Any] | None = None, threads: int = 8,
                 cache_entries: int = 200_000):
        if mode not in FINGERPRINT_MODES:
            raise ValueError(f"fingerprint must be one of {FINGERPRINT_MODES}, got {mode!r}")
        self.mode = mode
        self.storage_options = dict(storage_options or {})
        self.threads = max(1, threads)
        self.cache_entries = cache_entries
        self._pool: ThreadPoolExecutor | None = None
        self._fs: dict[str, Any] = {}
        self._listings: OrderedDict[tuple[str, str], dict[str, str]] = OrderedDict()
        self._cached = 0
        self._slow_stat = False

    def __enter__(self) -> Fingerprinter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread pool and drop the listing cache."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._listings.clear()
        self._cached = 0

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="espnet3-fingerprint")
        return self._pool

    def fingerprints(self, paths: Sequence[str]) -> list[str]:
        """One fingerprint per path, in order (``"missing"`` for a file that does not exist)."""
        if self.mode == "manifest":
            return [""] * len(paths)
        remote = [i for i, p in enumerate(paths) if "://" in p]
        if not remote:
            return self._local(paths)
        remote = [i for i in remote if not paths[i].startswith("file://")]
        out = [""] * len(paths)
        remote_set = set(remote)
        local_idx = [i for i in range(len(paths)) if i not in remote_set]
        for i, fp in zip(local_idx, self._local([paths[i] for i in local_idx]), strict=True):
            out[i] = fp
        for i, fp in zip(remote, self._remote([paths[i] for i in remote]), strict=True):
            out[i] = fp
        return out

    def _local(self, paths: Sequence[str]) -> list[str]:
        stat_chunk = functools.partial(_stat_chunk, strict=self.mode == "strict")
        if not self._slow_stat and len(paths) > _PROBE:
            # a warm local stat (~2 us) is cheaper than handing work to threads; a network file
            # system's (0.1-1 ms) is not: probe, then go concurrent for good when stats are slow
            t0 = time.perf_counter()
            head = stat_chunk(paths[:_PROBE])
            self._slow_stat = (time.perf_counter() - t0) / _PROBE > _SLOW_STAT_S
            return head + self._local(paths[_PROBE:])
        if not self._slow_stat or self.threads == 1 or len(paths) <= _CHUNK:
            return stat_chunk(paths)
        chunks = [paths[i:i + _CHUNK] for i in range(0, len(paths), _CHUNK)]
        return [fp for part in self._executor().map(stat_chunk, chunks) for fp in part]

    def _filesystem(self, protocol: str) -> Any:
        if protocol not in self._fs:
            # no listings cache of fsspec's own: it would keep every entry for the life of the process
            self._fs[protocol] = fsspec.filesystem(protocol, use_listings_cache=False, skip_instance_cache=True,
                                                   **with_deadlines(self.storage_options, f"{protocol}://"))
        return self._fs[protocol]

    def _list(self, key: tuple[str, str]) -> dict[str, str]:
        protocol, parent = key
        fs = self._filesystem(protocol)
        try:
            entries = fs.ls(parent, detail=True)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return {}
        return {fs._strip_protocol(e["name"]).rstrip("/"): entry_fingerprint(e)
                for e in entries if e.get("type", "file") != "directory"}

    def _list_many(self, wanted: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, str]]:
        """Listings of the ``wanted`` parents: S3 buckets as grouped key streams, others one by one."""
        jobs: list[tuple[Any, ...]] = []
        by_bucket: dict[tuple[str, str], list[str]] = {}
        for key in wanted:
            protocol, parent = key
            bucket, _, prefix = parent.partition("/")
            if protocol in ("s3", "s3a") and prefix and hasattr(self._filesystem(protocol), "call_s3"):
                by_bucket.setdefault((protocol, bucket), []).append(prefix)
            else:
                jobs.append((self._list, key))
        for (protocol, bucket), prefixes in by_bucket.items():
            for group in _stream_groups(sorted(p + "/" for p in prefixes), self.threads):
                jobs.append((self._stream_s3, protocol, bucket, group))
        out: dict[tuple[str, str], dict[str, str]] = {}

        def run(job: tuple[Any, ...]) -> dict[tuple[str, str], dict[str, str]]:
            fn, *args = job
            return {args[0]: fn(args[0])} if fn == self._list else fn(*args)

        parts = self._executor().map(run, jobs) if len(jobs) > 1 else map(run, jobs)
        for part in parts:
            out.update(part)
        return out

    def _stream_s3(self, protocol: str, bucket: str, ranges: list[str]) -> dict[tuple[str, str], dict[str, str]]:
        """The files directly in each of ``ranges`` (sorted ``parent/`` key prefixes of one bucket),
        read as ordered ``list_objects_v2`` pages that jump over keys of no wanted parent."""
        fs = self._filesystem(protocol)
        wanted = set(ranges)
        listings: dict[str, dict[str, str]] = {r: {} for r in ranges}
        common = os.path.commonprefix(ranges)
        start_after = ranges[0]  # keys of a parent sort after "parent/" (a directory marker itself)
        while True:
            try:
                page = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=common, StartAfter=start_after,
                                  MaxKeys=1000)
            except (FileNotFoundError, PermissionError):
                break
            contents = page.get("Contents") or []
            for obj in contents:
                name = obj["Key"]
                parent = name[:name.rfind("/") + 1]
                if parent in wanted and name != parent:
                    listings[parent][f"{bucket}/{name}"] = entry_fingerprint({"size": obj.get("Size"),
                                                                              "ETag": obj.get("ETag")})
            if not contents or not page.get("IsTruncated"):
                break
            last = contents[-1]["Key"]
            i = bisect.bisect_right(ranges, last)
            if any(last[:k + 1] in wanted for k in range(len(last)) if last[k] == "/"):
                start_after = last  # inside a wanted parent's keys: the next page
            elif i < len(ranges):
                start_after = ranges[i]  # in a gap: jump to the next wanted parent
            else:
                break  # past the last wanted parent
        return {(protocol, f"{bucket}/{r[:-1]}"): listing for r, listing in listings.items()}

    def _remote(self, paths: Sequence[str]) -> list[str]:
        keys = []
        for p in paths:
            protocol = fsspec.core.split_protocol(p)[0] or "file"
            keys.append((protocol, posixpath.dirname(fsspec.core.strip_protocol(p)).rstrip("/")))
        wanted = [k for k in dict.fromkeys(keys) if k not in self._listings]
        if wanted:
            for k, listing in self._list_many(wanted).items():
                self._remember(k, listing)
        out = []
        for p, k in zip(paths, keys, strict=True):
            listing = self._listings.get(k)
            if listing is None:  # evicted by this very batch: list it again
                listing = self._list(k)
                self._remember(k, listing)
            self._listings.move_to_end(k)
            out.append(listing.get(fsspec.core.strip_protocol(p).rstrip("/"), MISSING))
        return out

    def _remember(self, key: tuple[str, str], listing: dict[str, str]) -> None:
        self._listings[key] = listing
        self._cached += len(listing)
        while self._cached > self.cache_entries and len(self._listings) > 1:
            _, dropped = self._listings.popitem(last=False)
            self._cached -= len(dropped)


def _stream_groups(ranges: list[str], threads: int, min_group: int = 16) -> list[list[str]]:
    """Sorted key prefixes cut into at most ``threads`` consecutive groups of at least ``min_group``
    (one ordered key stream each: fewer, fuller pages than one stream per prefix)."""
    n = max(1, min(threads, math.ceil(len(ranges) / min_group)))
    size = math.ceil(len(ranges) / n)
    return [ranges[i:i + size] for i in range(0, len(ranges), size)]


def fingerprint_files(paths: Sequence[str], storage_options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Fingerprints of a few files by path (``"missing"`` when absent); see :class:`Fingerprinter`."""
    unique = list(dict.fromkeys(paths))
    with Fingerprinter("stat", storage_options) as fp:
        return dict(zip(unique, fp.fingerprints(unique), strict=True))
