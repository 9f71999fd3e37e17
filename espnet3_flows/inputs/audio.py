"""Audio loading for jobs: soundfile decoding through fsspec, Kaldi archives and commands,
segments of longer recordings, channel choice, resampling, checks. An utterance whose manifest
format loads its audio itself (:attr:`~espnet3_flows.inputs.records.Utterance.format`: a lhotse
cut, a dataset row's bytes) is handed to that format from the registry.

The types it shares with the formats and jobs live in :mod:`.audio_config`, the per-shard
recording cache in :mod:`.recording_cache`, resampling in :mod:`.resampling` and commands in
:mod:`.audio_commands`; the names are importable from here too.
"""

from __future__ import annotations

import io
import math
import os
import stat
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from collections.abc import Mapping, Sequence

import fsspec
import numpy as np
import soundfile as sf

from espnet3_flows.deadlines import with_deadlines
from espnet3_flows.errors import clip, describe_os_error, is_item_os_error, quote
from espnet3_flows.inputs.formats.base import format_named
from espnet3_flows.inputs.audio_commands import _streamed_wav_sizes, run_pipe
from espnet3_flows.inputs.audio_config import (RESAMPLERS, AudioConfig, AudioError, check_audio_settings,
                                              check_max_duration)
from espnet3_flows.inputs.pcm_wav import read_pcm16_wav
from espnet3_flows.inputs.recording_cache import RecordingCache, ahead_key, recording_key
from espnet3_flows.inputs.resampling import resample
from espnet3_flows.inputs.records import Utterance, entry_kind


#: How far a segment may end past its recording before it is a bad item (Kaldi's
#: ``extract-segments --max-overshoot`` default); up to this it is cut at the end
MAX_SEGMENT_OVERSHOOT = 0.5


def load_many(utts: Sequence[Utterance], config: AudioConfig, storage_options: Mapping[str, Any] | None = None,
              cache: RecordingCache | None = None) -> list[tuple[np.ndarray, int]]:
    """:func:`load_audio` of each of ``utts``, in order, with whole files decoded (and resampled)
    on ``config.decode_threads`` threads of this process, all of them ahead of the caller's model:
    soundfile and scipy release the GIL, so a worker feeding a GPU decodes on several cores.
    Segments (their recordings are shared through ``cache``), commands (``cmd |``) and entries of
    a registered format are read in the calling thread. The first failing utterance's error is raised, as serially.

    With those threads and a shard's ``cache``, the files of the shard's next call
    (:meth:`~espnet3_flows.inputs.recording_cache.RecordingCache.following`) start decoding behind
    these, so that they are decoded while the caller's model works on these ones; the next call
    takes them (a failed one raises there, as if decoded then), with the same settings only. Those
    of an earlier call that no call took (its forward failed before reading them) are dropped. A
    call of one file waits for the threads too.
    """
    if config.decode_threads <= 1:
        return [load_audio(u, config, storage_options, cache) for u in utts]
    pool = _decode_pool(config.decode_threads)
    cache = cache if cache is not None else RecordingCache()  # (one of no shard: nothing to read ahead in)
    settings = (config, dict(storage_options or {}))
    upcoming = [u for u in cache.following(utts) if _threaded(u)]
    cache.keep_ahead({ahead_key(u) for u in (*utts, *upcoming)})
    threads_cache = cache.detached()  # (whole files read only its cwd)

    def decode(u: Utterance) -> Future:
        return pool.submit(load_audio, u, config, storage_options, threads_cache)

    futures = {i: cache.take_ahead(u, settings) or decode(u) for i, u in enumerate(utts) if _threaded(u)}
    for u in upcoming:
        cache.start_ahead(u, settings, decode)
    try:
        return [futures[i].result() if i in futures else load_audio(u, config, storage_options, cache)
                for i, u in enumerate(utts)]
    finally:
        for future in futures.values():
            future.cancel()


