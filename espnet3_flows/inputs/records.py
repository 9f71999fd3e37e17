"""Utterance records: what one input item is, the checks on its id, skipped items and the
errors that name a manifest's line; the bottom of :mod:`espnet3_flows.inputs`."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Mapping

from espnet3_flows.errors import Espnet3FlowsError, clip, quote
from espnet3_flows.storage import TEMP_SUFFIX_BYTES

#: The longest file name a file system takes (bytes; Linux's NAME_MAX, most others the same)
NAME_MAX = 255
#: Endings of the files named after an utterance id (``{id}.pt`` of x-vectors, ``{id}.npy`` of
#: collected features): a job names such a file only through :func:`id_file_name`, so a new
#: ending is added here and the id bound below covers it
ID_FILE_SUFFIXES = (".pt", ".npy")
#: The longest id accepted: its longest file name, with a temporary name's suffix, still fits NAME_MAX
MAX_ID_BYTES = NAME_MAX - max(len(s.encode("utf-8")) for s in ID_FILE_SUFFIXES) - TEMP_SUFFIX_BYTES
#: ids made only of these, not starting with "-" or ".", without "..": safe at once
SAFE_ID = re.compile(r"(?!-)(?!\.)(?!.*\.\.)[A-Za-z0-9_.:+=@,%-]+")
#: endings of the file names among a command's arguments (see :func:`fingerprint_target`)
_AUDIO_EXTENSIONS = (".wav", ".flac", ".sph", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".wv", ".shn", ".aif",
                     ".aiff", ".au", ".amr", ".webm", ".mp4")


class ManifestError(Espnet3FlowsError, ValueError):
    """A manifest file or one of its lines is invalid; the message names split, file and line."""


@dataclass(frozen=True)
class Utterance:
    """One input item of a speech job.

    Attributes:
        utt_id: Unique id; safe to use as a file name (see :func:`validate_utt_id`).
        path: The audio: a local path or fsspec URL, a Kaldi ark entry ``ark:file:offset``,
            or a command ending in ``|`` whose standard output is the audio (run only with
            ``allow_pipes``; see :mod:`espnet3_flows.inputs.audio`).
        text: Transcript (may be empty).
        speaker: Speaker id (may be empty).
        line: 1-based line in the manifest (0 for lhotse cuts without lines).
        payload: What the utterance's :attr:`format` needs to load its audio (a lhotse cut as a
            dict; a dataset row's location), or ``None`` for a plain :attr:`path` entry.
        start: Start of the utterance in its recording, in seconds (Kaldi ``segments``).
        end: End in seconds, or ``None`` for the end of the recording.
        recording: Recording id when the utterance is a segment of a longer recording (its
            recording is then decoded once for all its segments in a shard); empty otherwise.
        origin: The file ``line`` counts in, when it is not the manifest itself (a data
            directory's ``segments`` or ``wav.scp``).
        format: The registered manifest format (:mod:`espnet3_flows.inputs.formats`) that loads
            this utterance's audio from :attr:`payload`; empty when :attr:`path` is read as it is.
    """

    utt_id: str
    path: str
    text: str = ""
    speaker: str = ""
    line: int = 0
    payload: Mapping[str, Any] | None = field(default=None, compare=False)
    start: float = 0.0
    end: float | None = None
    recording: str = ""
    origin: str = ""
    format: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Utterance:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(d))

    def where(self, split: str = "") -> str:
        """Human-readable location: ``split train, line 12, utt 'u1' (/data/u1.wav)``
        (``data/train/segments:12`` in place of ``line 12`` for a data directory's utterance)."""
        parts = [f"split {split}"] if split else []
        if self.line:
            parts.append(f"{self.origin}:{self.line}" if self.origin else f"line {self.line}")
        parts.append(f"utt {quote(self.utt_id)} ({clip(self.path)})")  # inputs: clipped
        return ", ".join(parts)


@dataclass(frozen=True)
class SkippedItem:
    """An input left out under ``on_error: skip``, with the reason; written to ``skipped.tsv``."""

    split: str
    utt_id: str
    line: int
    path: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SkippedItem:
        """Inverse of :meth:`to_dict`."""
        return cls(str(d["split"]), str(d["utt_id"]), int(d["line"]), str(d["path"]), str(d["reason"]))

    def tsv_line(self) -> str:
        """One line of ``skipped.tsv``: split, utt id, line, path, reason (tabs and newlines escaped)."""
        cells = [self.split, self.utt_id, str(self.line), self.path, self.reason]
        return "\t".join(c.replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r") for c in cells)


SKIPPED_HEADER = "split\tutt_id\tline\tpath\treason"


#: characters an utterance id may not hold beyond those the readers split at: it names files
_PATH_SEPARATORS = frozenset("/\\")


def _refuse_unreadable(value: str, noun: str, path_separators: bool) -> None:
    """Raise ValueError unless ``value`` reads back whole as the key of a line of ``utt2spk``, an
    scp or a shape file: it must not be empty or hold any whitespace or line break (Unicode's too:
    ESPnet2's ``read_2columns_text`` and kaldiio split lines with ``str.split``, and
    ``str.splitlines`` breaks at U+2028, U+0085, ...), a control character or a lone surrogate;
    with ``path_separators``, no ``/`` or ``\\`` either. ``noun`` names what the id is of."""
    if not value:
        raise ValueError(f"empty {noun} id")
    bad = sorted(c for c in set(value) if c.isspace() or unicodedata.category(c) in ("Cc", "Cs")
                 or path_separators and c in _PATH_SEPARATORS)
    if bad:
        named = ", ".join(f"U+{ord(c):04X} {unicodedata.name(c, '')}".strip() for c in bad[:5])
        kinds = "a path separator, whitespace" if path_separators else "whitespace"
        raise ValueError(f"{noun} id {quote(value)} contains unsafe characters ({clip(named)}): {kinds}, a line "
                         f"break or a control character; rename the {noun}")


def validate_utt_id(utt_id: str) -> str:
    """Reject ids that could escape a directory, break line-based files or not fit a file name.

    Rejected: what :func:`validate_speaker_id` rejects (empty ids, any whitespace or line break,
    Unicode's too, control characters, lone surrogates), ``.``/``..`` or any ``..`` component,
    path separators, a leading ``-``, or more than :data:`MAX_ID_BYTES` UTF-8 bytes (an id's
    files, ``{id}.pt`` and the like, and their temporary names must fit :data:`NAME_MAX`).

    Returns:
        The id unchanged.

    Raises:
        ValueError: naming the id and the reason.
    """
    if SAFE_ID.fullmatch(utt_id) and len(utt_id) <= 63:  # the common case, in one regex match
        return utt_id
    _refuse_unreadable(utt_id, "utterance", path_separators=True)
    if ".." in utt_id or utt_id in (".",):
        raise ValueError(f"utterance id {quote(utt_id)} contains '..'")
    if utt_id.startswith("-"):
        raise ValueError(f"utterance id {quote(utt_id)} starts with '-'")
    size = len(utt_id.encode("utf-8"))
    if size > MAX_ID_BYTES:
        raise ValueError(f"utterance id {quote(utt_id, 40)} is {size} bytes, longer than {MAX_ID_BYTES} bytes (the "
                         f"most for which its files, such as '{{id}}{max(ID_FILE_SUFFIXES, key=len)}', fit a "
                         f"{NAME_MAX}-byte file name); shorten it")
    return utt_id


def validate_speaker_id(speaker: str) -> str:
    """Reject a speaker id that would not read back whole from ``utt2spk``, ``spk2utt`` or
    ``spk_xvector.scp``: the character rule of :func:`validate_utt_id` (empty ids, any
    whitespace or line break, Unicode's too, control characters, lone surrogates). Speaker ids
    name no file, so path separators, ``..``, a leading ``-`` and any length are accepted.

    Checked only for a job that writes files keyed by speaker id
    (:attr:`~espnet3_flows.utterance_job.UtteranceRunner.speaker_keyed_outputs`): elsewhere a
    speaker such as ``John Smith`` is harmless.

    Returns:
        The id unchanged.

    Raises:
        ValueError: naming the id and the reason.
    """
    if not SAFE_ID.fullmatch(speaker):  # the common case passes in one regex match
        _refuse_unreadable(speaker, "speaker", path_separators=False)
    return speaker


def id_file_name(utt_id: str, suffix: str) -> str:
    """The name of a file named after an utterance id: ``utt_id`` + ``suffix``.

    Raises:
        ValueError: ``suffix`` is not in :data:`ID_FILE_SUFFIXES` (the id bound would not
            cover it: add it there).
    """
    if suffix not in ID_FILE_SUFFIXES:
        raise ValueError(f"file ending {suffix!r} is not in ID_FILE_SUFFIXES: add it there, so that utterance ids "
                         "are bounded for it")
    return utt_id + suffix


def entry_kind(entry: str) -> str:
    """How an audio entry (:attr:`Utterance.path`) is read: ``pipe`` (``command |``), ``ark``
    (``ark:file:offset``, a Kaldi archive) or ``file`` (a path or URL)."""
    stripped = entry.strip()
    if stripped.endswith("|") or stripped.startswith("|"):
        return "pipe"
    if stripped.startswith("ark:"):
        return "ark"
    return "file"


def fingerprint_target(entry: str) -> str:
    """The file whose size and mtime stand for an entry in shard hashes: the audio file, the
    archive, or for a command the last argument that looks like a file (a path or an audio
    file name; empty when none does: the command's text alone is then hashed)."""
    kind = entry_kind(entry)
    if kind == "file":
        return entry
    if kind == "ark":
        spec = entry[len("ark:"):]
        return spec.split("[", 1)[0].rsplit(":", 1)[0]
    words = entry.strip().strip("|").split()[1:]
    for word in reversed(words):
        w = word.strip("'\"")
        if "/" in w or w.lower().endswith(_AUDIO_EXTENSIONS):
            return w
    return ""


class ManifestLineError(ValueError):
    """One manifest line is unusable (the caller adds split, file and line)."""

    def __init__(self, problem: str, utt_id: str = ""):
        super().__init__(problem)
        self.utt_id = utt_id



def line_error(split: str, path: str, lineno: int, exc: ManifestLineError) -> str:
    """The message of a bad manifest line: ``split 'x': file:line: utt 'id': problem``."""
    return f"split {split!r}: {path}:{lineno}: " + (f"utt {quote(exc.utt_id)}: " if exc.utt_id else "") + clip(str(exc), 1000)



def write_skipped_tsv(items: list[SkippedItem]) -> str:
    """The text of ``skipped.tsv`` (a header line, then one line per skipped item)."""
    return "\n".join([SKIPPED_HEADER, *(s.tsv_line() for s in items)]) + "\n"
