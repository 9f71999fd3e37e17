"""``frontend.type: espnet2``, declared for the frontend registry: ESPnet2's frontend by name
(:mod:`.espnet2_frontend`), or its ``default`` computed by :mod:`.espnet2_default`."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from espnet3_flows.config import ConfigError, to_plain
from espnet3_flows.frontends import espnet2_frontend as espnet2_module
from espnet3_flows.frontends.espnet2_frontend import (ESPNET2_FRONTENDS, build_espnet2_frontend, check_espnet_installed,
                                                      check_name, parse_fs, read_espnet_config)
from espnet3_flows.frontends.config import Frontend, FrontendConfig, FrontendType
from espnet3_flows.frontends.wave_frontends import PerUtterance, espnet2_frontend, torch_batching

#: Version of the fast path of ESPnet2's ``default`` frontend (its features differ from the class's in
#: float32 rounding, so its shards are not merged with the class's)
ESPNET2_DEFAULT_IMPLEMENTATION = "espnet3_flows.frontends.espnet2_default/1"


def fast_default(cfg: FrontendConfig) -> bool:
    """Whether ESPnet2's ``default`` frontend runs as
    :class:`~espnet3_flows.frontends.espnet2_default.FastDefaultFrontend` (``espnet2_class`` off,
    on the CPU in float32, every ``conf`` option covered)."""
    if cfg.name != "default" or cfg.espnet2_class or cfg.device != "cpu" or cfg.precision != "float32":
        return False
    from espnet3_flows.frontends.espnet2_default import read_default_conf

    return read_default_conf(cfg.conf)[0] is not None


class Espnet2Type(FrontendType):
    """``espnet2``: ESPnet2's frontend by ``frontend.name`` with ``frontend.conf`` (an ``asr.yaml``'s
    ``frontend`` and ``frontend_conf``, or a trained model's ``frontend.espnet_config``)."""

    name = "espnet2"
    takes_device = True
    takes_precision = True
    takes_espnet2_options = True

    def check(self, cfg: FrontendConfig) -> None:
        """Fill ``name`` and ``conf`` from ``espnet_config``; ``fs`` sets ``sampling_rate``."""
        check_espnet_installed()
        base_name, base_conf = "", {}
        if cfg.espnet_config:
            base_name, base_conf = read_espnet_config(cfg.espnet_config)
        if cfg.name and base_name and cfg.name != base_name:
            raise ConfigError(f"frontend.name={cfg.name} but {cfg.espnet_config} says frontend: {base_name}")
        cfg.name = cfg.name or base_name or "default"
        check_name(cfg.name)
        cfg.conf = {**base_conf, **to_plain(cfg.conf)}
        if "fs" in cfg.conf:
            cfg.sampling_rate = parse_fs(cfg.conf["fs"])
        if cfg.name == "default" and not cfg.espnet2_class and cfg.device == "cpu":
            from espnet3_flows.frontends.espnet2_default import warn_uncovered

            warn_uncovered(cfg.conf)

    def hashed(self, cfg: FrontendConfig, base: Mapping[str, Any]) -> dict[str, Any]:
        espnet = {**base, "name": cfg.name, "conf": to_plain(cfg.conf), "espnet": espnet2_module.espnet_version()}
        if fast_default(cfg):
            return {**espnet, "implementation": ESPNET2_DEFAULT_IMPLEMENTATION}
        return {**espnet, **torch_batching(cfg)}

    def modules(self, cfg: FrontendConfig) -> tuple[str, ...]:
        """ESPnet2's frontend module (and librosa's mel filters, which ``default`` and ``fused``
        build: ~0.7 s of scipy and numba imports); ``default``'s fast path needs only torch and
        its own module (and ESPnet2's for the probe of an ESPnet release it was not checked against)."""
        name = cfg.name or "default"  # (an espnet_config's name is in cfg.name already)
        path = ESPNET2_FRONTENDS.get(name)
        if path is None:
            return ()
        espnet2 = (path.rpartition(".")[0], *(("librosa.filters",) if name in ("default", "fused") else ()))
        if fast_default(cfg):
            from espnet3_flows.frontends.espnet2_default import VERIFIED_ESPNET

            fast = ("torch", "espnet3_flows.frontends.espnet2_default")
            return fast if espnet2_module.espnet_version() in VERIFIED_ESPNET else (*fast, *espnet2)  # (the latter for its probe)
        return espnet2

    def own_batches(self, cfg: FrontendConfig) -> str:
        return "padded" if cfg.max_batch_samples > 0 and not fast_default(cfg) else ""

    def label(self, cfg: FrontendConfig) -> str:
        return f"espnet2-{cfg.name}"

    def frame_shift(self, cfg: FrontendConfig) -> float | None:
        """``hop_length / fs`` of ``default`` (ESPnet2's default hop: 128 samples); the others'
        hop is the built frontend's (an ``s3prl`` upstream's downsampling, ``fused``'s common hop)."""
        if cfg.name != "default":
            return None
        return float(cfg.conf.get("hop_length", 128)) / cfg.sampling_rate

    def build(self, cfg: FrontendConfig) -> Frontend:
        if fast_default(cfg):
            from espnet3_flows.frontends.espnet2_default import build_fast_default

            fast = build_fast_default(cfg.conf)
            if fast is not None:
                return PerUtterance(fast)
        return espnet2_frontend(build_espnet2_frontend(cfg.name, cfg.conf), cfg.device, cfg.max_batch_samples,
                                cfg.precision, cfg.bucket_shapes)
