"""extract-features' config: plain data, read before anything of a run starts (the job is
:mod:`espnet3_flows.features.job`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from espnet3_flows.config import ConfigError
from espnet3_flows.frontends.config import FrontendConfig
from espnet3_flows.job_config import EngineConfig, InputsConfig


@dataclass
class ExtractFeaturesConfig(EngineConfig, InputsConfig):
    """Configuration of extract-features (``python flows/extract_features.py`` takes these keys):
    the input keys (:class:`~espnet3_flows.job_config.InputsConfig`), the engine's
    (:class:`~espnet3_flows.job_config.EngineConfig`) and these.

    Attributes:
        output_dir: Where outputs go (path or fsspec URL). Per split: ``feats.scp``,
            ``feats_shape``, ``cuts.jsonl.gz``, ``feats/feats.<shard>.ark``, ``skipped.tsv``,
            ``summary.json``.
        frontend: Feature extraction, as for collect-stats (see
            :class:`~espnet3_flows.frontends.config.FrontendConfig`): ``fbank``, ``espnet2`` or
            ``model`` (``none`` computes no features and is refused). The cuts' ``frame_shift``
            is ``frontend.frame_shift`` for ``fbank``, ``hop_length / fs`` for the ESPnet2
            ``default`` frontend, and the hop the built frontend's module states for the other
            ESPnet2 frontends (``s3prl``, ``fused``, ...) and for a ``model`` with a
            ``hop_length`` (or a ``frontend`` with one); else ``frontend.frame_shift`` (set it to
            the model's hop, e.g. ``0.02`` for HuBERT): see
            :func:`~espnet3_flows.features.outputs.frame_shift_seconds`.
    """

    output_dir: str = "exp/features"
    frontend: FrontendConfig = field(default_factory=FrontendConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.frontend.kind.computes_features:
            raise ConfigError(f"frontend.type={self.frontend.type} computes no features; extract-features needs a type "
                              "that does (fbank, espnet2, model or a plugin's)")
