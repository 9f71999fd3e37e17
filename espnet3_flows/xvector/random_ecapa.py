"""Builds offline speechbrain ECAPA-TDNN model directories with random weights: the x-vector demo,
tests and benchmarks run the whole pipeline with them without a download. Their embeddings are
meaningless (no training): never use one for real speaker work."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Sequence

import torch

SMALL_CHANNELS: tuple[int, ...] = (64, 64, 64, 64, 192)
FULL_CHANNELS: tuple[int, ...] = (1024, 1024, 1024, 1024, 3072)
N_MELS = 80

# The layout mirrors speechbrain/spkrec-ecapa-voxceleb. `pretrained_path` is a top-level key so that
# a loader can point it at wherever the directory lives now; every loadable has an explicit path,
# because without one a missing label encoder is skipped silently.
_HYPERPARAMS = """\
# Random-weight ECAPA-TDNN written by espnet3_flows/xvector/random_ecapa.py (seed {seed}); NOT a trained model:
# its embeddings carry no speaker information. For trying the pipeline offline only.
pretrained_path: {pretrained_path}

sample_rate: {sample_rate}
n_mels: {n_mels}
emb_dim: {lin_neurons}
n_speakers: {n_speakers}

compute_features: !new:speechbrain.lobes.features.Fbank
    n_mels: !ref <n_mels>
    sample_rate: !ref <sample_rate>

mean_var_norm: !new:speechbrain.processing.features.InputNormalization
    norm_type: sentence
    std_norm: False

embedding_model: !new:speechbrain.lobes.models.ECAPA_TDNN.ECAPA_TDNN
    input_size: !ref <n_mels>
    channels: {channels}
    kernel_sizes: [5, 3, 3, 3, 1]
    dilations: [1, 2, 3, 4, 1]
    attention_channels: {attention_channels}
    se_channels: {se_channels}
    lin_neurons: !ref <emb_dim>

classifier: !new:speechbrain.lobes.models.ECAPA_TDNN.Classifier
    input_size: !ref <emb_dim>
    out_neurons: !ref <n_speakers>

mean_var_norm_emb: !new:speechbrain.processing.features.InputNormalization
    norm_type: global
    std_norm: False

modules:
    compute_features: !ref <compute_features>
    mean_var_norm: !ref <mean_var_norm>
    embedding_model: !ref <embedding_model>
    mean_var_norm_emb: !ref <mean_var_norm_emb>
    classifier: !ref <classifier>

label_encoder: !new:speechbrain.dataio.encoder.CategoricalEncoder

pretrainer: !new:speechbrain.utils.parameter_transfer.Pretrainer
    loadables:
        embedding_model: !ref <embedding_model>
        mean_var_norm_emb: !ref <mean_var_norm_emb>
        classifier: !ref <classifier>
        label_encoder: !ref <label_encoder>
    paths:
        embedding_model: !ref <pretrained_path>/embedding_model.ckpt
        mean_var_norm_emb: !ref <pretrained_path>/mean_var_norm_emb.ckpt
        classifier: !ref <pretrained_path>/classifier.ckpt
        label_encoder: !ref <pretrained_path>/label_encoder.txt
"""


def build_random_ecapa_dir(
    dst: Path,
    channels: Sequence[int] = SMALL_CHANNELS,
    lin_neurons: int = 192,
    n_speakers: int = 4,
    seed: int = 0,
    sample_rate: int = 16000,
    full_size: bool = False,
    pretrained_path: str | None = None,
) -> Path:
    """Write a loadable speechbrain ECAPA-TDNN directory with random weights into ``dst``.

    ``full_size=True`` overrides ``channels`` / ``lin_neurons`` with the architecture of
    speechbrain/spkrec-ecapa-voxceleb (1024 channels, 192-dim embeddings, ~20.8 M parameters).
    ``pretrained_path`` is written into hyperparams.yaml (default: ``dst`` resolved); pass a hub id
    to reproduce the layout of a directory downloaded from the Hugging Face Hub.
    Returns ``dst``.
    """
    from speechbrain.dataio.encoder import CategoricalEncoder
    from speechbrain.lobes.models.ECAPA_TDNN import ECAPA_TDNN, Classifier

    if full_size:
        channels, lin_neurons = FULL_CHANNELS, 192
    channels = [int(c) for c in channels]
    if len(channels) != 5:
        raise ValueError(f"ECAPA-TDNN needs 5 channel sizes, got {channels}")
    side_channels = 128 if full_size else min(128, max(16, channels[0] // 2))
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    embedding_model = ECAPA_TDNN(
        input_size=N_MELS,
        channels=channels,
        kernel_sizes=[5, 3, 3, 3, 1],
        dilations=[1, 2, 3, 4, 1],
        attention_channels=side_channels,
        se_channels=side_channels,
        lin_neurons=lin_neurons,
    )
    classifier = Classifier(input_size=lin_neurons, out_neurons=n_speakers)
    torch.save(embedding_model.state_dict(), dst / "embedding_model.ckpt")
    torch.save(classifier.state_dict(), dst / "classifier.ckpt")
    # The format of InputNormalization._save for norm_type="global".
    torch.save(
        {"count": 1, "glob_mean": torch.zeros(lin_neurons), "glob_std": torch.ones(lin_neurons)},
        dst / "mean_var_norm_emb.ckpt",
    )
    label_encoder = CategoricalEncoder()
    label_encoder.update_from_iterable([f"spk{i}" for i in range(n_speakers)])
    label_encoder.save(dst / "label_encoder.txt")

    (dst / "hyperparams.yaml").write_text(
        _HYPERPARAMS.format(
            seed=seed,
            pretrained_path=pretrained_path or str(dst.resolve()),
            sample_rate=sample_rate,
            n_mels=N_MELS,
            lin_neurons=lin_neurons,
            n_speakers=n_speakers,
            channels=channels,
            attention_channels=side_channels,
            se_channels=side_channels,
        ),
        encoding="utf-8",
    )
    return dst
