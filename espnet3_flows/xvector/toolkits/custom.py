"""``xvector.toolkit: custom``: the callable ``xvector.model`` builds (``{_target_: pkg.factory, ...}``)."""

from __future__ import annotations

from typing import Any

from espnet3_flows.config import ConfigError, check_targets, instantiate
from espnet3_flows.xvector.config import XVectorConfig, XVectorToolkit


class CustomToolkit(XVectorToolkit):
    """``custom``: the callable ``xvector.model`` builds (``{_target_: pkg.factory, ...}``)."""

    name = "custom"

    def check(self, xv: XVectorConfig) -> None:
        if "_target_" not in xv.model:
            raise ConfigError("xvector.toolkit=custom needs xvector.model._target_")
        check_targets(xv.model, "xvector.model")

    def hashed(self, xv: XVectorConfig) -> dict[str, Any]:
        return {}

    def embedder(self, xv: XVectorConfig) -> Any:
        return instantiate(xv.model, "xvector.model")
