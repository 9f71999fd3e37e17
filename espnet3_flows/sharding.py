"""Shard plans: content-defined, content-addressed chunks of a job's items in input order.

A shard boundary falls after an item whose identity hash meets a condition (with bounded
minimum and maximum sizes around ``shard_size``), so inserting or deleting items changes only
the shards that contain them (and rarely a neighbour): a sorted Kaldi/ESPnet data directory
that grows in the middle keeps every other shard and its outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

from espnet3_flows.errors import clip
from espnet3_flows.hashing import add_item, code_salt, config_digest, id_hash64, shard_hasher, shards_digest

def shard_name(shard_hash: str) -> str:
    """Directory name of a shard: ``split.`` and the first 16 hex digits of its hash.

    Named by content, not by position: content-defined boundaries let an insertion shift the
    positions of every later shard, and a shard must find its ``done`` record wherever it now is.
    """
    return f"split.{shard_hash[:16]}"


def shard_size_bounds(shard_size: int) -> tuple[int, int, int]:
    """``(minimum, maximum, period)`` of content-defined shards averaging ``shard_size`` items.

    After ``minimum`` items, a shard ends after each item whose identity hash is divisible by
    ``period`` (a geometric wait with mean ``period``), and at ``maximum`` items regardless.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    lo = (shard_size + 1) // 2
    return lo, 2 * shard_size, shard_size - lo + 1


#: The fewest items of a shard (but a split's last) when a small split is cut finer for busy
#: workers: below it a shard's own costs (a task, its resources lookup, a ``done`` record, the publish)
#: outweigh what another worker gains, and a smoke test of a few items still runs as one shard, in
#: this process (``parallel.options.inline_shards``). Content-defined shards hold at least half their
#: mean, so such a cut's mean is at least twice this.
MIN_BUSY_SHARD = 4


def split_shard_size(shard_size: int, num_items: int, workers: int) -> int:
    """The mean shard size a split of ``num_items`` is cut with when ``workers`` shards run at once.

    A large split (``num_items >= 2 * workers * shard_size``) keeps ``shard_size``: its shards are
    the same whatever the cluster's size, so scaling a cluster up or down recomputes nothing. A
    smaller one would leave workers idle (100 GPU-heavy items in one shard of 256 run on one of 8
    GPUs), so it is cut finer: the largest power of two at most ``num_items / (2 * workers)``,
    about 2 to 4 shards per worker, but never a mean under ``2 * MIN_BUSY_SHARD``, so that
    every shard but the split's last holds at least :data:`MIN_BUSY_SHARD` items (where the two
    rules meet, fewer shards per worker). Powers of two keep a small split that grows by a few
    items on its old cut, so a nightly rerun still reuses its shards. ``workers <= 1`` (a run in
    this process) keeps ``shard_size``.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if workers <= 1 or num_items >= 2 * workers * shard_size:
        return shard_size
    target = max(2 * MIN_BUSY_SHARD, num_items // (2 * workers))
    return min(shard_size, 1 << (target.bit_length() - 1))


@dataclass(frozen=True)
class Shard:
    """One chunk of a job's items: positions ``[start, stop)`` of the plan.

    Attributes:
        index: Position of the shard in the plan (its directory is named by its hash).
        start: First item position (inclusive).
        stop: Last item position (exclusive).
        hash: Content hash over the items' keys, the job config and the code salt.
        source: Where a worker reads this shard's items (JSON-able, job-defined: e.g. a byte
            range of a manifest); ``None`` when items are plain indices.
        indices: The items ``forward`` receives (ints or strings) when they are not ``range(start, stop)``.
    """

    index: int
    start: int
    stop: int
    hash: str
    source: Mapping[str, Any] | None = field(default=None, repr=False, compare=False, hash=False)
    indices: tuple[Any, ...] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """Directory name of the shard (see :func:`shard_name`)."""
        return shard_name(self.hash)

    @property
    def num_items(self) -> int:
        """Number of items in the shard."""
        return self.stop - self.start

    @property
    def items(self) -> Sequence[Any]:
        """The item indices of this shard, in order."""
        return self.indices if self.indices is not None else range(self.start, self.stop)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        d: dict[str, Any] = {"index": self.index, "start": self.start, "stop": self.stop, "hash": self.hash}
        if self.source is not None:
            d["source"] = dict(self.source)
        if self.indices is not None:
            d["indices"] = list(self.indices)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Shard:
        """Inverse of :meth:`to_dict`."""
        indices = d.get("indices")
        return cls(int(d["index"]), int(d["start"]), int(d["stop"]), str(d["hash"]), d.get("source"),
                   tuple(indices) if indices is not None else None)


@dataclass(frozen=True)
class ShardPlan:
    """The shards of one job over one item list.

    Attributes:
        shards: The shards in item order.
        shard_size: Mean items per shard (content-defined: between about half and twice that).
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
    def from_dict(cls, d: Mapping[str, Any]) -> ShardPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(Shard.from_dict(s) for s in d["shards"]), int(d["shard_size"]),
                   str(d["config_hash"]), str(d["salt"]))


