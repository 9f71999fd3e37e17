"""The config keys every per-utterance job shares (:class:`SplitsConfig`, :class:`InputsConfig`,
:class:`EngineConfig`) and the demo's settings for a config that names no input: plain data,
importable without the jobs' libraries, so that a command line reads its config before anything of
the run starts (:mod:`espnet3_flows.orchestration.early_start`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Mapping

from espnet3_flows.code_keys import CODE
from espnet3_flows.config import ConfigError, check_choices
from espnet3_flows.errors import ON_ERROR_POLICIES
from espnet3_flows.inputs.settings import DEMO_UTTERANCES, FINGERPRINT_MODES
from espnet3_flows.parallel.parallel_config import MOVED_KEYS, ParallelConfig

#: The ``parallel`` keys' old spellings (:data:`~espnet3_flows.parallel.parallel_config.MOVED_KEYS`)
#: from a job config's root: every job's schema reads them
PARALLEL_ALIASES = {f"parallel.{old}": f"parallel.{new}" for old, new in MOVED_KEYS.items()}

_SPLIT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass
class SplitsConfig:
    """Where a per-utterance job reads and writes: a manifest per split and one output location.

    Attributes:
        manifests: Split name → manifest, path or URL: a TSV (``utt_id, wav_path[, text[,
            speaker]]``), a lhotse ``.jsonl[.gz]`` CutSet, a Kaldi data directory (``wav.scp``
            with optional ``segments``, ``utt2spk``, ``text``; see :mod:`espnet3_flows.inputs.kaldi_dir`),
            or a HuggingFace dataset saved with ``save_to_disk`` (columns ``id``, ``audio``,
            ``speaker``, ``text``, renamed by ``dir?id=key&audio=file``; the ``hf`` extra; see
            :mod:`espnet3_flows.inputs.formats.hf`). Empty means: generate the demo corpus and use
            its splits.
        output_dir: Where outputs go (path or fsspec URL such as ``s3://bucket/stats``).
    """

    manifests: dict[str, str] = field(default_factory=dict)
    output_dir: str = "exp/output"

    def __post_init__(self) -> None:
        check_split_names(self.manifests)


@dataclass
class InputsConfig(SplitsConfig):
    """The input and output keys of jobs configured like collect-stats (a manifest per split).

    Attributes:
        batch_size: Utterances per ``forward`` call. In collect-stats without
            ``write_collected_feats``, a frontend that makes its own batches
            (``frontend.max_batch_samples`` above 0 for ``model`` and ``espnet2``, ``fbank`` on a
            GPU) takes a whole shard per call instead, so that its batches are full and
            length-sorted over the shard (padding: ``summary.json``'s ``padding_fraction``); the
            shard's audio is then in memory at once (float32: ``shard_size`` x mean seconds x
            64 KB at 16 kHz, ~0.6 GB for 1,000 utterances of 10 s).
        demo_utterances: Size of the generated demo corpus when ``manifests`` is empty.
    """

    batch_size: int = 16
    demo_utterances: int = DEMO_UTTERANCES

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        super().__post_init__()


@dataclass
class EngineConfig:
    """The keys of every per-utterance job: sharding, errors, retries, inputs, storage, cluster.

    Attributes:
        storage_options: fsspec options for the outputs and remote inputs (``key``, ``secret``,
            ``client_kwargs.endpoint_url``, ...); never written to outputs or logs, and never a
            flow parameter (``docs/credentials.md``).
        shard_size: Mean utterances per shard: the unit of caching, retry and parallelism.
            Boundaries are content-defined (a shard ends after an utterance whose id hash says
            so, at least ``shard_size/2`` and at most ``2·shard_size`` utterances in), so
            inserting or removing manifest lines recomputes only the shards that hold them. Each
            computed shard is one Prefect task: about 10 ms of wall time more than the engine
            without Prefect (``benchmarks/README.md``, scale: 1,000 shards in 42.8 s against
            31.8 s, medians of 3); 1000 utterances of 2-6 s are ~1 s of work per worker, and at
            this size the flow's steady state equals the engine's without Prefect. A split of fewer
            than ``2 × workers × shard_size`` utterances is cut finer, into 2 to 4 shards per
            worker (a power of two; each shard but the last of at least 4 utterances, fewer shards
            where the two meet), so that every worker is busy on a small split (a dev set on 8
            GPUs); a larger split's shards do not depend on the number of workers, so scaling a
            cluster recomputes nothing there.
        on_error: ``fail`` stops the run at the first bad item (never retried: it fails the same
            way every time); ``skip`` lists it in ``skipped.tsv`` and goes on. Switching it
            computes again only the shards that had a bad item.
        retries: Retries of a failed shard task (Prefect); for infrastructure errors only
            (storage, network, a lost worker), never for a bad item: under ``on_error: fail`` the
            run fails at once, since the item would fail the same way again.
        retry_delay_seconds: First retry delay; doubles on each retry (Prefect's
            ``exponential_backoff``, each delay jittered by up to 50 % with
            ``retry_jitter_factor``, so that shards failed together do not retry together).
        fingerprint: How input files are fingerprinted into shard hashes: ``stat`` (size and
            mtime of every audio file, or the object store's ETag from one listing per
            directory: a file replaced in place is recomputed; local stats go concurrent by
            themselves when they are slow, as on NFS or Lustre), ``strict`` (``stat`` plus each
            local file's ctime and inode number: also sees other content of the same size whose
            mtime was restored, ``cp -p`` or ``rsync -t``; a ``chmod``, a restore or a remount
            that renumbers inodes recomputes too, and switching to it recomputes once) or
            ``manifest`` (no file system access at planning: a shard's hash covers its manifest
            lines only, so a file replaced under the same path is **not** recomputed; for file
            systems where a stat per file is too slow).
        parallel: Where shards run: the ``parallel:`` section
            (:class:`~espnet3_flows.parallel.parallel_config.ParallelConfig`).
        allow_pipes: Whether audio entries that are commands (``sph2pipe -f wav X.sph |`` in a
            data directory's ``wav.scp``, or a manifest path ending in ``|``) may run, on every
            worker, through the shell. Off by default: a manifest from storage or a UI parameter
            must not execute commands; with it off, the first command entry is an error naming
            its file and line.
        pipe_timeout: Seconds one audio command may run before it is killed with its children
            (the shard then fails and is retried).
        decode_threads: Threads in each worker that decode (and resample) a ``forward`` call's
            audio files together, ahead of the model (soundfile and scipy release the GIL); above
            1, they also decode the shard's next call's files while the model works on this
            call's (one call's audio more in memory). 0 picks 4 where the job's model runs on a
            GPU (``frontend.device`` / ``xvector.device`` not ``cpu``: one GPU consumes audio
            faster than one core decodes it) and 1 elsewhere (the workers are the CPU
            parallelism). Results never depend on it.
    """

    #: old spellings read as their keys (see :func:`espnet3_flows.config.rename_aliases`)
    CONFIG_ALIASES: ClassVar[dict[str, str]] = PARALLEL_ALIASES

    storage_options: dict[str, Any] = field(default_factory=dict)
    shard_size: int = 1000
    on_error: str = field(default="fail", metadata={"choices": ON_ERROR_POLICIES})
    retries: int = 2
    retry_delay_seconds: float = 2.0
    fingerprint: str = field(default="stat", metadata={"choices": FINGERPRINT_MODES})
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    allow_pipes: bool = field(default=False, metadata={CODE: "audio entries that are commands run in a shell"})
    pipe_timeout: float = 600.0
    decode_threads: int = 0

    def __post_init__(self) -> None:
        if self.decode_threads < 0:
            raise ConfigError(f"decode_threads must be >= 0 (0: automatic), got {self.decode_threads}")
        if not self.pipe_timeout > 0:
            raise ConfigError(f"pipe_timeout must be a positive number of seconds, got {self.pipe_timeout}")
        check_choices(self)  # on_error, fingerprint and a job's own keys with choices (its sections check theirs)
        if self.shard_size < 1:
            raise ConfigError(f"shard_size must be >= 1, got {self.shard_size}")
        after = getattr(super(), "__post_init__", None)  # the next config base's checks (SplitsConfig)
        if after is not None:
            after()


def check_split_names(manifests: Mapping[str, str]) -> None:
    """Split names become directory names: letters, digits, '_', '-', '.' (raise :class:`ConfigError`)."""
    for split in manifests:
        if not split or set(split) - _SPLIT_CHARS or split.startswith((".", "-")):
            raise ConfigError(f"split name {split!r} must be letters, digits, '_', '-' or '.'")


def demo_manifest_settings(cfg: Any) -> dict[str, Any] | None:
    """For a job config whose ``manifests`` is empty: the generated demo corpus's manifests (as
    config settings); ``None`` when the config names its inputs."""
    if cfg.manifests:
        return None
    from espnet3_flows.inputs.demo import demo_manifests

    return {"manifests": demo_manifests(cfg.output_dir, cfg.demo_utterances)}
