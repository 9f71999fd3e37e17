"""Shard plans: fixed-size, content-addressed chunks of a job's items in input order."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import fsspec

from espnet3_flows import __version__

#: Bump when the on-disk meaning of a shard's outputs changes, so old shards recompute.
FORMAT_VERSION = "1"


def canonical_json(obj: Any) -> str:
    """JSON text that is identical for equal values (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)


def digest(obj: Any) -> str:
    """SHA-256 hex digest of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def code_salt(extra: str = "") -> str:
    """The code-version salt mixed into every shard hash."""
    return f"espnet3_flows={__version__};format={FORMAT_VERSION};{extra}"


def shard_name(index: int) -> str:
    """Directory name of shard ``index`` (ESPnet3's ``split.N``)."""
    return f"split.{index}"


@dataclass(frozen=True)
class Shard:
    """One chunk ``[start, stop)`` of the positions of a job's item list.

    Attributes:
        index: Position of the shard in the plan; names its directory ``split.{index}``.
        start: First item position (inclusive).
        stop: Last item position (exclusive).
        hash: Content hash over the items' keys, the job config and the code salt.
        indices: The job's item indices in this shard (what ``forward`` receives).
    """

    index: int
    start: int
    stop: int
    hash: str
    indices: tuple[int, ...] = field(repr=False, default=())

    @property
    def name(self) -> str:
        """Directory name of the shard, ESPnet3's ``split.N``."""
        return shard_name(self.index)

    @property
    def num_items(self) -> int:
        """Number of items in the shard."""
        return self.stop - self.start

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (indices as a list of ints)."""
        d = asdict(self)
        if list(self.indices) == list(range(self.start, self.stop)):
            del d["indices"]  # the common case; keeps a 300k-item plan small
        else:
            d["indices"] = [int(i) for i in self.indices]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Shard":
        """Inverse of :meth:`to_dict`."""
        start, stop = int(d["start"]), int(d["stop"])
        indices = d.get("indices")
        return cls(int(d["index"]), start, stop, str(d["hash"]),
                   tuple(int(i) for i in indices) if indices is not None else tuple(range(start, stop)))


@dataclass(frozen=True)
class ShardPlan:
    """The shards of one job over one item list.

    Attributes:
        shards: The shards in item order.
        shard_size: Items per shard (the last shard may be smaller).
        config_hash: Digest of the job config that affects outputs.
        salt: Code-version salt.
    """

    shards: tuple[Shard, ...]
    shard_size: int
    config_hash: str
    salt: str

    @property
    def num_items(self) -> int:
        """Total number of items."""
        return self.shards[-1].stop if self.shards else 0

    @property
    def digest(self) -> str:
        """Digest of the shard hashes: equal digests mean equal merged outputs."""
        return shards_digest(s.hash for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict that round-trips through :meth:`from_dict`."""
        return {
            "shard_size": self.shard_size,
            "config_hash": self.config_hash,
            "salt": self.salt,
            "num_items": self.num_items,
            "shards": [s.to_dict() for s in self.shards],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ShardPlan":
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(Shard.from_dict(s) for s in d["shards"]), int(d["shard_size"]),
                   str(d["config_hash"]), str(d["salt"]))


def shards_digest(hashes: Iterable[str]) -> str:
    """Digest of an ordered list of shard hashes."""
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def plan_shards(
    item_keys: Sequence[str],
    shard_size: int,
    config: Mapping[str, Any] | None = None,
    salt: str | None = None,
    indices: Sequence[int] | None = None,
) -> ShardPlan:
    """Cut items into fixed-size shards in input order and hash each one.

    A shard's hash covers its items' keys (identity plus fingerprint), the job config and
    the code salt, but not its position: appending items leaves earlier full shards'
    hashes unchanged, and the worker count never changes the plan.

    Args:
        item_keys: One string per item, e.g. ``"utt1\\t/data/a.wav\\t32044:1700000000"``.
        shard_size: Items per shard (>= 1).
        config: The job config that affects outputs.
        salt: Code-version salt; :func:`code_salt` by default.
        indices: The item indices ``forward`` will receive; ``range(len(item_keys))`` by default.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    idx = list(range(len(item_keys))) if indices is None else [int(i) for i in indices]
    if len(idx) != len(item_keys):
        raise ValueError("indices and item_keys must have the same length")
    salt = code_salt() if salt is None else salt
    config_hash = digest(config or {})
    shards = []
    for n, start in enumerate(range(0, len(item_keys), shard_size)):
        stop = min(start + shard_size, len(item_keys))
        h = hashlib.sha256()
        h.update(salt.encode())
        h.update(b"\0")
        h.update(config_hash.encode())
        for key in item_keys[start:stop]:
            h.update(b"\0")
            h.update(key.encode("utf-8", "surrogatepass"))
        shards.append(Shard(n, start, stop, h.hexdigest(), tuple(idx[start:stop])))
    return ShardPlan(tuple(shards), shard_size, config_hash, salt)


def fingerprint_files(paths: Iterable[str], storage_options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Cheap content fingerprints of input files: size and mtime, or the ETag on object stores.

    Remote files are grouped by parent directory and each directory is listed once, so a
    300,000-file manifest costs a few listings, not one request per file. Local files get one
    ``stat`` each (what a listing costs per entry anyway, without stat-ing the directory's other
    files). A missing file has the fingerprint ``"missing"`` (the job reports it when it reads
    the file).
    """
    by_dir: dict[tuple[str, str], list[str]] = defaultdict(list)
    out: dict[str, str] = {}
    for p in set(paths):
        protocol = fsspec.core.split_protocol(p)[0] or "file"
        if protocol == "file":
            entry = _local_entry(p)
            out[p] = _entry_fingerprint(entry) if entry else "missing"
        else:
            by_dir[(protocol, posixpath.dirname(p))].append(p)
    fs_cache: dict[str, Any] = {}
    for (protocol, parent), members in by_dir.items():
        if protocol not in fs_cache:
            fs_cache[protocol] = fsspec.filesystem(protocol, **(storage_options or {}))
        fs = fs_cache[protocol]
        try:
            listing = {fs._strip_protocol(e["name"]).rstrip("/"): e for e in fs.ls(parent, detail=True)}
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            listing = {}
        for p in members:
            entry = listing.get(fs._strip_protocol(p).rstrip("/"))
            out[p] = _entry_fingerprint(entry) if entry else "missing"
    return out


def _local_entry(p: str) -> dict[str, Any] | None:
    """``{size, mtime}`` of a local file (the fields of fsspec's local ``info``, so fingerprints
    are unchanged); ``None`` if it is missing."""
    try:
        st = os.stat(fsspec.core.strip_protocol(p))  # follows symlinks, as fsspec's info does
    except (OSError, ValueError):
        return None
    return {"size": st.st_size, "mtime": st.st_mtime}


def _entry_fingerprint(entry: Mapping[str, Any]) -> str:
    etag = entry.get("ETag") or entry.get("etag")
    size = entry.get("size")
    if etag:
        return f"{size}:{str(etag).strip(chr(34))}"
    mtime = entry.get("mtime") or entry.get("LastModified") or entry.get("created")
    return f"{size}:{mtime}"