class ShardCutter:
    """Streams items into content-defined shards and hashes each one.

    Feed items in order with :meth:`add`; it returns ``True`` when the item closes a shard,
    whose hash :meth:`close` then returns. A shard's hash covers its items' keys, the job
    config and the code salt, never its position, so unchanged shards keep their hash.

    Args:
        shard_size: Mean items per shard (see :func:`shard_size_bounds`).
        config_hash: Digest of the job config that affects outputs.
        salt: Code-version salt.
    """

    def __init__(self, shard_size: int, config_hash: str, salt: str):
        self.min_items, self.max_items, self.period = shard_size_bounds(shard_size)
        self._salt, self._config_hash = salt, config_hash
        self._hash = shard_hasher(salt, config_hash)
        self.count = 0

    def add(self, cut_hash: int, key: str | bytes) -> bool:
        """Add one item (its identity hash and its key); ``True`` when the shard ends after it."""
        add_item(self._hash, key)
        self.count += 1
        return self.count >= self.max_items or (self.count >= self.min_items and cut_hash % self.period == 0)

    def close(self) -> tuple[str, int]:
        """End the current shard: its hash and item count (the cutter starts a new shard)."""
        out = (self._hash.hexdigest(), self.count)
        self._hash = shard_hasher(self._salt, self._config_hash)
        self.count = 0
        return out


def plan_shards(
    item_keys: Sequence[str],
    shard_size: int,
    config: Mapping[str, Any] | None = None,
    salt: str | None = None,
    indices: Sequence[Any] | None = None,
    cut_keys: Sequence[str] | None = None,
) -> ShardPlan:
    """Cut items into content-defined shards in input order and hash each one.

    Args:
        item_keys: One string per item, e.g. ``"utt1\\t/data/a.wav\\t32044:1700000000"``.
        shard_size: Mean items per shard (>= 1).
        config: The job config that affects outputs.
        salt: Code-version salt; :func:`code_salt` by default.
        indices: The items ``forward`` will receive (ints or strings); ``range(len(item_keys))`` by default.
        cut_keys: Item identities that decide boundaries (e.g. utterance ids); the item keys
            by default.
    """
    salt = code_salt() if salt is None else salt
    config_hash = config_digest(config)
    cutter = ShardCutter(shard_size, config_hash, salt)
    idx = None if indices is None else tuple(int(i) if hasattr(i, "__index__") else i for i in indices)
    if idx is not None and len(idx) != len(item_keys):
        raise ValueError("indices and item_keys must have the same length")
    if cut_keys is not None and len(cut_keys) != len(item_keys):
        raise ValueError("cut_keys and item_keys must have the same length")
    contiguous = idx is None or idx == tuple(range(len(idx)))
    shards: list[Shard] = []
    start = 0
    for pos, key in enumerate(item_keys):
        if cutter.add(id_hash64(cut_keys[pos] if cut_keys is not None else key), key) or pos == len(item_keys) - 1:
            h, n = cutter.close()
            stop = start + n
            shards.append(Shard(len(shards), start, stop, h, None,
                                None if contiguous else idx[start:stop]))  # type: ignore[index]
            start = stop
    return ShardPlan(tuple(shards), shard_size, config_hash, salt)


def plan_item(item: Any, pos: int) -> Any:
    """An item of ``runner(indices)`` as the plan keeps it (``pos``: its position, for the error): as given when it is JSON data (an ``int``, a ``str``, or a
    list, tuple or dict of them, as ESPnet3's collect-stats runner passes pre-batched index lists),
    numpy integers as ``int``s."""
    try:
        return _json_item(item)
    except TypeError as exc:
        raise TypeError(f"item {pos} ({clip(repr(item))}) {exc}: items are hashed into shards and stored in the plan "
                        "as JSON (ints, strs, finite floats, and lists, tuples or str-keyed dicts of them)") from None


def _json_item(item: Any) -> Any:
    if isinstance(item, (str, bool)) or item is None or (isinstance(item, int) and not isinstance(item, bool)):
        return item
    if isinstance(item, float):
        if math.isfinite(item):
            return item
        raise TypeError("is not a finite number")
    if hasattr(item, "__index__"):
        return int(item.__index__())
    if isinstance(item, (list, tuple)):
        return type(item)(_json_item(i) for i in item)
    if isinstance(item, Mapping):
        if not all(isinstance(k, str) for k in item):
            raise TypeError("has a key that is not a str")
        return {k: _json_item(v) for k, v in item.items()}
    raise TypeError(f"is a {type(item).__name__}")
