"""Shared parts of per-utterance jobs: planning from a manifest, a shard's utterances, skips, checks.
(Their shared config keys are :mod:`espnet3_flows.job_config`'s, imported here too.)"""

from __future__ import annotations

import functools
import posixpath
from collections import Counter
from typing import Any, Protocol, runtime_checkable
from collections.abc import Callable, Mapping, Sequence

from espnet3_flows.inputs.audio_config import AudioConfig
from espnet3_flows.inputs.recording_cache import RecordingCache, recording_key
from espnet3_flows.job_config import EngineConfig, InputsConfig, SplitsConfig, check_split_names
from espnet3_flows.inputs.manifest import read_manifest_slice
from espnet3_flows.inputs.records import SkippedItem, Utterance
from espnet3_flows.inputs.planner import plan_manifest
from espnet3_flows.parallel.base_runner import BaseRunner
from espnet3_flows.parallel.env_provider import EnvironmentProvider
from espnet3_flows.sharding import Shard, ShardPlan
from espnet3_flows.split_outputs import claim_outputs, publish_split_files
from espnet3_flows.storage import Storage

GPU_DECODE_THREADS = 4  #: ``decode_threads: 0`` where the job's model runs on a GPU


def audio_resources(cfg: EngineConfig, sampling_rate: int, channel: Any, max_duration: float | None,
                    resampler: str = "", device: str = "cpu") -> dict[str, Any]:
    """The resources every audio job's workers share: ``audio`` (how to load and check an
    utterance's audio, on ``decode_threads`` threads: see :class:`EngineConfig`; ``device`` is
    where the job's model runs) and ``storage_options``. Torch runs one thread per worker
    process: the workers are the parallelism, and more threads per worker only contend for the
    same cores."""
    import torch

    torch.set_num_threads(1)
    return {"audio": audio_settings(cfg, sampling_rate, channel, max_duration, resampler, device),
            "storage_options": dict(cfg.storage_options)}


#: :func:`audio_resources`' earlier name, kept for job plugins that import it
audio_env = audio_resources


def audio_settings(cfg: EngineConfig, sampling_rate: int, channel: Any, max_duration: float | None,
                   resampler: str = "", device: str = "cpu") -> AudioConfig:
    """How the workers of ``cfg``'s job load and check audio (:func:`audio_resources`'s ``audio``)."""
    threads = cfg.decode_threads or (GPU_DECODE_THREADS if device != "cpu" else 1)
    return AudioConfig(sampling_rate, channel, max_duration, cfg.allow_pipes, cfg.pipe_timeout,
                       **({"resampler": resampler} if resampler else {}), decode_threads=threads)


class JobEnvProvider(EnvironmentProvider):
    """An ESPnet3 provider whose resources are ``build(config, **params)``: built in this process, or once
    per worker by a function of the config alone (nothing of the provider is pickled).

    Args:
        config: The job's config.
        build: A module-level function ``(config, **params) -> resources dict`` (loads the model).
        params: Extra keyword arguments of ``build`` (e.g. ``{"split": "train"}``).
    """

    def __init__(self, config: Any, build: Callable[..., dict[str, Any]], params: Mapping[str, Any] | None = None):
        super().__init__(config, {**(params or {}), "build": f"{build.__module__}.{build.__qualname__}"})
        self._build = build
        self._kwargs = dict(params or {})

    def build_env_local(self) -> dict[str, Any]:
        return self._build(self.config, **self._kwargs)

    def build_worker_setup_fn(self) -> Callable[[], dict[str, Any]]:
        return functools.partial(self._build, self.config, **self._kwargs)


