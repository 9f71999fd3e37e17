"""Builds ESPnet-SPK models and recipe RawNet3 weights with random weights, offline: tests and
benchmarks run ``toolkit: espnet`` / ``rawnet`` with them. Their embeddings are meaningless (no
training): never use one for real speaker work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: ``config.yaml`` sections of ESPnet's VoxCeleb speaker recipes (``egs2/voxceleb/spk1``), at a
#: small size unless ``full_size``: RawNet3 on the asteroid sinc frontend, ECAPA-TDNN on mel features
_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "rawnet3": {"frontend": "asteroid_frontend",
                "frontend_conf": {"sinc_stride": 16, "sinc_kernel_size": 251, "sinc_filters": 256,
                                  "preemph_coef": 0.97, "log_term": 1.0e-06},
                "encoder": "rawnet3", "encoder_conf": {"model_scale": 8, "ndim": 1024, "output_size": 1536}},
    "ecapa_tdnn": {"frontend": "melspec_torch",
                   "frontend_conf": {"preemp": True, "n_fft": 512, "log": True, "win_length": 400, "hop_length": 160,
                                     "n_mels": 80, "normalize": "mn"},
                   "encoder": "ecapa_tdnn", "encoder_conf": {"model_scale": 8, "ndim": 1024, "output_size": 1536}},
}
_SMALL = {"rawnet3": {"frontend_conf": {"sinc_filters": 32}, "encoder_conf": {"model_scale": 4, "ndim": 32,
                                                                                "output_size": 48}},
          "ecapa_tdnn": {"frontend_conf": {"n_mels": 24}, "encoder_conf": {"model_scale": 4, "ndim": 32,
                                                                            "output_size": 48}}}


def _randomize_batch_norms(model: torch.nn.Module) -> None:
    """Give every batch norm non-trivial running statistics, as training would (so that tests see them)."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)


def spk_config(architecture: str = "rawnet3", full_size: bool = False, embed_dim: int | None = None,
               n_speakers: int = 4) -> dict[str, Any]:
    """An ESPnet speaker task ``config.yaml`` (the keys ``SpeakerTask.build_model`` reads) for
    ``architecture`` (``rawnet3`` or ``ecapa_tdnn``), with ``chn_attn_stat`` pooling and a
    ``rawnet3`` projector to ``embed_dim`` (192 full size, 16 small)."""
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(_ARCHITECTURES)}, got {architecture!r}")
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in _ARCHITECTURES[architecture].items()}
    if not full_size:
        for key, conf in _SMALL[architecture].items():
            config[key] = {**config[key], **conf}
    config.update(specaug=None, specaug_conf={}, normalize=None, normalize_conf={}, pooling="chn_attn_stat",
                  pooling_conf={}, projector="rawnet3",
                  projector_conf={"output_size": embed_dim or (192 if full_size else 16)},
                  loss="aamsoftmax", loss_conf={"margin": 0.3, "scale": 15}, spk_num=n_speakers, init=None,
                  input_size=None, use_preprocessor=True, target_duration=3.0, sample_rate=16000)
    return config


def build_random_espnet_spk(dst: Path, architecture: str = "rawnet3", full_size: bool = False, seed: int = 0,
                            **config: Any) -> Path:
    """Write ``dst/config.yaml`` and ``dst/model.pth`` (ESPnet's layout of a trained speaker model)
    with random weights; ``config`` overrides `spk_config`'s arguments. Returns the ``.pth`` path."""
    import argparse

    import yaml

    from espnet3_flows.xvector.espnet_spk import import_speaker_task

    conf = spk_config(architecture, full_size, **config)
    torch.manual_seed(seed)
    model = import_speaker_task().build_model(argparse.Namespace(**conf))
    _randomize_batch_norms(model)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.yaml").write_text(yaml.safe_dump(conf, sort_keys=False), encoding="utf-8")
    torch.save(model.state_dict(), dst / "model.pth")
    return dst / "model.pth"


def build_random_rawnet3(path: Path, channels: int = 32, scale: int = 4, frame_dim: int = 48, embed_dim: int = 16,
                         seed: int = 0, full_size: bool = False) -> Path:
    """Write RawNet3 weights as the recipe's ``model.pt`` holds them (``{"model": state_dict}``),
    random; ``full_size``: the recipe's sizes (1024 channels, scale 8, 1536, 256-d). Returns ``path``."""
    from espnet3_flows.xvector.rawnet3 import RecipeRawNet3

    torch.manual_seed(seed)
    model = RecipeRawNet3(1024, 8, 1536, 256) if full_size else RecipeRawNet3(channels, scale, frame_dim, embed_dim)
    _randomize_batch_norms(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict()}, path)
    return path