def _threaded(utt: Utterance) -> bool:
    """Whether :func:`load_many` decodes ``utt`` on its threads: a whole file, not a segment, a
    command or an entry of a registered format."""
    return not utt.recording and not utt.format and entry_kind(utt.path) != "pipe"


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _decode_pool(threads: int) -> ThreadPoolExecutor:
    """This process's pool of ``threads`` decoding threads (made once, kept for its life)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="espnet3-decode")
        return pool


os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has no threads: its own pools


def read_audio(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None = None,
               cache: RecordingCache | None = None) -> np.ndarray:
    """Load an utterance as float32 mono samples at ``config.sampling_rate`` (see :func:`load_audio`)."""
    return load_audio(utt, config, storage_options, cache)[0]


def load_audio(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None = None,
               cache: RecordingCache | None = None) -> tuple[np.ndarray, int]:
    """An utterance as float32 mono samples at ``config.sampling_rate``, and the rate it was
    recorded at (before resampling).

    ``utt.path`` is an audio file (path or URL), a Kaldi archive entry ``ark:file:offset``, or a
    command ``cmd |`` (only with ``config.allow_pipes``). A segment (``utt.recording``) is cut
    from its recording, which ``cache`` keeps for the shard's other segments.

    Raises:
        AudioError: missing or unreadable file, a failed command, zero-length audio, too long, a
            segment past the end of its recording, a missing channel, or NaN/Inf samples; the
            message names the utterance.
        TimeoutError: a command ran longer than ``config.pipe_timeout`` (an I/O failure: the
            shard is retried).
    """
    try:
        if utt.format:
            samples, rate = format_named(utt.format).load_audio(utt, config, storage_options)
        elif utt.recording:
            samples, rate = _read_segment(utt, config, storage_options, cache)
        else:
            samples, rate = _read_entry(utt.path, config, storage_options, cache.cwd if cache else "")
    except AudioError as exc:
        raise AudioError(f"{_named(utt)}: {clip(str(exc), 400)}") from None
    except OSError as exc:
        raise _file_error(utt, exc) from None
    except (RuntimeError, ValueError, EOFError, TypeError, sf.SoundFileError) as exc:
        # a decoder's verdict on this file; I/O and network errors propagate instead, so the
        # shard fails and is retried rather than the item being skipped as bad data
        raise AudioError(f"{_named(utt)}: cannot decode audio: {clip(str(exc), 400)}") from None
    try:
        mono = _select_channel(samples, config.channel)
    except AudioError as exc:
        raise AudioError(f"{_named(utt)}: {clip(str(exc), 400)}") from None
    if mono.size == 0:
        raise AudioError(f"{_named(utt)}: zero-length audio")
    if not np.isfinite(mono).all():
        raise AudioError(f"{_named(utt)}: audio contains NaN or Inf samples")
    if rate != config.sampling_rate:
        mono = resample(mono, rate, config.sampling_rate, config.resampler)
    return mono, int(rate)


def audio_length(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None = None,
                 cache: RecordingCache | None = None) -> int:
    """Length in samples at ``config.sampling_rate``, from the header alone (see :func:`audio_header`)."""
    return audio_header(utt, config, storage_options, cache)[0]


def audio_header(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None = None,
                 cache: RecordingCache | None = None) -> tuple[int, int]:
    """Length in samples at ``config.sampling_rate`` and the native rate, from the header alone
    (nothing is decoded for audio files; a lhotse cut's from the manifest; otherwise as the
    utterance's format reads it). Archive entries and
    commands have no header to read apart from their audio: they are decoded.

    Raises:
        AudioError: missing file, unreadable header, zero-length or too long audio, a segment
            past the end of its recording.
    """
    try:
        if utt.format:
            return format_named(utt.format).audio_header(utt, config, storage_options)
        if utt.recording:
            key = recording_key(utt)
            cache = cache if cache is not None else RecordingCache()
            if entry_kind(utt.path) == "file":
                total, rate = cache.header(key, lambda: _file_header(utt.path, storage_options))
            else:
                samples, rate = cache.get(key, lambda: _read_entry(utt.path, config, storage_options, cache.cwd,
                                                                   check_duration=False))
                total = samples.shape[-1]
                cache.done(key)
            first, stop = _segment_bounds(utt, total, rate)
            frames = stop - first
        elif entry_kind(utt.path) != "file":
            samples, rate = _read_entry(utt.path, config, storage_options, cache.cwd if cache else "")
            frames = samples.shape[-1]
        else:
            frames, rate = _file_header(utt.path, storage_options)
        if frames <= 0:
            raise AudioError("zero-length audio")
        check_max_duration(frames / rate, config)
    except AudioError as exc:
        raise AudioError(f"{_named(utt)}: {clip(str(exc), 400)}") from None
    except OSError as exc:
        raise _file_error(utt, exc) from None
    except (RuntimeError, sf.SoundFileError) as exc:
        raise AudioError(f"{_named(utt)}: cannot read audio header: {clip(str(exc), 400)}") from None
    return int(math.ceil(frames * config.sampling_rate / rate)), int(rate)


def _named(utt: Utterance) -> str:
    """``utt 'id' (path)`` for a message, both clipped (a manifest field may be 1 MiB)."""
    return f"utt {quote(utt.utt_id)} ({clip(utt.path)})"


def _file_error(utt: Utterance, exc: OSError) -> BaseException:
    """An ``OSError`` met reading ``utt``: a bad item when it is permanent for that file (missing,
    a symlink loop, a name too long, ...: :func:`~espnet3_flows.errors.is_item_os_error`),
    otherwise the error itself, so that the shard fails and is retried (the store failing)."""
    if isinstance(exc, FileNotFoundError):
        return AudioError(f"utt {quote(utt.utt_id)}: audio file not found: {clip(utt.path)}")
    if is_item_os_error(exc):
        return AudioError(f"{_named(utt)}: cannot open audio file: {describe_os_error(exc)}")
    return exc


def _file_header(path: str, storage_options: Mapping[str, Any] | None) -> tuple[int, int]:
    """``(frames, rate)`` of an audio file from its header."""
    protocol = fsspec.core.split_protocol(path)[0]
    if protocol in (None, "file"):
        return read_header(_check_local_file(path))
    with fsspec.open(path, "rb", **with_deadlines(storage_options, path)) as raw:
        return read_header(raw)


def read_header(source: Any) -> tuple[int, int]:
    """``(frames, rate)`` from the header of ``source`` (a local path or a readable binary file
    object), checked against its data."""
    with sf.SoundFile(source) as f:
        _check_header(f)
        return f.frames, f.samplerate


def _check_local_file(path: str) -> str:
    """The local path of ``path`` once it is known to be a regular file: a FIFO, device, socket or
    directory is a bad item found without opening it (opening a FIFO blocks for ever)."""
    local = fsspec.core.strip_protocol(path) if path.startswith("file://") else path
    try:
        mode = os.stat(local).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(path) from None  # reported as "audio file not found"
    # any other OSError propagates, classified by _file_error: a symlink loop is a bad item, EIO
    # or ESTALE an I/O failure of the shard (retried)
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise AudioError(f"audio path is {kind}, not a regular file")
    return local


def _check_header(f: sf.SoundFile) -> None:
    """A header whose data length disagrees with the file (a truncated file, or a data chunk that
    claims more than exists) is a bad item, not a shorter good one. libsndfile notes the
    mismatch in its parse log as ``data : N (should be M)``."""
    for line in (f.extra_info or "").splitlines():
        if line.startswith("data") and "should be" in line:
            raise AudioError(f"header and data disagree (truncated or corrupt file): {line.strip()}")
    if f.samplerate <= 0:
        raise AudioError("invalid sampling rate in header")


def _read_soundfile(path: str, config: AudioConfig, storage_options: Mapping[str, Any] | None,
                    check_duration: bool = True):
    protocol = fsspec.core.split_protocol(path)[0]
    if protocol in (None, "file"):
        source: Any = _check_local_file(path)  # missing: FileNotFoundError (libsndfile says "System error.")
        if source.lower().endswith((".wav", ".wave")):  # most corpora: 16-bit PCM, read 3x faster
            read = read_pcm16_wav(source, config.max_duration if check_duration else None)
            if read is not None:
                return read
    else:
        with fsspec.open(path, "rb", **with_deadlines(storage_options, path)) as f:
            source = io.BytesIO(f.read())
    return decode_audio(source, config, check_duration)


def decode_audio(source: Any, config: AudioConfig, check_duration: bool = True) -> tuple[np.ndarray, int]:
    """``(channels × samples, rate)`` of ``source`` (a local path or a readable binary file object),
    header and duration checked before anything is decoded."""
    with sf.SoundFile(source) as f:  # one open: the header is checked before anything is decoded
        _check_header(f)
        if check_duration:
            check_max_duration(f.frames / f.samplerate, config)
        data = f.read(dtype="float32", always_2d=True)
        rate = f.samplerate
    return data.T, int(rate)  # (channels, samples)


def _read_entry(entry: str, config: AudioConfig, storage_options: Mapping[str, Any] | None, cwd: str,
                check_duration: bool = True) -> tuple[np.ndarray, int]:
    """``(channels × samples, rate)`` of an audio file, archive entry or command."""
    kind = entry_kind(entry)
    if kind == "pipe":
        return decode_audio(io.BytesIO(_streamed_wav_sizes(run_pipe(entry, config, cwd))), config, check_duration)
    if kind == "ark":
        return _read_ark(entry[len("ark:"):], config, storage_options, check_duration)
    return _read_soundfile(entry, config, storage_options, check_duration)


def _read_ark(spec: str, config: AudioConfig, storage_options: Mapping[str, Any] | None,
              check_duration: bool) -> tuple[np.ndarray, int]:
    """The audio stored in a Kaldi archive at ``file:offset``, as kaldiio writes it: a WAV, or
    kaldiio's ``AUDIO`` record (a length, then a WAV or FLAC: ESPnet's ``flac.ark``). Only the
    entry's own bytes are read. Anything else (a Kaldi matrix, a numpy array, and above all a
    pickle, which kaldiio would unpickle: code execution from a data file) is refused."""
    if "[" in spec:
        raise AudioError("ranges ('[...]') on archive entries are not supported for audio")
    path, _, offset = spec.rpartition(":")
    if not path or not offset.isdigit():
        raise AudioError(f"archive entry {spec!r} is not 'file.ark:offset'")
    if fsspec.core.split_protocol(path)[0] in (None, "file"):
        path = _check_local_file(path)
    with fsspec.open(path, "rb", **with_deadlines(storage_options, path)) as f:
        f.seek(int(offset))
        head = f.read(5)
        if head[:4] == b"RIFF":
            f.seek(int(offset) + 4)
            size = _unpack_le(f.read(4), spec)  # the RIFF chunk: 8 bytes of header, then size bytes
            f.seek(int(offset))
            data = f.read(size + 8)
        elif head == b"AUDIO":
            width = f.read(1)
            if len(width) != 1:
                raise AudioError(f"archive entry {spec!r} is truncated")
            size = int.from_bytes(f.read(width[0]), "little")
            data = f.read(size)
        else:
            what = "a Kaldi matrix" if head[:2] == b"\0B" else "a pickle" if head[:3] == b"PKL" else (
                "a numpy array" if head[:3] == b"NPY" else repr(head))
            raise AudioError(f"archive entry {spec!r} holds {what}, not audio (WAV, or kaldiio's AUDIO record)")
    if len(data) < (size + 8 if head[:4] == b"RIFF" else size):
        raise AudioError(f"archive entry {spec!r} is truncated ({len(data)} bytes where its header says more)")
    return decode_audio(io.BytesIO(data), config, check_duration)


def _unpack_le(raw: bytes, spec: str) -> int:
    if len(raw) != 4:
        raise AudioError(f"archive entry {spec!r} is truncated")
    return struct.unpack("<I", raw)[0]


def _segment_bounds(utt: Utterance, total: int, rate: int) -> tuple[int, int]:
    """First and stop sample of a segment in a recording of ``total`` samples at ``rate``."""
    first = int(round(utt.start * rate))
    stop = total if utt.end is None else int(round(utt.end * rate))
    if first >= total:
        raise AudioError(f"segment starts at {utt.start:g} s, after the end of recording {utt.recording!r} "
                         f"({total / rate:.3f} s)")
    if stop > total:
        if (stop - total) / rate > MAX_SEGMENT_OVERSHOOT:
            raise AudioError(f"segment ends at {utt.end:g} s, past the end of recording {utt.recording!r} "
                             f"({total / rate:.3f} s)")
        stop = total
    return first, stop


def _read_segment(utt: Utterance, config: AudioConfig, storage_options: Mapping[str, Any] | None,
                  cache: RecordingCache | None) -> tuple[np.ndarray, int]:
    """A segment cut from its recording (decoded once per shard through ``cache``)."""
    key = recording_key(utt)
    cache = cache if cache is not None else RecordingCache()
    samples, rate = cache.get(key, lambda: _read_entry(utt.path, config, storage_options, cache.cwd,
                                                       check_duration=False))
    try:
        first, stop = _segment_bounds(utt, samples.shape[-1], rate)
        check_max_duration((stop - first) / rate, config)
        return np.array(samples[:, first:stop]), rate
    finally:
        cache.done(key)


def _select_channel(samples: np.ndarray, channel: int | None) -> np.ndarray:
    if samples.shape[0] == 1:
        return np.ascontiguousarray(samples[0])
    if channel is None:
        return samples.mean(axis=0, dtype=np.float64).astype(np.float32)
    if not 0 <= channel < samples.shape[0]:
        raise AudioError(f"channel {channel} requested but the audio has {samples.shape[0]} channel(s)")
    return np.ascontiguousarray(samples[channel])


__all__ = ["RESAMPLERS", "AudioConfig", "AudioError", "RecordingCache", "audio_header", "audio_length",
           "check_audio_settings", "check_max_duration", "decode_audio", "load_audio", "load_many", "read_audio",
           "read_header", "recording_key", "resample", "run_pipe"]
