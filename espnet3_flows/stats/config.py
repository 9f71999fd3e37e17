"""collect-stats' config: plain data, read before anything of a run starts (the job is
:mod:`espnet3_flows.stats.job`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from espnet3_flows.frontends.config import FrontendConfig
from espnet3_flows.job_config import EngineConfig, InputsConfig
from espnet3_flows.stats.tokens import TokenConfig

#: ``collected_feats_format``: Kaldi ark/scp, or one ``.npy`` per utterance as ESPnet2 writes them
COLLECTED_FEATS_FORMATS = ("ark", "npy")


@dataclass
class CollectStatsConfig(EngineConfig, InputsConfig):
    """Configuration of collect-stats (``python flows/collect_stats.py`` takes these keys): the
    input keys (:class:`~espnet3_flows.job_config.InputsConfig`), the engine's
    (:class:`~espnet3_flows.job_config.EngineConfig`) and these.

    Attributes:
        output_dir: Where outputs go (path or fsspec URL such as ``s3://bucket/stats``).
        frontend: Feature extraction (see :class:`FrontendConfig`).
        write_collected_feats: Also write the features (``collect_feats/feats.scp``).
        collected_feats_format: ``ark`` (Kaldi ark/scp, one ark per shard) or ``npy`` (one
            ``collect_feats/data_feats/<utt>.npy`` per utterance and an scp of their paths, as
            ESPnet2's ``collect_stats --write_collected_feats true`` writes them and its
            ``NpyScpReader`` reads them).
        collect_stats_kwargs: Extra keyword arguments for ``model.collect_feats``.
        tokens: Token counts of the transcripts for ESPnet2's ``text_shape`` (see
            :class:`~espnet3_flows.stats.tokens.TokenConfig`); read from ``frontend.espnet_config``
            when that names a model with a ``token_type``.
    """

    output_dir: str = "exp/collect_stats"
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    write_collected_feats: bool = False
    collected_feats_format: str = field(default="ark", metadata={"choices": COLLECTED_FEATS_FORMATS})
    collect_stats_kwargs: dict[str, Any] = field(default_factory=dict)
    tokens: TokenConfig = field(default_factory=TokenConfig)

    def __post_init__(self) -> None:
        super().__post_init__()  # checks collected_feats_format against its choices too
        if self.frontend.espnet_config and not self.tokens.token_type:
            from espnet3_flows.frontends.espnet2_frontend import load_espnet_config

            self.tokens.fill_from_espnet_config(load_espnet_config(self.frontend.espnet_config))
