"""``frontend.type: fbank``: lhotse's Kaldi-compatible log-mel filterbank on each waveform
(exact, on CPU or gathered on a GPU; the computation: :mod:`.fbank`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Mapping, Sequence

from espnet3_flows.config import to_plain
from espnet3_flows.frontends.config import Frontend, FrontendConfig, FrontendType
from espnet3_flows.frontends.wave_frontends import PerUtterance, check_cuda

if TYPE_CHECKING:
    import numpy as np

    from espnet3_flows.frontends.device_moments import FrameMoments

#: Version of the fbank computation, hashed into collect-stats shards: features that differ even
#: in float32 rounding are recomputed rather than merged with older shards. These identifiers are
#: not module paths (the modules moved from stats/): changing one recomputes every user's shards
FBANK_IMPLEMENTATION = "espnet3_flows.stats.fbank/1"


class FbankFrontend(PerUtterance):
    """lhotse's ``Fbank`` (Kaldi-compatible log-mel filterbank) on each waveform.

    Computed by :class:`~espnet3_flows.frontends.fbank.FastFbank` from lhotse's own extractor:
    the same features to float32 rounding, about 2x faster on one core. With ``device`` a GPU,
    each call's waveforms are computed there together (:meth:`FastFbank.batch`).
    """

    def __init__(self, cfg: FrontendConfig):
        self.device, self.max_batch_samples = cfg.device, cfg.max_batch_samples
        if cfg.device != "cpu":
            check_cuda(cfg.device)
        from lhotse import Fbank, FbankConfig

        from espnet3_flows.frontends.fbank import FastFbank

        self.fbank = FastFbank(Fbank(FbankConfig(sampling_rate=cfg.sampling_rate, num_mel_bins=cfg.num_mel_bins,
                                                 frame_shift=cfg.frame_shift, frame_length=cfg.frame_length,
                                                 dither=cfg.dither)))
        super().__init__(self.fbank)

    @property
    def computes_moments(self) -> bool:
        """Whether :meth:`moments` applies: on a GPU (on a CPU core each waveform alone, with its
        features handed back, is faster than gathering their frames)."""
        return self.device != "cpu"

    def moments(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any]) -> FrameMoments:
        """The moments of the waveforms' features, computed on the GPU (:meth:`FastFbank.moments`)."""
        from espnet3_flows.frontends.fbank import DEFAULT_BATCH_SAMPLES

        return self.fbank.moments(waves, self.device, self.max_batch_samples or DEFAULT_BATCH_SAMPLES)

    def __call__(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any]) -> list[np.ndarray]:
        if self.device == "cpu":
            return super().__call__(waves, kwargs)
        from espnet3_flows.frontends.fbank import DEFAULT_BATCH_SAMPLES

        return self.fbank.batch(waves, self.device, self.max_batch_samples or DEFAULT_BATCH_SAMPLES)


class FbankType(FrontendType):
    """``fbank``: lhotse's Kaldi-compatible log-mel ``Fbank`` (:class:`FbankFrontend`)."""

    name = "fbank"
    takes_conf = False
    takes_device = True

    def hashed(self, cfg: FrontendConfig, base: Mapping[str, Any]) -> dict[str, Any]:
        return {**base, "num_mel_bins": cfg.num_mel_bins, "frame_shift": cfg.frame_shift,
                "frame_length": cfg.frame_length, "dither": cfg.dither, "model": to_plain(cfg.model),
                "implementation": FBANK_IMPLEMENTATION}

    def modules(self, cfg: FrontendConfig) -> tuple[str, ...]:
        return ("lhotse",)  # its framing and config

    def own_batches(self, cfg: FrontendConfig) -> str:
        return "gathered" if cfg.device != "cpu" else ""

    def build(self, cfg: FrontendConfig) -> Frontend:
        return FbankFrontend(cfg)

    def frame_shift(self, cfg: FrontendConfig) -> float:
        return float(cfg.frame_shift)
