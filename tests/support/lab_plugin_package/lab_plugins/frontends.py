"""``frontend.type: log_energy``: the log energy of each frame of ``frontend.conf.frame`` samples."""

from __future__ import annotations

import functools

import numpy as np

from espnet3_flows.config import ConfigError
from espnet3_flows.frontends.config import FrontendType
from espnet3_flows.frontends.wave_frontends import PerUtterance


def log_energy(wave: np.ndarray, frame: int) -> np.ndarray:
    """``(frames, 1)`` float32: log of each whole frame's energy."""
    frames = len(wave) // frame
    blocks = wave[: frames * frame].astype(np.float64).reshape(frames, frame)
    return np.log((blocks ** 2).sum(axis=1) + 1e-10)[:, None].astype(np.float32)


class LogEnergy(FrontendType):
    name = "log_energy"
    version = "1"

    def check(self, cfg):
        frame = dict(cfg.conf).get("frame", 400)
        if not isinstance(frame, int) or frame <= 0:
            raise ConfigError(f"frontend.conf.frame: a positive number of samples, got {frame!r}")

    def build(self, cfg):
        return PerUtterance(functools.partial(log_energy, frame=int(dict(cfg.conf).get("frame", 400))))
