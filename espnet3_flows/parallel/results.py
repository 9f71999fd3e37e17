"""Shard and run results: the JSON ``done`` record of a shard, and the outcome of a whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from espnet3_flows.sharding import Shard, ShardPlan, code_salt, shards_digest


@dataclass
class ShardResult:
    """What a finished shard produced; stored as the ``done`` record (JSON).

    Attributes:
        shard: The shard.
        result: The JSON-able value of ``finalize_state``.
        files: Files the shard published, relative to ``output_dir``.
        skipped: Items left out under ``on_error: skip`` (dicts from ``skip_record``).
        cached: True when the shard was not recomputed (a matching ``done`` record or cache hit).
        seconds: Wall time of the computation.
        published_elsewhere: Published files the record does not list (e.g. one per utterance), counted.
    """

    shard: Shard
    result: Any
    files: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    cached: bool = False
    seconds: float = 0.0
    published_elsewhere: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The ``done`` record."""
        return {"shard_hash": self.shard.hash, "shard": self.shard.to_dict(), "num_items": self.shard.num_items,
                "result": self.result, "files": list(self.files), "skipped": list(self.skipped),
                "seconds": round(self.seconds, 6), "published_elsewhere": self.published_elsewhere,
                "salt": code_salt()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], cached: bool = False) -> "ShardResult":
        """Inverse of :meth:`to_dict`."""
        return cls(Shard.from_dict(d["shard"]), d["result"], list(d["files"]), list(d["skipped"]),
                   cached, float(d.get("seconds", 0.0)), int(d.get("published_elsewhere", 0)))


@dataclass
class RunOutcome:
    """A whole run: the plan, each shard's result, the merged value and timing."""

    plan: ShardPlan
    shards: list[ShardResult]
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


def shard_summary(results: list[ShardResult]) -> dict[str, Any]:
    """Shard counts, compute time and the plan digest, for a split's ``summary.json``."""
    return {"shards": len(results),
            "shards_computed": sum(not r.cached for r in results),
            "shards_cached": sum(r.cached for r in results),
            "compute_seconds": float(sum(r.seconds for r in results if not r.cached)),
            "plan_digest": shards_digest(r.shard.hash for r in results)}
