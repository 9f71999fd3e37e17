"""Shard and run results: the JSON ``done`` record of a shard, a shard's status in a run, and the
outcome of a whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

from espnet3_flows.hashing import code_salt, shards_digest
from espnet3_flows.sharding import Shard, ShardPlan, shard_name


@dataclass
class ShardResult:
    """What a finished shard produced; stored as its ``done`` record (JSON), written last.

    Attributes:
        shard: The shard.
        result: The shard's final state, made JSON-able (what ``finalize_state`` returned, less
            its writers, records and directory; see :func:`~.shard_lifecycle.state_summary`).
        files: Files published in the shard's directory, relative to ``output_dir``.
        skipped: Items left out under ``on_error: skip`` (dicts from ``skip_record``).
        cached: True when the shard was not recomputed (a matching ``done`` record or cache hit).
        seconds: Wall time of the computation.
        published_elsewhere: Files the shard published outside its directory (e.g. one per
            utterance), counted, not listed, so that ``done`` records stay small.
        records: How many ``records`` (ESPnet3's default ``write_record``) the shard keeps in its
            ``records.json``; ``None`` when it keeps none.
        records_error: Why the shard's records could not be kept (not JSON-able), else ``None``.
        run_id: The run that computed the shard (a shard a worker finds done by its own run, e.g.
            after the worker that computed it died, is computed, not reused).
        digests: Each of ``files``' size and SHA-256 (and ETag on S3) as published
            (:func:`~espnet3_flows.published_files.publish_recorded`): a shard whose file no longer
            matches is recomputed before a merge reads it. Empty in records written before
            digests were kept (those are trusted as they are).
    """

    shard: Shard
    result: Any
    files: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0
    published_elsewhere: int = 0
    records: int | None = None
    records_error: str | None = None
    run_id: str = ""
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The ``done`` record."""
        d = {"shard_hash": self.shard.hash, "shard": self.shard.to_dict(), "num_items": self.shard.num_items,
             "result": self.result, "files": list(self.files), "skipped": list(self.skipped),
             "seconds": round(self.seconds, 6), "published_elsewhere": self.published_elsewhere,
             "salt": code_salt()}
        if self.records is not None:
            d["records"] = self.records
        if self.records_error is not None:
            d["records_error"] = self.records_error
        if self.run_id:
            d["run"] = self.run_id
        if self.digests:
            d["digests"] = {rel: dict(v) for rel, v in self.digests.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], cached: bool = False) -> ShardResult:
        """Inverse of :meth:`to_dict`."""
        return cls(Shard.from_dict(d["shard"]), d["result"], list(d["files"]), list(d["skipped"]),
                   cached, float(d.get("seconds", 0.0)), int(d.get("published_elsewhere", 0)),
                   d.get("records"), d.get("records_error"), str(d.get("run", "")),
                   {str(rel): dict(v) for rel, v in (d.get("digests") or {}).items()})

    def file(self, name: str, required: bool = True) -> str | None:
        """The published file ``name`` of this shard (its path relative to ``output_dir``, as
        the ``done`` record lists it).

        Raises:
            RuntimeError: ``required`` and the record lists no such file (a record written by
                other code): the shard must be recomputed, and the message says so.
        """
        rel = next((f for f in self.files if f.rsplit("/", 1)[-1] == name), None)
        if rel is None and required:
            raise RuntimeError(f"{self.shard.name}: its done record lists no {name}; rerun to recompute it")
        return rel

    def status(self) -> ShardStatus:
        """The shard's status in a run."""
        return ShardStatus(self.shard.index, self.shard.hash, self.shard.num_items, self.cached, self.seconds)


@dataclass(frozen=True)
class ShardStatus:
    """A shard of a run, as the scheduler knows it: which, how big, reused or computed, how long.

    Attributes:
        index: Position in the plan.
        hash: The shard hash (its directory is ``split.<first 16 hex digits>``).
        num_items: Items in the shard.
        cached: Whether the shard was reused (a ``done`` record of an earlier run) rather than computed.
        seconds: Compute time (of the earlier run for a reused shard).
    """

    index: int
    hash: str
    num_items: int
    cached: bool
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """The shard's directory name."""
        return shard_name(self.hash)

    def to_tuple(self) -> tuple[int, str, int, bool, float]:
        """A compact form for task parameters."""
        return (self.index, self.hash, self.num_items, self.cached, self.seconds)

    @classmethod
    def from_tuple(cls, t: Sequence[Any]) -> ShardStatus:
        """Inverse of :meth:`to_tuple`."""
        return cls(int(t[0]), str(t[1]), int(t[2]), bool(t[3]), float(t[4]))


@dataclass
class RunOutcome:
    """A whole run: the plan, each shard's status, the merged value and timing."""

    plan: ShardPlan
    shards: list[ShardStatus]
    merged: Any
    seconds: float

    @property
    def computed(self) -> int:
        """Shards computed in this run."""
        return sum(not s.cached for s in self.shards)

    @property
    def cached(self) -> int:
        """Shards reused from earlier runs."""
        return sum(s.cached for s in self.shards)


def shard_summary(shards: Sequence[ShardStatus]) -> dict[str, Any]:
    """Shard counts, compute time and the plan digest, for a split's ``summary.json``."""
    return {"shards": len(shards),
            "shards_computed": sum(not s.cached for s in shards),
            "shards_cached": sum(s.cached for s in shards),
            "compute_seconds": float(sum(s.seconds for s in shards if not s.cached)),
            "plan_digest": shards_digest(s.hash for s in shards)}
