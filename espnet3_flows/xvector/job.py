"""The x-vector job: provider (model once per worker) and runner (length-sorted batches); its config is
:mod:`espnet3_flows.xvector.job_config`'s."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import numpy as np

from espnet3_flows.inputs.audio import load_many
from espnet3_flows.inputs.audio_config import AudioConfig
from espnet3_flows.config import ConfigError, to_plain
from espnet3_flows.errors import BadItemError
from espnet3_flows.parallel.base_runner import WHOLE_SHARD, BaseRunner
from espnet3_flows.utterance_job import (JobEnvProvider, ShardDataset, UtteranceRunner,
                                         audio_resources, audio_settings)
from espnet3_flows.xvector.config import XVectorConfig
from espnet3_flows.xvector.job_config import XVectorJobConfig
from espnet3_flows.xvector.outputs import EmbeddingWriter
from espnet3_flows.xvector.publish import publish_split


def preflight(cfg: XVectorJobConfig) -> None:
    """Driver-side check before any cluster starts: the model loads from local files."""
    check_model_source(cfg.xvector)


def check_model_source(xv: XVectorConfig) -> None:
    """On the driver, before any cluster: the model loads from local files (nothing is
    downloaded, ever), and what the toolkit needs is installed (ESPnet's speaker task for
    ``espnet`` / ``rawnet``)."""
    kit = xv.kit
    kit.check_installed(xv)
    if not kit.model_kind:
        return
    from espnet3_flows.xvector.model import XVectorModelError

    try:
        kit.model_files(xv)
    except XVectorModelError as exc:
        raise ConfigError(f"xvector.pretrained_model: {exc}") from None


def build_embedder(xv: XVectorConfig) -> Any:
    """The embedding callable of the configured toolkit, built once per worker, run in
    ``xv.precision``."""
    return with_precision(xv.kit.embedder(xv), xv.device, xv.precision)


def with_precision(embed: Any, device: str, precision: str) -> Any:
    """``embed`` (an `~espnet3_flows.xvector.model.EmbeddingModel`) called in ``precision`` on
    ``device``, its embeddings float32; its attributes (``encoder``, ``model``) kept, and ``device``
    set (where `~espnet3_flows.xvector.model.embed_waveforms` assembles the batches)."""
    import torch

    from espnet3_flows.frontends.precision import precision_scope

    def run(wavs: Any, wav_lens: Any) -> Any:
        with precision_scope(device, precision):
            out = embed(wavs, wav_lens)
        return out.float() if isinstance(out, torch.Tensor) else out

    run.__dict__.update(getattr(embed, "__dict__", {}))
    run.device = device  # type: ignore[attr-defined]
    return run


def build_resources(cfg: XVectorJobConfig, split: str) -> dict[str, Any]:
    """The resources of the x-vector ``forward``: ``embedder`` (the model, loaded once per worker),
    ``audio``, ``storage_options`` and ``model_batch`` (``dataset`` comes with each shard)."""
    xv = cfg.xvector
    batch = xv.batch_size or (16 if xv.device.startswith("cuda") else 1)
    return {**audio_resources(cfg, **xvector_audio(cfg)), "embedder": build_embedder(xv),
            "model_batch": (batch, xv.max_padded_samples)}


def xvector_audio(cfg: XVectorJobConfig) -> dict[str, Any]:
    """How the x-vector job reads audio, as :func:`audio_resources` and :func:`audio_settings` take it."""
    xv = cfg.xvector
    return {"sampling_rate": xv.sampling_rate, "channel": xv.channel, "max_duration": xv.max_duration,
            "resampler": xv.resampler, "device": xv.device}


class XVectorRunner(UtteranceRunner):
    """Per shard: one embedding per utterance as ``.pt`` files and a Kaldi ark; merge adds
    ``{tag}.{ark,scp}`` and per-speaker means ``spk_{tag}.{ark,scp}``."""

    def input_audio(self) -> tuple[str, AudioConfig]:
        return "xvector.sampling_rate", audio_settings(self.cfg, **xvector_audio(self.cfg))

    def __init__(self, cfg: XVectorJobConfig, split: str, **kwargs: Any):
        # forward receives the whole shard, so utterances are length-sorted across it
        super().__init__(cfg, split, cfg.manifests[split], JobEnvProvider(cfg, build_resources, {"split": split}),
                         shard_subdir=f"{cfg.xvector.spk_embed_tag}/{split}/shards", batch_size=WHOLE_SHARD,
                         **kwargs)

    #: ``utt2spk`` and the speaker means ``spk_{tag}.{ark,scp}`` are keyed by speaker id
    speaker_keyed_outputs = True

    #: the model file's fingerprint and ESPnet's version are facts, not choices: a model
    #: downloaded again or an upgraded ESPnet recomputes shards, it does not refuse the directory
    owner_ignores = ("split", "on_error", "fingerprint", "espnet")

    @property
    def outputs_rel(self) -> str:
        return f"{self.cfg.xvector.spk_embed_tag}/{self.split}"

    def hash_config(self) -> Mapping[str, Any]:
        xv = self.cfg.xvector
        kit = xv.kit
        model = {"toolkit": xv.toolkit, "model": to_plain(xv.model)}
        if kit.model_kind:
            model["pretrained_model"] = xv.pretrained_model
            model["fingerprint"] = _model_fingerprint(xv)
        model.update(kit.hashed(xv))
        if xv.resampler != "poly":  # only then: the shards of existing speechbrain runs keep their hashes
            model["resampler"] = xv.resampler
        if xv.precision != "float32":  # likewise
            model["precision"] = xv.precision
        return {"job": "xvector/1", "split": self.split, **model, "sampling_rate": xv.sampling_rate,
                "channel": xv.channel, "max_duration": xv.max_duration, **self.HASHED_ON_ERROR}

    @staticmethod
    def forward(idx: Any, dataset: ShardDataset, embedder: Any, audio: AudioConfig,
                storage_options: Mapping[str, Any], model_batch: tuple[int, int | None]) -> list[dict[str, Any]]:
        """Embed the utterances of ``idx`` in length-sorted batches; one record per utterance."""
        from espnet3_flows.xvector.model import embed_waveforms

        ids = idx if isinstance(idx, list) else [idx]
        utts = [dataset[i] for i in ids]
        waves = [w for w, _ in load_many(utts, audio, storage_options, dataset.audio_cache)]
        emb = embed_waveforms(embedder, waves, model_batch[0], model_batch[1], ids=[u.utt_id for u in utts])
        if not np.isfinite(emb).all():
            bad = [u.utt_id for u, e in zip(utts, emb, strict=True) if not np.isfinite(e).all()]
            raise BadItemError(f"non-finite embedding for {bad}")
        return [{"utt_id": u.utt_id, "speaker": u.speaker, "samples": len(w), "embedding": e}
                for u, w, e in zip(utts, waves, emb, strict=True)]

    # -- the shard's files and state: ESPnet3's writer hooks --
    @staticmethod
    def open_writers(shard_dir: Path, output_dir: str, outputs_rel: str, **resources: Any) -> dict[str, Any]:
        """The shard's ``utts.tsv`` and ark, and a ``.pt`` per utterance beside the split's outputs
        (see :class:`~espnet3_flows.xvector.outputs.EmbeddingWriter`)."""
        return {"shard": EmbeddingWriter(Path(shard_dir), Path(output_dir) / outputs_rel)}

    @staticmethod
    def write_record(writers: dict[str, Any], result: list[dict[str, Any]], state: dict[str, Any],
                     **resources: Any) -> None:
        """Keep the embeddings for the shard's files; count the utterances and samples."""
        writers["shard"].write(result)
        state["utterances"] = state.get("utterances", 0) + len(result)
        state["samples"] = state.get("samples", 0) + sum(int(r["samples"]) for r in result)
        for r in result:
            state["dim"] = int(np.asarray(r["embedding"]).shape[0])

    @staticmethod
    def close_writers(writers: dict[str, Any], state: dict[str, Any], **resources: Any) -> dict[str, Any]:
        """Write the shard's files; its counts and the embeddings' dimension (its rows are in
        ``utts.tsv``, its embeddings in its ark)."""
        writers["shard"].close()
        return {"utterances": state.get("utterances", 0), "samples": state.get("samples", 0),
                "dim": state.get("dim")}

    def merge(self, shard_dirs: list[Any]) -> dict[str, Any]:
        """The split's ``{tag}.{ark,scp}``, speaker means ``spk_{tag}.{ark,scp}``, ``utt2spk`` and summary."""
        return publish_split(self, [self.done_record(d) for d in shard_dirs])


def _model_fingerprint(xv: XVectorConfig) -> str:
    """Sizes and mtimes of the model's files (a changed checkpoint recomputes all); for a model
    in the hub cache, also its snapshot directory, named by the commit (a newer revision
    downloaded later recomputes all)."""
    from espnet3_flows.xvector.model import XVectorModelError

    try:
        root, files, hub = xv.kit.model_files(xv)
    except XVectorModelError:
        return "unresolved:" + xv.pretrained_model  # the preflight reports it before any shard runs
    h = hashlib.sha256(f"{xv.pretrained_model}@{root.name}".encode() if hub else b"")
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def xvector_runners(cfg: XVectorJobConfig) -> list[BaseRunner]:
    """One runner per selected split."""
    return [XVectorRunner(cfg, split) for split in cfg.selected_splits()]

