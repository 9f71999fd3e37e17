"""Feature frontends shared by the jobs: lhotse fbank, lengths only, any model with
``collect_feats``, or an ESPnet2 frontend by name; model frontends on CPU or a GPU; and
:func:`extract_features`, the one way a job runs a frontend over utterances."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from espnet3_flows.frontends.checked import CheckedFeatures
from espnet3_flows.frontends.config import (  # noqa: F401 - importable from here too
    FRONTEND_TYPES,
    FRONTENDS,
    Frontend,
    FrontendConfig,
    FrontendType,
)
from espnet3_flows.frontends.device_moments import Moments
from espnet3_flows.frontends.espnet2_type import ESPNET2_DEFAULT_IMPLEMENTATION  # noqa: F401 - importable from here too
from espnet3_flows.frontends.fbank_type import FBANK_IMPLEMENTATION, FbankFrontend  # noqa: F401 - importable from here too
from espnet3_flows.frontends.model_type import model_frontend  # noqa: F401 - importable from here too
from espnet3_flows.frontends.wave_frontends import (  # noqa: F401 - importable from here too
    TORCH_FRONTEND_IMPLEMENTATION,
    PerUtterance,
    TorchFrontend,
    check_cuda,
    espnet2_frontend,
)


def frontend_modules(cfg: FrontendConfig) -> tuple[str, ...]:
    """Modules a worker imports to build ``cfg``'s frontend (forked local workers import them once,
    in their forkserver): what its type names (:meth:`FrontendType.modules`): lhotse for
    ``fbank``, a ``model``'s module, an ESPnet2 frontend's module; empty for ``none``."""
    return cfg.kind.modules(cfg)


def build_frontend(cfg: FrontendConfig) -> Frontend | None:
    """The frontend for ``cfg`` (``None`` for ``type: none``)."""
    return cfg.kind.build(cfg)


def extract_features(utts: Sequence[Any], frontend: Callable[..., Sequence[np.ndarray]], audio: Any,
                     storage_options: Mapping[str, Any] | None, cache: Any,
                     kwargs: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Load ``utts`` and run ``frontend`` over them as one batch.

    Args:
        utts: :class:`~espnet3_flows.inputs.records.Utterance` records.
        frontend: What :func:`build_frontend` built (not ``None``).
        audio: The :class:`~espnet3_flows.inputs.audio_config.AudioConfig` to load with.
        storage_options: fsspec options for remote audio.
        cache: The shard's :class:`~espnet3_flows.inputs.recording_cache.RecordingCache`.
        kwargs: Extra keyword arguments for a model's ``collect_feats``.

    Returns:
        Per utterance ``{utt_id, speech_len (samples), rate (native), feats (frames × dim)}``.
        NaN and Inf are looked for in each array on the host, unless the frontend returned
        :class:`~espnet3_flows.frontends.checked.CheckedFeatures` (checked where it computed them).

    Raises:
        BadItemError: unreadable audio, or features that are empty, not 2-D, NaN or Inf.
    """
    from espnet3_flows.inputs.audio import load_many

    loaded = load_many(utts, audio, storage_options, cache)
    feats = frontend([w for w, _ in loaded], dict(kwargs or {}))
    checked = feats.nonfinite if isinstance(feats, CheckedFeatures) else [None] * len(feats)
    out = []
    for u, (w, rate), f, bad in zip(utts, loaded, feats, checked, strict=True):
        _check_features(u.utt_id, tuple(f.shape), not bad if bad is not None else bool(np.isfinite(f).all()))
        out.append({"utt_id": u.utt_id, "speech_len": int(len(w)), "rate": rate, "feats": f})
    return out


@dataclass
class MomentsBatch:
    """One call's utterances for collect-stats, their features summed up where they were computed
    (:func:`extract_moments`): a row per utterance (``utt_id``, ``speech_len``, ``rate``,
    ``shape`` as ``(frames, dim)``, ``feats`` ``None``) and the moments of all their frames."""

    rows: list[dict[str, Any]]
    moments: Moments
    #: ``[samples, samples computed]``: the utterances' samples, and those the frontend computed
    #: to get their features, padding of batches included
    samples: tuple[int, int] = (0, 0)


def extract_moments(utts: Sequence[Any], frontend: Any, audio: Any, storage_options: Mapping[str, Any] | None,
                    cache: Any, kwargs: Mapping[str, Any] | None = None) -> MomentsBatch | None:
    """Load ``utts`` and compute the moments of their features without copying the features to the
    host (a GPU frontend's stay on the GPU); ``None`` when ``frontend`` does not do that here (its
    ``computes_moments`` is false or missing: :func:`extract_features` then).

    Raises:
        BadItemError: unreadable audio, or features that are empty, NaN or Inf (as
            :func:`extract_features`, so that the engine finds the utterance and runs the others).
    """
    if not getattr(frontend, "computes_moments", False):
        return None
    from espnet3_flows.inputs.audio import load_many

    loaded = load_many(utts, audio, storage_options, cache)
    got = frontend.moments([w for w, _ in loaded], dict(kwargs or {}))
    rows = []
    for u, (w, rate), frames, bad in zip(utts, loaded, got.frames, got.nonfinite, strict=True):
        _check_features(u.utt_id, (frames, got.dim), not bad)
        rows.append({"utt_id": u.utt_id, "speech_len": int(len(w)), "rate": rate, "feats": None,
                     "shape": (frames, got.dim)})
    return MomentsBatch(rows, got.moments, (got.samples, got.computed_samples))


def _check_features(utt_id: str, shape: tuple[int, ...], finite: bool) -> None:
    """Raise :class:`~espnet3_flows.errors.BadItemError` for an utterance whose features are not
    ``(frames >= 1, dim)`` or hold NaN or Inf (shape and finiteness as its extractor knows them)."""
    from espnet3_flows.errors import BadItemError

    if len(shape) != 2 or shape[0] == 0:
        raise BadItemError(f"utt {utt_id!r}: the frontend returned features of shape {shape}")
    if not finite:
        raise BadItemError(f"utt {utt_id!r}: features contain NaN or Inf")
