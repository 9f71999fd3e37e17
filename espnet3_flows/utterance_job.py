"""Shared parts of per-utterance jobs: a split's manifest as dataset, item keys, skips, checks."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from espnet3_flows.config import ConfigError
from espnet3_flows.manifest import ON_ERROR_POLICIES, SkippedItem, Utterance, read_manifest
from espnet3_flows.parallel.provider import EnvironmentProvider
from espnet3_flows.parallel.runner import BaseRunner
from espnet3_flows.sharding import fingerprint_files

_SPLIT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_common(on_error: str, shard_size: int, batch_size: int, manifests: Mapping[str, str]) -> None:
    """Checks shared by the jobs' configs (raise :class:`ConfigError`)."""
    if on_error not in ON_ERROR_POLICIES:
        raise ConfigError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
    if shard_size < 1:
        raise ConfigError(f"shard_size must be >= 1, got {shard_size}")
    if batch_size < 0:
        raise ConfigError(f"batch_size must be >= 0, got {batch_size}")
    for split in manifests:
        if not split or set(split) - _SPLIT_CHARS or split.startswith((".", "-")):
            raise ConfigError(f"split name {split!r} must be letters, digits, '_', '-' or '.'")


class UtteranceDataset:
    """A split's utterances, read from its manifest once per process."""

    def __init__(self, manifest: str, split: str, on_error: str, storage_options: Mapping[str, Any] | None):
        self.split = split
        self.utts, self.skipped = read_manifest(manifest, split, on_error, storage_options)

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, idx: int) -> Utterance:
        return self.utts[idx]


def manifest_stamp(manifest: str | None, storage_options: Mapping[str, Any]) -> str:
    """The manifest's fingerprint; part of a provider's params so an edited manifest is re-read.

    Envs are cached per process by their token: without this, a long-lived worker would keep
    serving the utterances of a manifest that has changed since.
    """
    return fingerprint_files([manifest], storage_options)[manifest] if manifest else ""


class UtteranceRunner(BaseRunner):
    """A runner over one split's manifest: planning keys with file fingerprints, named errors, skips.

    Subclasses set ``self.split``, ``self.manifest``, ``self.on_error_policy`` and
    ``self.input_options`` before calling ``BaseRunner.__init__``; their env has ``dataset``.
    """

    split: str
    manifest: str
    input_options: Mapping[str, Any]
    _utts: list[Utterance] | None = None
    _manifest_skipped: list[SkippedItem] = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_utts"] = None  # workers read the manifest themselves (once, in the env)
        return state

    @property
    def outputs_rel(self) -> str:
        """Where the split's merged outputs live, relative to ``output_dir``."""
        return self.split

    def utterances(self) -> list[Utterance]:
        """The split's utterances (read on the driver for planning)."""
        if self._utts is None:
            self._utts, self._manifest_skipped = read_manifest(self.manifest, self.split, self.on_error,
                                                               self.input_options)
        return self._utts

    def indices(self) -> range:
        """Every item index of the split."""
        return range(len(self.utterances()))

    def manifest_skipped(self) -> list[SkippedItem]:
        """Manifest lines skipped under ``on_error: skip``."""
        self.utterances()
        return list(self._manifest_skipped)

    def item_keys(self, indices: Sequence[int]) -> list[str]:
        utts = self.utterances()
        prints = fingerprint_files([utts[i].path for i in indices], self.input_options)
        return [f"{utts[i].utt_id}\t{utts[i].path}\t{prints[utts[i].path]}" for i in indices]

    def describe_item(self, idx: int, env: Mapping[str, Any]) -> str:
        return env["dataset"][idx].where(self.split)

    def skip_record(self, idx: int, env: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
        u = env["dataset"][idx]
        return SkippedItem(self.split, u.utt_id, u.line, u.path, f"{type(exc).__name__}: {exc}").to_dict()


def provider_params(split: str, manifest: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """Provider params of a split: its name and its manifest's stamp."""
    return {"split": split, "manifest_stamp": manifest_stamp(manifest, storage_options)}


__all__ = ["EnvironmentProvider", "UtteranceDataset", "UtteranceRunner", "check_common", "manifest_stamp",
           "provider_params"]
