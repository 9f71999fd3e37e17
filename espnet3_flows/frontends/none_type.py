"""``frontend.type: none``: lengths only (audio headers are read, nothing is decoded or extracted)."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from espnet3_flows.frontends.config import FrontendConfig, FrontendType


class NoFrontend(FrontendType):
    """``none``: lengths only (audio headers are read, nothing is decoded or extracted)."""

    name = "none"
    takes_conf = False
    computes_features = False

    def hashed(self, cfg: FrontendConfig, base: Mapping[str, Any]) -> dict[str, Any]:
        return {"type": "none", "sampling_rate": cfg.sampling_rate, "max_duration": cfg.max_duration}

    def modules(self, cfg: FrontendConfig) -> tuple[str, ...]:
        return ()

    def build(self, cfg: FrontendConfig) -> None:
        return None
