"""ESPnet2 frontends by name (``frontend.type: espnet2``), configured as in an ESPnet2 ``asr.yaml``.

``frontend.name`` and ``frontend.conf`` are an ``asr.yaml``'s ``frontend`` and ``frontend_conf``
(paste yours), or ``frontend.espnet_config`` names a trained model's ``config.yaml`` to read them
from. The frontend is ESPnet2's own class, so the features are the ones the model was trained on
(``tests/frontends/test_espnet2_frontend.py`` checks the statistics against ESPnet2's
``collect_stats``); ``default``'s features are computed by
:mod:`~espnet3_flows.frontends.espnet2_default` unless ``frontend.espnet2_class`` (the same
features to float32 rounding, faster).

ESPnet is an optional dependency: ``pip install 'espnet3-flows[espnet]'`` installs what its
frontends import, and ``pip install --no-deps espnet==202511`` ESPnet itself (pip cannot resolve
ESPnet's full dependency list: ``ci_sdr`` declares a git URL dependency that pip refuses from an
index). ``make install EXTRAS=dev,espnet`` does both.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any
from collections.abc import Mapping

from espnet3_flows.config import ConfigError

#: ``frontend.name`` → ESPnet2 class: the names of ESPnet2's ``asr`` task (``frontend_choices``)
ESPNET2_FRONTENDS = {
    "default": "espnet2.asr.frontend.default.DefaultFrontend",
    "sliding_window": "espnet2.asr.frontend.windowing.SlidingWindow",
    "s3prl": "espnet2.asr.frontend.s3prl.S3prlFrontend",
    "espnet_ssl": "espnet2.asr.frontend.espnet_ssl.ESPnetSSLFrontend",
    "fused": "espnet2.asr.frontend.fused.FusedFrontends",
    "whisper": "espnet2.asr.frontend.whisper.WhisperFrontend",
    "huggingface": "espnet2.asr.frontend.huggingface.HuggingFaceFrontend",
    "wav2vec_cnn": "espnet2.asr.frontend.cnn.CNNFrontend",
}
INSTALL_HINT = ("pip install 'espnet3-flows[espnet]' && pip install --no-deps espnet==202511 "
                "(or: make install EXTRAS=dev,espnet)")


@functools.cache
def espnet_version() -> str:
    """The installed ESPnet's version (part of shard hashes: another ESPnet may compute other features)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("espnet")
    except PackageNotFoundError:
        return "unknown"


def check_espnet_installed() -> None:
    """Raise :class:`ConfigError` naming the extra when ESPnet2 cannot be imported."""
    if importlib.util.find_spec("espnet2") is None:
        raise ConfigError(f"frontend.type=espnet2 needs ESPnet2, which is not installed: {INSTALL_HINT}")


def parse_fs(fs: Any) -> int:
    """A sampling rate as ESPnet2 writes it: ``16000``, ``"16000"`` or ``"16k"``."""
    text = str(fs).strip().lower()
    try:
        value = float(text[:-1]) * 1000 if text.endswith("k") else float(text)
    except ValueError:
        raise ConfigError(f"frontend fs {fs!r} is not a sampling rate (16000 or 16k)") from None
    if abs(value - round(value)) < 1e-6:  # "22.05k": 22050.000000000004 in binary floating point
        value = float(round(value))
    if value <= 0 or value != int(value):
        raise ConfigError(f"frontend fs {fs!r} is not a sampling rate (16000 or 16k)")
    return int(value)


def load_espnet_config(path: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A trained ESPnet2 model's ``config.yaml`` as a dict.

    Raises:
        ConfigError: the file is missing or not a YAML mapping.
    """
    import fsspec
    import yaml

    try:
        with fsspec.open(path, "r", encoding="utf-8", **dict(storage_options or {})) as f:
            cfg = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"frontend.espnet_config: {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"frontend.espnet_config: {path} is not YAML: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"frontend.espnet_config: {path} is not an ESPnet2 config (a YAML mapping)")
    return cfg


def read_espnet_config(path: str, storage_options: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """``(frontend, frontend_conf)`` of a trained ESPnet2 model's ``config.yaml``.

    Raises:
        ConfigError: the file is missing or not YAML, or its model has no frontend.
    """
    cfg = load_espnet_config(path, storage_options)
    name = cfg.get("frontend")
    if not name:
        raise ConfigError(f"frontend.espnet_config: {path} has no frontend (`frontend: {name}`): its model reads "
                          "features, not audio; compute them with the frontend that made them")
    conf = cfg.get("frontend_conf") or {}
    if not isinstance(conf, dict):
        raise ConfigError(f"frontend.espnet_config: {path}: frontend_conf is not a mapping")
    return str(name), dict(conf)


def check_name(name: str) -> None:
    """Raise :class:`ConfigError` for a frontend name ESPnet2's ``asr`` task does not know."""
    if name not in ESPNET2_FRONTENDS:
        raise ConfigError(f"frontend.name {name!r} is not an ESPnet2 frontend; one of {sorted(ESPNET2_FRONTENDS)}")


def build_espnet2_frontend(name: str, conf: Mapping[str, Any]) -> Any:
    """ESPnet2's frontend ``name`` built from ``conf`` (``frontend_conf``), in eval mode.

    Raises:
        ConfigError: ESPnet2 is missing, or the class rejects ``conf`` (naming the keys).
    """
    check_espnet_installed()
    check_name(name)
    module_name, _, cls_name = ESPNET2_FRONTENDS[name].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except ImportError as exc:
        raise ConfigError(f"ESPnet2's {name!r} frontend ({module_name}) cannot be imported: {exc}; "
                          f"for 'default': {INSTALL_HINT}") from exc
    try:
        frontend = cls(**dict(conf))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"frontend.conf does not fit ESPnet2's {cls_name}: {exc}") from None
    except Exception as exc:
        if type(exc).__name__ != "TypeCheckError":  # typeguard's (its classes' @typechecked), not a TypeError
            raise
        raise ConfigError(f"frontend.conf does not fit ESPnet2's {cls_name}: {exc}") from None
    return frontend.eval()
