"""The extract-features job: config, provider and runner.

Per shard, a worker writes the features of its utterances into one Kaldi ark (with its scp) and
one row per utterance (``rows.tsv``: id, samples, frames, dim, text, speaker); the merge writes
each split's ``feats.scp``, ``feats_shape`` and ``cuts.jsonl.gz`` (see
:mod:`espnet3_flows.features.outputs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

from espnet3_flows.inputs.audio_config import AudioConfig
from espnet3_flows.features.config import ExtractFeaturesConfig
from espnet3_flows.features.outputs import FeatureShardWriter, publish_split, shard_ark_rel
from espnet3_flows.frontend_job import FrontendRunner, count_native_rate, frontend_resources
from espnet3_flows.frontends.frontend import extract_features
from espnet3_flows.frontends.wave_frontends import hop_samples
from espnet3_flows.utterance_job import ShardDataset


#: The resources of ``forward``: ``frontend``, ``audio`` and ``storage_options``, once per worker
build_resources = frontend_resources
#: :data:`build_resources`' earlier name, kept for code that imports it
build_env = build_resources


class FeatureRunner(FrontendRunner):
    """Per shard: one Kaldi ark/scp of the features and a row per utterance."""

    def __init__(self, cfg: ExtractFeaturesConfig, split: str, **kwargs: Any):
        super().__init__(cfg, split, build_resources, **kwargs)

    def hash_config(self) -> Mapping[str, Any]:
        return {"job": "extract_features/1", "split": self.split, "frontend": self.cfg.frontend.hashed(),
                **self.HASHED_ON_ERROR}

    # -- worker side --
    @staticmethod
    def forward(idx: Any, dataset: ShardDataset, frontend: Any, audio: AudioConfig,
                storage_options: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The features of the utterances of ``idx`` (collect-stats' extraction, checks included),
        with each utterance's transcript and speaker."""
        utts = [dataset[i] for i in (idx if isinstance(idx, list) else [idx])]
        out = extract_features(utts, frontend, audio, storage_options, dataset.audio_cache)
        for r, utt in zip(out, utts, strict=True):
            r["text"], r["speaker"] = utt.text, utt.speaker
        return out

    # -- the shard's files and state: ESPnet3's writer hooks --
    @staticmethod
    def open_writers(shard_dir: Path, output_dir: str, outputs_rel: str, **resources: Any) -> dict[str, Any]:
        """The shard's ark (beside the split's outputs), its scp and ``rows.tsv`` (see
        :class:`~espnet3_flows.features.outputs.FeatureShardWriter`)."""
        shard_dir = Path(shard_dir)
        return {"shard": FeatureShardWriter(shard_dir, Path(output_dir) / shard_ark_rel(outputs_rel, shard_dir.name))}

    @staticmethod
    def write_record(writers: dict[str, Any], result: list[dict[str, Any]], state: dict[str, Any],
                     **resources: Any) -> None:
        """Write the utterances' features and rows; count them in the shard's state."""
        writers["shard"].write(result)
        for r in result:
            state["utterances"] = state.get("utterances", 0) + 1
            state["frames"] = state.get("frames", 0) + int(r["feats"].shape[0])
            state["samples"] = state.get("samples", 0) + int(r["speech_len"])
            state["dim"] = int(r["feats"].shape[1])
            count_native_rate(state, r["rate"])

    @staticmethod
    def close_writers(writers: dict[str, Any], state: dict[str, Any], frontend: Any = None,
                      **resources: Any) -> dict[str, Any]:
        """Close the files; the shard's counts, native rates and the frontend's hop where its
        module says it (its rows are in ``rows.tsv``)."""
        writers["shard"].close()
        counts = {key: state.get(key, 0 if key != "dim" else None) for key in ("utterances", "frames", "samples", "dim")}
        return {**counts, "native_rates": state.get("native_rates", {}), "hop_samples": hop_samples(frontend)}

    def merge(self, shard_dirs: list[Any]) -> dict[str, Any]:
        """The split's ``feats.scp``, ``feats_shape``, ``cuts.jsonl.gz`` and summary."""
        return publish_split(self, [self.done_record(d) for d in shard_dirs])


def feature_runners(cfg: ExtractFeaturesConfig) -> list[FeatureRunner]:
    """One runner per split of ``cfg.manifests``."""
    return [FeatureRunner(cfg, split) for split in cfg.manifests]


__all__ = ["ExtractFeaturesConfig", "FeatureRunner", "build_env", "build_resources", "feature_runners"]