@runtime_checkable
class SplitRunner(Protocol):
    """What orchestration uses of a job's runner: one split's planning, shards, done records and
    merge. :class:`UtteranceRunner` (a :class:`~espnet3_flows.parallel.base_runner.BaseRunner` over a
    manifest) provides all of it; a job's ``runners`` factory returns one per split."""

    split: str
    shard_subdir: str
    provider: EnvironmentProvider
    batch_size: int | str | None
    on_error: str

    @property
    def outputs_rel(self) -> str: ...

    @property
    def storage(self) -> Storage | None: ...

    def plan(self, indices: Sequence[int] | None = None, workers: int = 1) -> ShardPlan: ...

    def manifest_skipped(self) -> list[SkippedItem]: ...

    def hash_config(self) -> Mapping[str, Any]: ...

    def collect_done(self, plan: ShardPlan) -> dict[int, Any]: ...

    def load_done(self, shard: Shard) -> Any: ...

    def read_done(self, shard_hash: str, cached: bool = False) -> Any: ...

    def write_plan(self, plan: ShardPlan) -> None: ...

    def check_resource_keys(self, keys: Sequence[str]) -> None: ...

    def run_shard(self, shard: Shard, resources: Mapping[str, Any]) -> Any: ...

    def merge(self, shard_dirs: list[Any]) -> Any: ...


