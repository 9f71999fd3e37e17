"""``frontend.type: model``: any torch module built from ``frontend.model`` with ESPnet's
``collect_feats(speech, speech_lengths, **kwargs)``, run over padded batches."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from espnet3_flows.config import ConfigError, check_targets, instantiate, to_plain
from espnet3_flows.frontends.config import Frontend, FrontendConfig, FrontendType
from espnet3_flows.frontends.wave_frontends import TorchFrontend, torch_batching


def model_frontend(model: Any, device: str = "cpu", max_batch_samples: int = 0,
                   precision: str = "float32", bucket_shapes: bool = False) -> TorchFrontend:
    """A frontend from any torch module with ESPnet's ``collect_feats(speech, speech_lengths, **kwargs)``."""
    if not hasattr(model, "collect_feats"):
        raise ConfigError(f"{type(model).__name__} has no collect_feats(speech, speech_lengths, **kwargs)")

    def extract(speech: Any, lengths: Any, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        out = model.collect_feats(speech=speech, speech_lengths=lengths, **dict(kwargs))
        return out["feats"], out.get("feats_lengths")

    return TorchFrontend(extract, model, device, max_batch_samples, precision, bucket_shapes)


class ModelType(FrontendType):
    """``model``: any torch module built from ``frontend.model`` with ESPnet's ``collect_feats``."""

    name = "model"
    takes_conf = False
    takes_device = True
    takes_precision = True

    def check(self, cfg: FrontendConfig) -> None:
        if "_target_" not in cfg.model:
            raise ConfigError("frontend.type=model needs frontend.model._target_ (a class path)")
        check_targets(cfg.model, "frontend.model")

    def hashed(self, cfg: FrontendConfig, base: Mapping[str, Any]) -> dict[str, Any]:
        return {**base, "model": to_plain(cfg.model), **torch_batching(cfg)}

    def modules(self, cfg: FrontendConfig) -> tuple[str, ...]:
        target = str((cfg.model or {}).get("_target_") or "")
        return (target.rpartition(".")[0],) if "." in target else ()

    def own_batches(self, cfg: FrontendConfig) -> str:
        return "padded" if cfg.max_batch_samples > 0 else ""

    def build(self, cfg: FrontendConfig) -> Frontend:
        return model_frontend(instantiate(cfg.model, "frontend.model"), cfg.device, cfg.max_batch_samples,
                              cfg.precision, cfg.bucket_shapes)
