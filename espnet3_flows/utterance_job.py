"""Shared parts of per-utterance jobs: planning from a manifest, a shard's utterances, skips, checks."""

from __future__ import annotations

import posixpath
from collections import Counter
from typing import Any, Mapping, Sequence

from espnet3_flows.audio import RecordingCache, recording_key
from espnet3_flows.config import ConfigError
from espnet3_flows.fingerprints import FINGERPRINT_MODES
from espnet3_flows.manifest import ON_ERROR_POLICIES, SkippedItem, Utterance, read_manifest_slice
from espnet3_flows.manifest_plan import plan_manifest
from espnet3_flows.parallel.provider import EnvironmentProvider
from espnet3_flows.parallel.runner import BaseRunner
from espnet3_flows.sharding import Shard, ShardPlan

_SPLIT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_common(on_error: str, shard_size: int, batch_size: int, manifests: Mapping[str, str],
                 fingerprint: str = "stat", pipe_timeout: float = 600.0) -> None:
    """Checks shared by the jobs' configs (raise :class:`ConfigError`)."""
    if not pipe_timeout > 0:
        raise ConfigError(f"pipe_timeout must be a positive number of seconds, got {pipe_timeout}")
    if on_error not in ON_ERROR_POLICIES:
        raise ConfigError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
    if shard_size < 1:
        raise ConfigError(f"shard_size must be >= 1, got {shard_size}")
    if batch_size < 0:
        raise ConfigError(f"batch_size must be >= 0, got {batch_size}")
    if fingerprint not in FINGERPRINT_MODES:
        raise ConfigError(f"fingerprint must be one of {FINGERPRINT_MODES}, got {fingerprint!r}")
    for split in manifests:
        if not split or set(split) - _SPLIT_CHARS or split.startswith((".", "-")):
            raise ConfigError(f"split name {split!r} must be letters, digits, '_', '-' or '.'")


class ShardDataset:
    """One shard's utterances, indexed by their positions in the split (what ``forward`` receives).

    Attributes:
        audio_cache: The shard's :class:`~espnet3_flows.audio.RecordingCache`: pass it to
            :func:`~espnet3_flows.audio.load_audio` so that segments of one recording decode it once.
    """

    def __init__(self, split: str, utts: list[Utterance], start: int, cwd: str = ""):
        self.split = split
        self.utts = utts
        self.start = start
        uses = Counter(recording_key(u) for u in utts if u.recording)
        self.audio_cache = RecordingCache(uses, cwd)

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, idx: int) -> Utterance:
        pos = idx - self.start
        if not 0 <= pos < len(self.utts):
            raise IndexError(f"item {idx} is not in this shard ({self.start}..{self.start + len(self.utts) - 1})")
        return self.utts[pos]


class UtteranceRunner(BaseRunner):
    """A runner over one split's manifest: streamed planning, a shard's utterances on its worker,
    named errors, skips.

    Subclasses set ``self.split``, ``self.manifest``, ``self.input_options`` (fsspec options of
    the inputs), ``self.fingerprint`` and ``self.allow_pipes`` before calling ``BaseRunner.__init__``. ``forward``
    receives ``dataset``: the shard's utterances (:class:`ShardDataset`), read on the worker
    from the shard's byte range of the manifest.
    """

    split: str
    manifest: str
    input_options: Mapping[str, Any]
    fingerprint: str = "stat"
    allow_pipes: bool = False
    _manifest_skipped: list[SkippedItem] | None = None

    @property
    def outputs_rel(self) -> str:
        """Where the split's merged outputs live, relative to ``output_dir``."""
        return self.split

    def plan(self, indices: Sequence[int] | None = None) -> ShardPlan:
        """The split's shard plan, streamed from its manifest (``indices`` must be ``None``).

        Lines left out under ``on_error: skip`` are kept for :meth:`manifest_skipped`.
        """
        if indices is not None:
            raise TypeError(f"{type(self).__name__} plans its shards from the manifest; call run() without indices")
        store = self.storage
        planned = plan_manifest(self.manifest, self.split, self.shard_size, self.hash_config(), on_error=self.on_error,
                                fingerprint=self.fingerprint, storage_options=self.input_options, spool=store,
                                spool_rel=posixpath.join(self.shard_subdir, "inputs"), allow_pipes=self.allow_pipes)
        self._manifest_skipped = planned.skipped
        return planned.plan

    def manifest_skipped(self) -> list[SkippedItem]:
        """Manifest lines left out under ``on_error: skip`` (known once the split is planned)."""
        if self._manifest_skipped is None:
            raise RuntimeError(f"split {self.split!r} is not planned yet: call plan() first")
        return list(self._manifest_skipped)

    def shard_env(self, shard: Shard, env: Mapping[str, Any]) -> Mapping[str, Any]:
        source = shard.source or {}
        utts = read_manifest_slice(source, self.split, self.input_options)
        if len(utts) != shard.num_items:
            raise RuntimeError(f"split {self.split!r}, {shard.name}: read {len(utts)} utterances where the plan "
                               f"has {shard.num_items}")
        return {**env, "dataset": ShardDataset(self.split, utts, shard.start, str(source.get("cwd") or ""))}

    def shard_env_keys(self) -> tuple[str, ...]:
        return ("dataset",)

    def describe_item(self, idx: int, env: Mapping[str, Any]) -> str:
        return env["dataset"][idx].where(self.split)

    def skip_record(self, idx: int, env: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
        u = env["dataset"][idx]
        return SkippedItem(self.split, u.utt_id, u.line, u.path, f"{type(exc).__name__}: {exc}").to_dict()


__all__ = ["EnvironmentProvider", "ShardDataset", "UtteranceRunner", "check_common"]
