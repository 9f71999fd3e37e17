"""Audio loading for jobs: soundfile decoding through fsspec, channel choice, resampling, checks."""

from __future__ import annotations

import io
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Mapping

import fsspec
import numpy as np
import soundfile as sf

from espnet3_flows.errors import BadItemError
from espnet3_flows.manifest import Utterance


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
        sampling_rate: Target rate in Hz; other rates are resampled (polyphase, exact ratio).
        channel: Channel index to keep from multi-channel audio, or ``None`` for the mean.
        max_duration: Longest accepted recording in seconds (checked from the header,
            before decoding, so a 2-hour file is refused without loading it); ``None`` = no limit.
    """

    sampling_rate: int = 16000
    channel: int | None = None
    max_duration: float | None = 3600.0


def read_audio(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None = None) -> np.ndarray:
    """Load an utterance as float32 mono samples at ``config.sampling_rate`` (see :func:`load_audio`)."""
    return load_audio(utt, config, storage_options)[0]


def load_audio(utt: Utterance, config: AudioConfig,
               storage_options: Mapping[str, Any] | None = None) -> tuple[np.ndarray, int]:
    """An utterance as float32 mono samples at ``config.sampling_rate``, and the rate it was
    recorded at (before resampling).

    Raises:
        AudioError: missing or unreadable file, zero-length audio, too long, a missing
            channel, or NaN/Inf samples; the message names the utterance.
    """
    try:
        if utt.cut is not None:
            samples, rate = _read_lhotse(utt, config)
        else:
            samples, rate = _read_soundfile(utt.path, config, storage_options)
    except AudioError as exc:
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): {exc}") from None
    except FileNotFoundError:
        raise AudioError(f"utt {utt.utt_id!r}: audio file not found: {utt.path}") from None
    except (RuntimeError, ValueError, EOFError, TypeError, sf.SoundFileError) as exc:
        # a decoder's verdict on this file; I/O and network errors propagate instead, so the
        # shard fails and is retried rather than the item being skipped as bad data
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): cannot decode audio: {exc}") from None
    try:
        mono = _select_channel(samples, config.channel)
    except AudioError as exc:
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): {exc}") from None
    if mono.size == 0:
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): zero-length audio")
    if not np.isfinite(mono).all():
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): audio contains NaN or Inf samples")
    if rate != config.sampling_rate:
        mono = resample(mono, rate, config.sampling_rate)
    return mono, int(rate)


def audio_length(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None = None) -> int:
    """Length in samples at ``config.sampling_rate``, from the header alone (see :func:`audio_header`)."""
    return audio_header(utt, config, storage_options)[0]


def audio_header(utt: Utterance, config: AudioConfig,
                 storage_options: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """Length in samples at ``config.sampling_rate`` and the native rate, from the header alone
    (nothing is decoded; a lhotse cut's from the manifest).

    Raises:
        AudioError: missing file, unreadable header, zero-length or too long audio.
    """
    try:
        if utt.cut is not None:
            seconds = float(utt.cut.get("duration", 0.0))
            _check_duration(seconds, config)
            native = (utt.cut.get("recording") or {}).get("sampling_rate") or utt.cut.get("sampling_rate")
            return int(round(seconds * config.sampling_rate)), int(native or config.sampling_rate)
        protocol = fsspec.core.split_protocol(utt.path)[0]
        if protocol in (None, "file"):
            with sf.SoundFile(_check_local_file(utt.path)) as f:
                _check_header(f)
                frames, rate = f.frames, f.samplerate
        else:
            with fsspec.open(utt.path, "rb", **dict(storage_options or {})) as raw, sf.SoundFile(raw) as f:
                _check_header(f)
                frames, rate = f.frames, f.samplerate
        if frames <= 0:
            raise AudioError("zero-length audio")
        _check_duration(frames / rate, config)
    except AudioError as exc:
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): {exc}") from None
    except FileNotFoundError:
        raise AudioError(f"utt {utt.utt_id!r}: audio file not found: {utt.path}") from None
    except (RuntimeError, sf.SoundFileError) as exc:
        raise AudioError(f"utt {utt.utt_id!r} ({utt.path}): cannot read audio header: {exc}") from None
    return int(math.ceil(frames * config.sampling_rate / rate)), int(rate)


def _check_local_file(path: str) -> str:
    """The local path of ``path`` once it is known to be a regular file: a FIFO, device, socket or
    directory is a bad item found without opening it (opening a FIFO blocks for ever)."""
    local = fsspec.core.strip_protocol(path) if path.startswith("file://") else path
    try:
        mode = os.stat(local).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None  # reported as "audio file not found"
    # any other OSError (EIO, ESTALE, EACCES on a flaky mount) propagates: an I/O failure of the
    # shard, retried, never a bad item
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise AudioError(f"audio path is {kind}, not a regular file")
    return local


def _check_header(f: "sf.SoundFile") -> None:
    """A header whose data length disagrees with the file (a truncated file, or a data chunk that
    claims more than exists) is a bad item, not a shorter good one. libsndfile notes the
    mismatch in its parse log as ``data : N (should be M)``."""
    for line in (f.extra_info or "").splitlines():
        if line.startswith("data") and "should be" in line:
            raise AudioError(f"header and data disagree (truncated or corrupt file): {line.strip()}")
    if f.samplerate <= 0:
        raise AudioError("invalid sampling rate in header")


def _check_duration(seconds: float, config: AudioConfig) -> None:
    if config.max_duration is not None and seconds > config.max_duration:
        raise AudioError(f"duration {seconds:.1f} s exceeds max_duration {config.max_duration:g} s")


def resample(x: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Polyphase resampling by the exact rational ratio ``target_sr / orig_sr`` (float32 out)."""
    from scipy.signal import resample_poly

    g = math.gcd(int(orig_sr), int(target_sr))
    up, down = int(target_sr) // g, int(orig_sr) // g
    return resample_poly(x.astype(np.float64), up, down).astype(np.float32)


def _read_soundfile(path: str, config: AudioConfig, storage_options: Mapping[str, Any] | None):
    protocol = fsspec.core.split_protocol(path)[0]
    if protocol in (None, "file"):
        source: Any = _check_local_file(path)  # missing: FileNotFoundError (libsndfile says "System error.")
    else:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            source = io.BytesIO(f.read())
    with sf.SoundFile(source) as f:  # one open: the header is checked before anything is decoded
        _check_header(f)
        _check_duration(f.frames / f.samplerate, config)
        data = f.read(dtype="float32", always_2d=True)
        rate = f.samplerate
    return data.T, int(rate)  # (channels, samples)


def _read_lhotse(utt: Utterance, config: AudioConfig):
    from lhotse import CutSet

    _check_duration(float((utt.cut or {}).get("duration") or 0.0), config)  # from the manifest, before decoding

    cut = CutSet.from_dicts([dict(utt.cut)])[0]  # type: ignore[arg-type]
    audio = cut.load_audio()
    return np.asarray(audio, dtype=np.float32).reshape(-1, audio.shape[-1]), int(cut.sampling_rate)


def _select_channel(samples: np.ndarray, channel: int | None) -> np.ndarray:
    if samples.shape[0] == 1:
        return np.ascontiguousarray(samples[0])
    if channel is None:
        return samples.mean(axis=0, dtype=np.float64).astype(np.float32)
    if not 0 <= channel < samples.shape[0]:
        raise AudioError(f"channel {channel} requested but the audio has {samples.shape[0]} channel(s)")
    return np.ascontiguousarray(samples[channel])
