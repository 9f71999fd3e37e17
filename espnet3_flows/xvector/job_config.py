"""extract-xvectors' config (:class:`XVectorJobConfig`) and its demo's settings: plain data and
checks, read before anything of a run starts (the job is :mod:`espnet3_flows.xvector.job`; the
``xvector:`` section is :mod:`espnet3_flows.xvector.config`'s)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from espnet3_flows.config import ConfigError, check_choices, check_device
from espnet3_flows.inputs.audio_config import RESAMPLERS, check_audio_settings
from espnet3_flows.job_config import EngineConfig, SplitsConfig
from espnet3_flows.xvector.config import XVectorConfig


@dataclass
class XVectorJobConfig(EngineConfig, SplitsConfig):
    """Configuration of ``python flows/extract_xvectors.py``: ``manifests`` and ``output_dir`` as
    for every job (:class:`~espnet3_flows.job_config.SplitsConfig`), the ``xvector:`` section,
    and the engine's keys (:class:`~espnet3_flows.job_config.EngineConfig`).

    Attributes:
        manifests: Split name → manifest: a TSV (``utt_id, wav_path, text, speaker_id``), a
            lhotse ``.jsonl[.gz]`` CutSet, or a Kaldi data directory (``wav.scp`` with optional
            ``segments``, ``text``; speakers from ``utt2spk``). ``xvector.manifest_paths`` is
            the same key under ESPnet3's name.
        output_dir: Output location (path or URL); ``xvector.save_path`` is the same key under
            ESPnet3's name.
        xvector: See :class:`XVectorConfig`.
        shard_size: Mean utterances per shard, as for every job (the engine's ``shard_size``);
            128 by default here, as a shard's audio is read whole to be length-sorted into
            batches.
    """

    #: ESPnet3's x-vector recipe names (see :func:`espnet3_flows.config.rename_aliases`)
    CONFIG_ALIASES: ClassVar[dict[str, str]] = {"xvector.manifest_paths": "manifests",
                                                "xvector.save_path": "output_dir", **EngineConfig.CONFIG_ALIASES}

    output_dir: str = "exp/xvectors"
    shard_size: int = 128
    xvector: XVectorConfig = field(default_factory=XVectorConfig)

    def __post_init__(self) -> None:
        self._resolve_aliases()
        super().__post_init__()
        xv = self.xvector
        if xv.batch_size < 0:
            raise ConfigError(f"xvector.batch_size must be >= 0, got {xv.batch_size}")
        check_choices(xv, "xvector.")
        kit = xv.kit
        xv.spk_embed_tag = xv.spk_embed_tag or kit.default_tag
        xv.resampler = xv.resampler or kit.default_resampler
        if xv.resampler not in RESAMPLERS:  # (a plugin's default)
            raise ConfigError(f"xvector.resampler: toolkit {xv.toolkit}'s default {xv.resampler!r} is not one of "
                              f"{RESAMPLERS}")
        if self.is_demo:
            return  # filled in by demo_settings before the run
        if kit.model_kind and not xv.pretrained_model:
            raise ConfigError(f"xvector.pretrained_model is required for toolkit {xv.toolkit} ({kit.model_kind})")
        kit.check(xv)
        if not self.manifests:
            raise ConfigError("manifests (xvector.manifest_paths) is empty: give at least one split's manifest")
        unknown = [s for s in xv.splits if s not in self.manifests]
        if unknown:
            raise ConfigError(f"xvector.splits {unknown} have no entry in manifests (xvector.manifest_paths)")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", xv.spk_embed_tag):
            raise ConfigError(f"xvector.spk_embed_tag {xv.spk_embed_tag!r} must be a plain name (letters, digits, "
                              "'_', '-', '.'): it names a directory and files")
        try:
            check_audio_settings("xvector.", xv.sampling_rate, xv.channel, xv.max_duration)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_device(xv.device, "xvector.device")

    def _resolve_aliases(self) -> None:
        """``xvector.manifest_paths`` and ``xvector.save_path`` (ESPnet3's x-vector recipe) name
        ``manifests`` and ``output_dir``: whichever is given sets both (``save_path`` wins over
        the default ``output_dir``); two different values are an error. (Config files and
        overrides have their aliases renamed source by source before this, by ``load_config``.)"""
        xv = self.xvector
        if self.manifests and xv.manifest_paths and dict(self.manifests) != dict(xv.manifest_paths):
            raise ConfigError("manifests and xvector.manifest_paths are the same key (ESPnet3's name) but differ: "
                              f"{dict(self.manifests)} vs {dict(xv.manifest_paths)}; give one of them")
        self.manifests = dict(self.manifests or xv.manifest_paths)
        xv.manifest_paths = dict(self.manifests)
        default = type(self).__dataclass_fields__["output_dir"].default
        if xv.save_path and self.output_dir not in (default, xv.save_path):
            raise ConfigError(f"output_dir={self.output_dir!r} and xvector.save_path={xv.save_path!r} are the same key "
                              "(ESPnet3's name) but differ; give one of them")
        self.output_dir = xv.save_path = xv.save_path or self.output_dir

    @property
    def is_demo(self) -> bool:
        """No manifest and no model named: ``python flows/extract_xvectors.py`` with no arguments."""
        xv = self.xvector
        return not self.manifests and not xv.pretrained_model and xv.kit.has_demo

    def selected_splits(self) -> list[str]:
        """The splits to process."""
        return list(self.xvector.splits) or list(self.manifests)


DEMO_WARNING = ("x-vector DEMO: no manifest and no model given, so this runs on generated audio with a "
                "RANDOM-WEIGHT ECAPA-TDNN built at {model}. Its embeddings are meaningless (no training). For real "
                "x-vectors pass xvector.pretrained_model=<a speechbrain model directory, e.g. spkrec-ecapa-voxceleb "
                "downloaded with `hf download speechbrain/spkrec-ecapa-voxceleb --local-dir DIR`> and "
                "manifests.<split>=<manifest>.")


def demo_settings(cfg: XVectorJobConfig) -> dict[str, Any] | None:
    """For a config that names no manifest and no model: the demo corpus beside ``save_path``
    and a random-weight ECAPA-TDNN directory (built once, reused), with a loud warning."""
    if not cfg.is_demo:
        return None
    import sys

    from espnet3_flows.inputs.demo import demo_generated, demo_manifests, demo_root
    from espnet3_flows.inputs.settings import DEMO_UTTERANCES
    from espnet3_flows.xvector.model import HPARAMS_FILE
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    manifests = demo_manifests(cfg.output_dir, DEMO_UTTERANCES)  # collect-stats' demo corpus: the same files
    model = demo_root(cfg.output_dir) / "ecapa-random-weights"
    if demo_generated():  # (not in a dry run: it writes nothing)
        if not (model / HPARAMS_FILE).is_file():
            build_random_ecapa_dir(model)
        print(f"warning: {DEMO_WARNING.format(model=model)}", file=sys.stderr)
    return {"manifests": manifests, "xvector": {"manifest_paths": manifests, "pretrained_model": str(model)}}