class ShardDataset:
    """One shard's utterances, indexed by their positions in the split (what ``forward`` receives).

    Attributes:
        audio_cache: The shard's :class:`~espnet3_flows.inputs.recording_cache.RecordingCache`: pass it to
            :func:`~espnet3_flows.inputs.audio.load_audio` so that segments of one recording decode it once.
    """

    def __init__(self, split: str, utts: list[Utterance], start: int, cwd: str = ""):
        self.split = split
        self.utts = utts
        self.start = start
        uses = Counter(recording_key(u) for u in utts if u.recording)
        self.audio_cache = RecordingCache(uses, cwd, order=utts)

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

    ``forward`` receives ``dataset``: the shard's utterances (:class:`ShardDataset`), read on the
    worker from the shard's byte range of the manifest.

    Args:
        cfg: The job's config (an :class:`EngineConfig`: storage options, shard size,
            ``on_error``, fingerprints and pipes come from it).
        split: The split's name.
        manifest: The split's manifest (path, URL or Kaldi data directory).
        provider: Builds the resources of ``forward`` (e.g. a :class:`JobEnvProvider`).
        output_dir: Where outputs go (default ``cfg.output_dir``).
        shard_subdir: Where shard directories go, relative to ``output_dir`` (default
            ``<split>/shards``).
        batch_size: Items per ``forward`` call (``None``: one item per call, ``"shard"``: all of the
            shard's items in one call).
        **kwargs: Further :class:`~espnet3_flows.parallel.base_runner.BaseRunner` arguments.
    """

    #: the built-in jobs' merges read shard directories through :attr:`storage`: on a remote
    #: output they receive the directories' URLs, nothing is downloaded
    download_shards_for_merge = False
    #: the job's config (the dataclass its ``jobspec`` names)
    cfg: Any
    split: str
    manifest: str
    input_options: Mapping[str, Any]
    #: how input files are fingerprinted (``cfg.fingerprint``: ``stat`` or ``manifest``)
    fingerprint_mode: str = "stat"
    allow_pipes: bool = False
    #: Whether the job writes files keyed by speaker id (``utt2spk``, ``spk_xvector.scp``): planning
    #: then refuses a speaker id their readers would split, as it refuses such an utterance id
    #: (:func:`~espnet3_flows.inputs.records.validate_speaker_id`); elsewhere ``John Smith`` is harmless
    speaker_keyed_outputs: bool = False
    _manifest_skipped: list[SkippedItem] | None = None
    #: Where planning writes a joined data directory or unpacked manifest (None: the output; dry run: a temp dir)
    spool: Storage | None = None

    def __init__(self, cfg: Any, split: str, manifest: str, provider: EnvironmentProvider, *,
                 output_dir: str | None = None, shard_subdir: str | None = None, batch_size: int | str | None = None,
                 **kwargs: Any):
        self.cfg = cfg
        self.split = split
        self.manifest = manifest
        self.input_options = cfg.storage_options
        self.fingerprint_mode = cfg.fingerprint
        self.allow_pipes = cfg.allow_pipes
        super().__init__(provider, batch_size=batch_size,
                         output_dir=output_dir if output_dir is not None else cfg.output_dir,
                         shard_subdir=shard_subdir if shard_subdir is not None else f"{split}/shards",
                         shard_size=cfg.shard_size, storage_options=cfg.storage_options, on_error=cfg.on_error,
                         **kwargs)

    @property
    def outputs_rel(self) -> str:
        """Where the split's merged outputs live, relative to ``output_dir``."""
        return self.split

    def plan(self, indices: Sequence[int] | None = None, workers: int = 1) -> ShardPlan:
        """The split's shard plan, streamed from its manifest (``indices`` must be ``None``), cut
        finer for a split too small to keep ``workers`` concurrent workers busy.

        Lines left out under ``on_error: skip`` are kept for :meth:`manifest_skipped`.
        """
        if indices is not None:
            raise TypeError(f"{type(self).__name__} plans its shards from the manifest; call run() without indices")
        store = self.storage
        planned = plan_manifest(self.manifest, self.split, self.shard_size, self.hash_config(), on_error=self.on_error,
                                fingerprint=self.fingerprint_mode, storage_options=self.input_options,
                                spool=self.spool if self.spool is not None else store,
                                spool_rel=posixpath.join(self.shard_subdir, "inputs"), allow_pipes=self.allow_pipes,
                                workers=workers, speakers=self.speaker_keyed_outputs)
        self._manifest_skipped = planned.skipped
        return planned.plan

    #: ``on_error`` in a built-in job's :meth:`hash_config`: ``fail`` whatever the policy (see ShardRecords)
    HASHED_ON_ERROR = {"on_error": "fail"}

    #: Keys of :meth:`hash_config` that do not make a split directory another config's
    #: (``owner.json``): per split, per error policy, or facts of the machine rather than choices
    owner_ignores: tuple[str, ...] = ("split", "on_error")

    def owner_record(self) -> tuple[str, dict[str, Any]]:
        """The job and the config that make the split's output directory this job's (``owner.json``)."""
        hashed = dict(self.hash_config())  # "collect_stats/1": a new version recomputes, it is the same job
        return str(hashed.pop("job", type(self).__name__)).split("/")[0], {
            k: v for k, v in hashed.items() if k not in self.owner_ignores}

    def write_plan(self, plan: ShardPlan) -> None:
        """Claim the split's output directory (:func:`~espnet3_flows.split_outputs.claim_outputs`),
        then publish the plan."""
        if self.storage is not None:
            claim_outputs(self.storage, self.outputs_rel, *self.owner_record())
        super().write_plan(plan)

    def manifest_skipped(self) -> list[SkippedItem]:
        """Manifest lines left out under ``on_error: skip`` (known once the split is planned)."""
        if self._manifest_skipped is None:
            raise RuntimeError(f"split {self.split!r} is not planned yet: call plan() first")
        return list(self._manifest_skipped)

    def shard_resources(self, shard: Shard, resources: Mapping[str, Any]) -> Mapping[str, Any]:
        """The worker's resources plus ``dataset`` (the shard's utterances, read from its byte range of the
        manifest), ``split`` and ``outputs_rel`` (where the split's merged outputs go)."""
        source = shard.source or {}
        utts = read_manifest_slice(source, self.split, self.input_options)
        if len(utts) != shard.num_items:
            raise RuntimeError(f"split {self.split!r}, {shard.name}: read {len(utts)} utterances where the plan "
                               f"has {shard.num_items}")
        return {**resources, "dataset": ShardDataset(self.split, utts, shard.start, str(source.get("cwd") or "")),
                "split": self.split, "outputs_rel": self.outputs_rel}

    def input_audio(self) -> tuple[str, AudioConfig] | None:
        """The key of the rate the job reads audio at, and how (a dry run's checks); ``None``: unchecked."""
        return None

    def shard_resource_keys(self) -> tuple[str, ...]:
        return ("dataset", "split", "outputs_rel")

    def describe_item(self, idx: int, resources: Mapping[str, Any]) -> str:
        return resources["dataset"][idx].where(self.split)

    def skip_record(self, idx: int, resources: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
        u = resources["dataset"][idx]
        return SkippedItem(self.split, u.utt_id, u.line, u.path, f"{type(exc).__name__}: {exc}").to_dict()


# (EngineConfig, InputsConfig, SplitsConfig and check_split_names are job_config's, importable from here too)
__all__ = ["EngineConfig", "EnvironmentProvider", "InputsConfig", "JobEnvProvider", "ShardDataset", "SplitRunner",
           "SplitsConfig", "UtteranceRunner", "check_split_names", "publish_split_files"]
