"""How audio is read (:class:`AudioConfig`) and what an unusable utterance's audio raises
(:class:`AudioError`): the types the loader (:mod:`.audio`), the manifest formats and the jobs share."""

from __future__ import annotations

from dataclasses import dataclass

from espnet3_flows.errors import BadItemError

#: ``poly``: scipy's polyphase filter by the exact rational ratio; ``librosa``: ``librosa.resample``
#: with its default (soxr), as ESPnet's ``extract_spk_embed.py`` resamples; ``torchaudio``:
#: ``torchaudio``'s default sinc resampler, as ``extract_spk_embed_parallel.py`` does.
RESAMPLERS = ("poly", "librosa", "torchaudio")


class AudioError(BadItemError):
    """An utterance's audio cannot be used; the message names the utterance and the reason."""


def check_audio_settings(prefix: str, sampling_rate: int, channel: int | None, max_duration: float | None) -> None:
    """Reject impossible audio settings up front (``ValueError`` naming the key under ``prefix``)."""
    if sampling_rate <= 0:
        raise ValueError(f"{prefix}sampling_rate must be positive, got {sampling_rate}")
    if channel is not None and channel < 0:
        raise ValueError(f"{prefix}channel must be a channel index >= 0 or null (average), got {channel}")
    if max_duration is not None and max_duration <= 0:
        raise ValueError(f"{prefix}max_duration must be positive or null, got {max_duration}")


@dataclass(frozen=True)
class AudioConfig:
    """How audio is read for a job.

    Attributes:
        sampling_rate: Target rate in Hz; other rates are resampled (see ``resampler``).
        channel: Channel index to keep from multi-channel audio, or ``None`` for the mean.
        max_duration: Longest accepted utterance in seconds (checked from the header, before
            decoding, so a 2-hour file is refused without loading it; for a segment, the
            segment's length); ``None`` = no limit.
        allow_pipes: Whether an audio entry ``command |`` may run (its standard output is the
            audio); see :mod:`espnet3_flows.inputs.kaldi_dir`.
        pipe_timeout: Seconds a command may run before it is killed (the shard then fails and
            is retried).
        resampler: How other rates are resampled (one of `RESAMPLERS`, see :func:`resample`).
        decode_threads: Threads :func:`load_many` decodes whole files on (1: in the caller).
    """

    sampling_rate: int = 16000
    channel: int | None = None
    max_duration: float | None = 3600.0
    allow_pipes: bool = False
    pipe_timeout: float = 600.0
    resampler: str = "poly"
    decode_threads: int = 1


def check_max_duration(seconds: float, config: AudioConfig) -> None:
    """An :class:`AudioError` for an utterance longer than ``config.max_duration``."""
    if config.max_duration is not None and seconds > config.max_duration:
        raise AudioError(f"duration {seconds:.1f} s exceeds max_duration {config.max_duration:g} s")
