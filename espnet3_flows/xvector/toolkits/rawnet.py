"""``xvector.toolkit: rawnet``: the recipe's RawNet3, ten 3-s windows averaged (the
implementation: :mod:`espnet3_flows.xvector.rawnet3`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from espnet3_flows.config import ConfigError
from espnet3_flows.xvector.toolkits.espnet import EspnetSpeakerTask
from espnet3_flows.xvector.config import XVectorConfig


class RawnetToolkit(EspnetSpeakerTask):
    """``rawnet``: the recipe's RawNet3 (ten 3-s windows averaged)."""

    name = "rawnet"
    model_kind = "the RawNet3 weights file"

    def check(self, xv: XVectorConfig) -> None:
        if xv.sampling_rate != 16000:
            raise ConfigError(f"xvector.sampling_rate must be 16000 for toolkit rawnet (RawNet3's 3-s windows "
                              f"are at 16 kHz), got {xv.sampling_rate}")

    def model_files(self, xv: XVectorConfig) -> tuple[Path, list[Path], bool]:
        from espnet3_flows.xvector.model import XVectorModelError

        local = Path(xv.pretrained_model).expanduser()
        if not local.is_file():
            raise XVectorModelError(f"RawNet3 weights file {xv.pretrained_model!r} does not exist (the recipe's "
                                    "tools/RawNet/python/RawNet3/models/weights/model.pt)")
        return local.parent, [local], False

    def embedder(self, xv: XVectorConfig) -> Any:
        from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3, rawnet_embedder

        return rawnet_embedder(load_recipe_rawnet3(xv.pretrained_model, xv.device))
