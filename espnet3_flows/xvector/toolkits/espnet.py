"""``xvector.toolkit: espnet``: an ESPnet-SPK model as ``Speech2Embedding`` runs it (the
implementation: :mod:`espnet3_flows.xvector.espnet_spk`), and what every toolkit that runs ESPnet's
speaker task shares (:class:`EspnetSpeakerTask`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from espnet3_flows.config import ConfigError
from espnet3_flows.xvector.config import XVectorConfig, XVectorToolkit


class EspnetSpeakerTask(XVectorToolkit):
    """A toolkit that runs ESPnet's speaker task (its release is hashed into the shards)."""

    default_tag = "espnet_spk"  # tts.sh's name
    model_is_data = True  # weights_only=True, its config read with yaml.safe_load
    default_resampler = "librosa"  # as ESPnet's extract_spk_embed.py resamples

    def check_installed(self, xv: XVectorConfig) -> None:
        from espnet3_flows.xvector.espnet_spk import install_hint, missing_spk_modules

        missing = missing_spk_modules()
        if missing:
            raise ConfigError(f"xvector.toolkit={xv.toolkit} needs ESPnet's speaker task, which is not installed "
                              f"(no {', '.join(missing)}): {install_hint()}")

    def hashed(self, xv: XVectorConfig) -> dict[str, Any]:
        from espnet3_flows.frontends.espnet2_frontend import espnet_version

        return {"espnet": espnet_version()}


class EspnetToolkit(EspnetSpeakerTask):
    """``espnet``: an ESPnet-SPK model, as ``espnet2.bin.spk_inference.Speech2Embedding`` runs it."""

    name = "espnet"
    model_kind = "an ESPnet-SPK .pth with its config.yaml, a model directory, or a cached model tag"

    def model_files(self, xv: XVectorConfig) -> tuple[Path, list[Path], bool]:
        from espnet3_flows.xvector.espnet_spk import resolve_espnet_model

        files = resolve_espnet_model(xv.pretrained_model)
        return files.root, [files.config, files.weights], not Path(xv.pretrained_model).expanduser().exists()

    def embedder(self, xv: XVectorConfig) -> Any:
        from espnet3_flows.xvector.espnet_spk import espnet_embedder, load_espnet_spk_model

        return espnet_embedder(load_espnet_spk_model(xv.pretrained_model, xv.device))
