"""``peak_levels``: a lab's own job (entry point ``espnet3_flows.jobs``): each utterance's peak
absolute sample, one ``<split>/peaks.tsv`` per split, sorted by utterance id. Built as
``docs/adding-a-job.md`` says, from the product's job contract only."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from espnet3_flows.inputs.audio import load_many
from espnet3_flows.job_registry import JobSpec
from espnet3_flows.parallel.results import shard_summary
from espnet3_flows.split_outputs import publish_split_files
from espnet3_flows.utterance_job import EngineConfig, InputsConfig, JobEnvProvider, UtteranceRunner, audio_resources


@dataclass
class PeakConfig(EngineConfig, InputsConfig):
    """Configuration of peak-levels.

    Attributes:
        output_dir: Where each split's ``peaks.tsv`` goes.
        sampling_rate: Rate the audio is read at (other rates are resampled).
    """

    output_dir: str = "exp/peaks"
    sampling_rate: int = 16000


def build_resources(cfg: PeakConfig) -> dict[str, Any]:
    """``audio`` and ``storage_options``, once per worker."""
    return audio_resources(cfg, cfg.sampling_rate, None, None)


class PeakRunner(UtteranceRunner):
    """Per shard, ``peaks.tsv``: ``utt_id<TAB>peak``."""

    def __init__(self, cfg: PeakConfig, split: str):
        super().__init__(cfg, split, cfg.manifests[split], JobEnvProvider(cfg, build_resources), batch_size=cfg.batch_size)

    def hash_config(self) -> dict[str, Any]:
        return {"job": "peak_levels/1", "split": self.split, "sampling_rate": self.cfg.sampling_rate}

    @staticmethod
    def forward(idx: Any, dataset: Any, audio: Any, storage_options: Any) -> list[tuple[str, float]]:
        utts = [dataset[i] for i in (idx if isinstance(idx, list) else [idx])]
        waves = load_many(utts, audio, storage_options, dataset.audio_cache)
        return [(u.utt_id, float(abs(w).max())) for u, (w, _) in zip(utts, waves, strict=True)]

    @staticmethod
    def open_writers(shard_dir: Path, **env: Any) -> dict[str, Any]:
        return {"peaks": open(Path(shard_dir) / "peaks.tsv", "w", encoding="utf-8")}  # closed by close_writers

    @staticmethod
    def write_record(writers: dict[str, Any], result: list[tuple[str, float]], state: dict[str, Any], **env: Any) -> None:
        for utt, peak in result:
            writers["peaks"].write(f"{utt}\t{peak!r}\n")
        state["utterances"] = state.get("utterances", 0) + len(result)

    @staticmethod
    def close_writers(writers: dict[str, Any], state: dict[str, Any], **env: Any) -> dict[str, Any]:
        writers["peaks"].close()
        return {"utterances": state.get("utterances", 0)}

    def merge(self, shard_dirs: list[Any]) -> dict[str, Any]:
        store, results = self.storage, [self.done_record(d) for d in shard_dirs]
        lines = sorted(line for r in results
                       for line in store.read_bytes(r.file("peaks.tsv")).decode("utf-8").splitlines())
        with tempfile.TemporaryDirectory() as stage:
            path = Path(stage) / "peaks.tsv"
            path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
            summary = {"split": self.split, "utterances": len(lines), **shard_summary([r.status() for r in results])}
            skipped = self.manifest_skipped()
            return publish_split_files(store, self.outputs_rel, [("peaks.tsv", path)], skipped, summary)


def peak_runners(cfg: PeakConfig) -> list[PeakRunner]:
    """One runner per split of ``cfg.manifests``."""
    return [PeakRunner(cfg, split) for split in cfg.manifests]


JOB = JobSpec(
    name="peak_levels",
    title="peak-levels",
    description="Each utterance's peak absolute sample, one peaks.tsv per split.",
    schema="lab_plugins.jobs:PeakConfig",
    runners="lab_plugins.jobs:peak_runners",
    worker_modules=("numpy", "soundfile"),
)
