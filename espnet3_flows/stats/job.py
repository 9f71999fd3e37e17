"""The collect-stats job: config, provider and runner (feature shapes and global mean/variance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

from espnet3_flows.inputs.audio import audio_header
from espnet3_flows.inputs.audio_config import AudioConfig
from espnet3_flows.config import to_plain
from espnet3_flows.errors import BadItemError
from espnet3_flows.frontend_job import FrontendRunner, count_native_rate, frontend_resources
from espnet3_flows.frontends.frontend import MomentsBatch, extract_features, extract_moments
from espnet3_flows.parallel.base_runner import WHOLE_SHARD
from espnet3_flows.sharding import Shard
from espnet3_flows.stats.accumulator import StatsAccumulator
from espnet3_flows.stats.tokens import TokenConfig
from espnet3_flows.utterance_job import ShardDataset

from espnet3_flows.stats.config import CollectStatsConfig
from espnet3_flows.stats.outputs import StatsShardWriter, publish_split, row_shape

def build_resources(cfg: CollectStatsConfig) -> dict[str, Any]:
    """The resources of collect-stats' ``forward``: ``frontend``, ``audio``, ``storage_options``,
    ``collect_stats_kwargs`` and ``tokens`` (a :class:`~espnet3_flows.stats.tokens.TokenCounter`
    or ``None``), built once per worker (``dataset``, a shard's utterances, comes with each shard)."""
    return {
        **frontend_resources(cfg),
        "collect_stats_kwargs": dict(cfg.collect_stats_kwargs),
        "tokens": _token_counter(cfg.tokens),
    }


def _token_counter(tokens: TokenConfig) -> Any:
    if not tokens.enabled:
        return None
    from espnet3_flows.stats.tokens import TokenCounter

    return TokenCounter(tokens)


class CollectStatsRunner(FrontendRunner):
    """Per shard: feature shapes, exact count/mean/M2, optional Kaldi ark/scp of the features."""

    def __init__(self, cfg: CollectStatsConfig, split: str, **kwargs: Any):
        # without features written, a call's features are summed up where they are computed: a
        # frontend with batches of its own gets a whole shard, its batches full and least padded
        super().__init__(cfg, split, build_resources, whole_shard=not cfg.write_collected_feats, **kwargs)

    def hash_config(self) -> Mapping[str, Any]:
        fe = self.cfg.frontend.hashed()
        hashed = {"job": "collect_stats/1", "split": self.split, "frontend": fe,
                  "write_collected_feats": self.cfg.write_collected_feats,
                  "collect_stats_kwargs": to_plain(self.cfg.collect_stats_kwargs), **self.HASHED_ON_ERROR}
        if self.cfg.tokens.enabled:  # absent otherwise: runs without token counts keep their hashes
            hashed["tokens"] = self.cfg.tokens.hashed()
        if self.cfg.write_collected_feats and self.cfg.collected_feats_format != "ark":
            hashed["collected_feats_format"] = self.cfg.collected_feats_format
        if self.batch_size == WHOLE_SHARD and self.cfg.frontend.kind.own_batches(self.cfg.frontend) == "padded":
            hashed["batches"] = "per shard"  # (which utterances share a padded batch may change features)
        return hashed

    # -- worker side --
    @staticmethod
    def forward(idx: Any, dataset: ShardDataset, frontend: Any, audio: AudioConfig,
                storage_options: Mapping[str, Any], collect_stats_kwargs: Mapping[str, Any],
                tokens: Any = None, feats_format: str | None = None) -> list[dict[str, Any]] | MomentsBatch:
        """Load the utterances of ``idx`` and return ``{utt_id, speech_len, feats, tokens}`` for each;
        where no features are written and the frontend computes their moments itself (a torch
        frontend, fbank on a GPU), a :class:`MomentsBatch` of the same rows with ``feats`` ``None``
        and the moments of all their frames, which stay where they were computed."""
        ids = idx if isinstance(idx, list) else [idx]
        utts = [dataset[i] for i in ids]
        counts = [_count_tokens(u, tokens) for u in utts]
        if frontend is None:
            headers = [audio_header(u, audio, storage_options, dataset.audio_cache) for u in utts]
            return [{"utt_id": u.utt_id, "speech_len": n, "rate": rate, "feats": None, "tokens": c}
                    for u, (n, rate), c in zip(utts, headers, counts, strict=True)]
        batch = None if feats_format else extract_moments(utts, frontend, audio, storage_options, dataset.audio_cache,
                                                           collect_stats_kwargs)
        out = batch.rows if batch is not None else extract_features(utts, frontend, audio, storage_options,
                                                                    dataset.audio_cache, collect_stats_kwargs)
        for r, c in zip(out, counts, strict=True):
            r["tokens"] = c
        return out if batch is None else batch

    def shard_resources(self, shard: Shard, resources: Mapping[str, Any]) -> Mapping[str, Any]:
        feats = self.cfg.collected_feats_format if self.cfg.write_collected_feats else None
        return {**super().shard_resources(shard, resources), "feats_format": feats}

    # -- the shard's files and state: ESPnet3's writer hooks --
    @staticmethod
    def open_writers(shard_dir: Path, output_dir: str, split: str, feats_format: str | None = None,
                     **resources: Any) -> dict[str, Any]:
        """``shapes.tsv`` in the shard's directory and, with ``feats_format``, the features under
        the split's ``collect_feats/`` (see :class:`~espnet3_flows.stats.outputs.StatsShardWriter`)."""
        return {"shard": StatsShardWriter(Path(shard_dir), Path(output_dir) / split / "collect_feats", feats_format)}

    @staticmethod
    def write_record(writers: dict[str, Any], result: list[dict[str, Any]] | MomentsBatch, state: dict[str, Any],
                     **resources: Any) -> None:
        """Write the utterances' rows (and features), fold them into the shard's statistics (a
        :class:`MomentsBatch`'s moments into the shard's, where they were computed)."""
        rows = result.rows if isinstance(result, MomentsBatch) else result
        writers["shard"].write(rows)
        if isinstance(result, MomentsBatch):
            state["moments"] = result.moments if "moments" not in state else state["moments"].merge(result.moments)
            computed = state.setdefault("computed_samples", [0, 0])
            computed[0], computed[1] = computed[0] + result.samples[0], computed[1] + result.samples[1]
        acc = state.setdefault("acc", StatsAccumulator())
        for r in rows:
            f = r["feats"]
            state["utterances"] = state.get("utterances", 0) + 1
            count_native_rate(state, r["rate"])
            _extend(state.setdefault("samples", [0, None, None]), int(r["speech_len"]))
            if f is not None:
                acc.update(f)
            shape = row_shape(r)
            if shape is not None:
                _extend(state.setdefault("frames", [0, None, None]), shape[0])

    @staticmethod
    def close_writers(writers: dict[str, Any], state: dict[str, Any], **resources: Any) -> dict[str, Any]:
        """Close the files; the shard's counts, sums and extremes (its rows are in ``shapes.tsv``):
        moments computed on a device come to the host here, once per shard."""
        writers["shard"].close()
        acc = state.pop("acc", None) or StatsAccumulator()
        moments = state.pop("moments", None)
        if moments is not None:
            acc.merge(StatsAccumulator(*moments.to_host()))
        done = {"stats": acc.to_dict(), "utterances": state.get("utterances", 0),
                "samples": state.get("samples", [0, None, None]), "frames": state.get("frames", [0, None, None]),
                "native_rates": state.get("native_rates", {})}
        if "computed_samples" in state:  # (moments computed by the frontend: its batches' padding is known)
            done["computed_samples"] = state["computed_samples"]
        return done

    def merge(self, shard_dirs: list[Any]) -> dict[str, Any]:
        """The split's ``feats_stats.npz``, shape files, keys and summary (see :func:`publish_split`)."""
        return publish_split(self, [self.done_record(d) for d in shard_dirs])


def _count_tokens(utt: Any, tokens: Any) -> int | None:
    """The token count of an utterance's transcript (``None`` without token settings)."""
    if tokens is None:
        return None
    if not utt.text.strip():
        raise BadItemError(f"utt {utt.utt_id!r}: no transcript to count tokens of (text is empty or missing); "
                           "token counts (text_shape) are on through tokens.token_type or frontend.espnet_config: "
                           "tokens.token_type=none turns them off")
    return tokens.count(utt.text)


def _extend(total_min_max: list[Any], value: int) -> None:
    """Fold ``value`` into ``[sum, min, max]``."""
    total_min_max[0] += value
    total_min_max[1] = value if total_min_max[1] is None else min(total_min_max[1], value)
    total_min_max[2] = value if total_min_max[2] is None else max(total_min_max[2], value)


def collect_stats_runners(cfg: CollectStatsConfig) -> list[CollectStatsRunner]:
    """One runner per split of ``cfg.manifests``."""
    return [CollectStatsRunner(cfg, split) for split in cfg.manifests]
