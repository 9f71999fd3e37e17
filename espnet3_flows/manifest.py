"""Input manifests: utterance records from TSV files, lhotse CutSets or Kaldi data directories
(joined by :mod:`espnet3_flows.kaldi_dir`), validated line by line."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import re
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Mapping

import fsspec

from espnet3_flows.config import check_on_error
from espnet3_flows.errors import Espnet3FlowsError

#: Line formats of the files workers read: a TSV manifest, a lhotse CutSet's JSON lines, or the
#: joined lines of a Kaldi data directory (see :mod:`espnet3_flows.kaldi_dir`)
MANIFEST_FORMATS = ("tsv", "lhotse", "kaldi")
_UNSAFE_CHARS = {"/", "\\", "\0", "\n", "\r", "\t", " "}
#: ids made only of these, not starting with "-" or ".", without "..": safe at once
_SAFE_ID = re.compile(r"(?!-)(?!\.)(?!.*\.\.)[A-Za-z0-9_.:+=@,%-]+")
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
            ``allow_pipes``; see :mod:`espnet3_flows.audio`).
        text: Transcript (may be empty).
        speaker: Speaker id (may be empty).
        line: 1-based line in the manifest (0 for lhotse cuts without lines).
        cut: For lhotse manifests, the cut as a dict; audio is then loaded through lhotse.
        start: Start of the utterance in its recording, in seconds (Kaldi ``segments``).
        end: End in seconds, or ``None`` for the end of the recording.
        recording: Recording id when the utterance is a segment of a longer recording (its
            recording is then decoded once for all its segments in a shard); empty otherwise.
        origin: The file ``line`` counts in, when it is not the manifest itself (a data
            directory's ``segments`` or ``wav.scp``).
    """

    utt_id: str
    path: str
    text: str = ""
    speaker: str = ""
    line: int = 0
    cut: Mapping[str, Any] | None = field(default=None, compare=False)
    start: float = 0.0
    end: float | None = None
    recording: str = ""
    origin: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Utterance":
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(d))

    def where(self, split: str = "") -> str:
        """Human-readable location: ``split train, line 12, utt 'u1' (/data/u1.wav)``
        (``data/train/segments:12`` in place of ``line 12`` for a data directory's utterance)."""
        parts = [f"split {split}"] if split else []
        if self.line:
            parts.append(f"{self.origin}:{self.line}" if self.origin else f"line {self.line}")
        parts.append(f"utt {self.utt_id!r} ({self.path})")
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
    def from_dict(cls, d: Mapping[str, Any]) -> "SkippedItem":
        """Inverse of :meth:`to_dict`."""
        return cls(str(d["split"]), str(d["utt_id"]), int(d["line"]), str(d["path"]), str(d["reason"]))

    def tsv_line(self) -> str:
        """One line of ``skipped.tsv``: split, utt id, line, path, reason (tabs and newlines escaped)."""
        cells = [self.split, self.utt_id, str(self.line), self.path, self.reason]
        return "\t".join(c.replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r") for c in cells)


SKIPPED_HEADER = "split\tutt_id\tline\tpath\treason"


def validate_utt_id(utt_id: str) -> str:
    """Reject ids that could escape a directory or break line-based files.

    Rejected: empty ids, ``.``/``..`` or any ``..`` component, path separators, NUL,
    whitespace (tab, newline, space), control characters, a leading ``-``, or more than
    255 UTF-8 bytes.

    Returns:
        The id unchanged.

    Raises:
        ValueError: naming the id and the reason.
    """
    if _SAFE_ID.fullmatch(utt_id) and len(utt_id) <= 63:  # the common case, in one regex match
        return utt_id
    if not utt_id:
        raise ValueError("empty utterance id")
    bad = sorted(c for c in set(utt_id) if c in _UNSAFE_CHARS or ord(c) < 32 or ord(c) == 127)
    if bad:
        raise ValueError(f"utterance id {utt_id!r} contains unsafe characters {bad!r}")
    if ".." in utt_id or utt_id in (".",):
        raise ValueError(f"utterance id {utt_id!r} contains '..'")
    if utt_id.startswith("-"):
        raise ValueError(f"utterance id {utt_id!r} starts with '-'")
    if len(utt_id.encode("utf-8")) > 255:
        raise ValueError(f"utterance id {utt_id[:40]!r}... is longer than 255 bytes")
    return utt_id


def is_lhotse_manifest(path: str) -> bool:
    """Whether ``path`` names a lhotse JSONL manifest (``.jsonl`` or ``.jsonl.gz``)."""
    return path.endswith(".jsonl") or path.endswith(".jsonl.gz")


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


def manifest_format(path: str) -> str:
    """The line format of a manifest file by its name: ``lhotse`` or ``tsv`` (data directories
    are joined into ``kaldi`` lines first)."""
    return "lhotse" if is_lhotse_manifest(path) else "tsv"


def source_format(source: Mapping[str, Any]) -> str:
    """The line format of a planned shard source (older plans carry only a ``lhotse`` flag)."""
    fmt = source.get("format")
    if fmt is None:
        fmt = "lhotse" if source.get("lhotse", is_lhotse_manifest(str(source["path"]))) else "tsv"
    return str(fmt)


BOM = b"\xef\xbb\xbf"


def iter_manifest_lines(path: str, split: str = "",
                        storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[int, int, bytes]]:
    """Stream a manifest's raw lines as ``(line number, byte offset after the line, bytes)``.

    Offsets count bytes of the decompressed text (``.gz`` manifests are decompressed on the
    fly), so ``[end of line k, end of line m)`` is the byte range of lines ``k+1..m``.

    Raises:
        ManifestError: the file is missing, unreadable, or not the gzip its name says, naming
            split and file.
    """
    try:
        with contextlib.ExitStack() as stack:
            raw = stack.enter_context(fsspec.open(path, "rb", **(storage_options or {})))
            stream = stack.enter_context(gzip.GzipFile(fileobj=raw)) if path.endswith(".gz") else raw
            end, held = 0, None
            # one line held back: a truncated gzip stream ends in a partial line, then EOFError,
            # and the error must name the file, not the partial line's parse failure
            for lineno, bline in enumerate(stream, start=1):
                if held is not None:
                    yield held
                end += len(bline)
                held = (lineno, end, bline)
            if held is not None:
                yield held
    except FileNotFoundError:
        raise ManifestError(f"split {split!r}: manifest not found: {path}") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ManifestError(f"split {split!r}: manifest {path} is not a valid gzip file: {exc}") from None
    except ManifestError:
        raise
    except IsADirectoryError:
        raise ManifestError(f"split {split!r}: manifest {path} is a directory") from None
    except Exception as exc:  # noqa: BLE001 - remote back ends raise many types
        raise ManifestError(f"split {split!r}: cannot read manifest {path}: {type(exc).__name__}: {exc}") from exc


class ManifestLineError(ValueError):
    """One manifest line is unusable (the caller adds split, file and line)."""

    def __init__(self, problem: str, utt_id: str = ""):
        super().__init__(problem)
        self.utt_id = utt_id


def parse_manifest_line(bline: bytes, lineno: int, fmt: str = "tsv") -> Utterance | None:
    """Parse one raw manifest line of format ``fmt`` (see :data:`MANIFEST_FORMATS`); ``None`` for
    a blank or ``#`` comment line.

    A UTF-8 byte-order mark at the start of line 1 is dropped.

    Raises:
        ManifestLineError: undecodable bytes, a malformed line or an unsafe id.
    """
    lhotse = fmt == "lhotse"
    if lineno == 1 and bline.startswith(BOM):
        bline = bline[len(BOM):]
    try:
        line = bline.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        uid = "" if lhotse else bline.split(b"\t", 1)[0].decode("utf-8", "backslashreplace")
        raise ManifestLineError(f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})", uid) from None
    if not line.strip() or line.startswith("#") and fmt != "kaldi":  # a joined line's id may start with '#'
        return None
    try:
        if fmt == "kaldi":
            utt = parse_joined_line(line)
        else:
            utt = _parse_lhotse_line(line, lineno) if lhotse else _parse_tsv_line(line, lineno)
        validate_utt_id(utt.utt_id)
    except ValueError as exc:
        raise ManifestLineError(str(exc), "" if lhotse else line.split("\t", 1)[0]) from None
    return utt


def planning_fields(bline: bytes, lineno: int, fmt: str = "tsv") -> tuple[str, str] | None:
    """``(utt_id, audio path)`` of a manifest line for planning; ``None`` for blank or comment lines.

    The common TSV line takes one split and one regex match; anything else goes through
    :func:`parse_manifest_line` (same checks, same errors).

    Raises:
        ManifestLineError: as :func:`parse_manifest_line`.
    """
    if fmt == "tsv" and (lineno > 1 or not bline.startswith(BOM)):
        try:
            cells = bline.decode("utf-8").rstrip("\r\n").split("\t")
        except UnicodeDecodeError:
            cells = []
        if 2 <= len(cells) <= 4 and cells[1] and len(cells[0]) <= 63 and _SAFE_ID.fullmatch(cells[0]):
            return cells[0], cells[1]
    elif fmt == "kaldi":  # joined lines: ids were checked when the data directory was joined
        cells = bline.decode("utf-8").rstrip("\r\n").split("\t", 7)
        if len(cells) == 8:
            return cells[0], cells[7]
    utt = parse_manifest_line(bline, lineno, fmt)
    return None if utt is None else (utt.utt_id, utt.path)


def line_error(split: str, path: str, lineno: int, exc: ManifestLineError) -> str:
    """The message of a bad manifest line: ``split 'x': file:line: utt 'id': problem``."""
    return f"split {split!r}: {path}:{lineno}: " + (f"utt {exc.utt_id!r}: " if exc.utt_id else "") + str(exc)


def parse_joined_line(line: str) -> Utterance:
    """An :class:`Utterance` from one line of a joined Kaldi data directory (see
    :mod:`espnet3_flows.kaldi_dir`)."""
    cells = line.split("\t", 7)
    if len(cells) != 8:
        raise ValueError(f"not a joined data-directory line ({len(cells)} fields)")
    utt, lineno, rec, start, end, speaker, text, entry = cells
    return Utterance(utt, entry, text, speaker, int(lineno), start=float(start),
                     end=float(end) if end else None, recording=rec)


def read_manifest(
    path: str,
    split: str = "",
    on_error: str = "fail",
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[list[Utterance], list[SkippedItem]]:
    """Read a whole TSV (``utt_id<TAB>wav_path[<TAB>text[<TAB>speaker_id]]``) or lhotse CutSet manifest.

    For small manifests and tools; jobs stream manifests into shard plans instead
    (:mod:`espnet3_flows.manifest_plan`). Blank lines and lines starting with ``#`` are
    ignored. Malformed lines, unsafe or duplicate ids and undecodable bytes raise
    :class:`ManifestError` naming the split, file and line, or are returned as skipped items
    under ``on_error="skip"``. A manifest with no usable line is always an error.

    Returns:
        The utterances in manifest order and the skipped lines.
    """
    check_on_error(on_error)
    fmt = manifest_format(path)
    utts: list[Utterance] = []
    skipped: list[SkippedItem] = []
    seen: dict[str, int] = {}
    for lineno, _, bline in iter_manifest_lines(path, split, storage_options):
        try:
            utt = parse_manifest_line(bline, lineno, fmt)
            if utt is None:
                continue
            if utt.utt_id in seen:
                raise ManifestLineError(f"duplicate utterance id {utt.utt_id!r} (first on line {seen[utt.utt_id]})",
                                        utt.utt_id)
        except ManifestLineError as exc:
            if on_error == "fail":
                raise ManifestError(line_error(split, path, lineno, exc)) from None
            skipped.append(SkippedItem(split, exc.utt_id, lineno, "", f"manifest: {exc}"))
            continue
        seen[utt.utt_id] = lineno
        utts.append(utt)
    if not utts:
        raise ManifestError(f"split {split!r}: manifest {path} has no usable utterance")
    return utts, skipped


def read_manifest_slice(source: Mapping[str, Any], split: str = "",
                        storage_options: Mapping[str, Any] | None = None) -> list[Utterance]:
    """The utterances of one shard: a byte range of a manifest (what a worker reads, nothing more).

    Args:
        source: ``{"path", "start", "end", "line", "skip", "sha256", "format", "origin"}`` as
            planned by :func:`espnet3_flows.manifest_plan.plan_manifest`: bytes ``[start, end)``
            of the (decompressed or joined) manifest, the number of their first line, lines left
            out (skipped or duplicate), the digest of the bytes, the line format, and for a data
            directory the file its utterances' line numbers count in.

    Raises:
        ManifestError: the bytes changed since planning (the manifest was edited: rerun).
    """
    path, start, end = str(source["path"]), int(source["start"]), int(source["end"])
    try:
        fs, fpath = fsspec.core.url_to_fs(path, **(storage_options or {}))
        data = fs.cat_file(fpath, start=start, end=end)
    except FileNotFoundError:
        raise ManifestError(f"split {split!r}: manifest not found: {path}") from None
    if hashlib.sha256(data).hexdigest() != source["sha256"]:
        raise ManifestError(f"split {split!r}: manifest {path} changed since the run was planned "
                            f"(bytes {start}-{end}); rerun to plan it again")
    skip = set(source.get("skip") or ())
    fmt = source_format(source)
    origin = str(source.get("origin") or "")
    utts = []
    lines = data.split(b"\n")  # as a file iterates: on "\n" only (bytes.splitlines would split on "\r")
    if lines and not lines[-1]:
        lines.pop()
    for lineno, bline in enumerate(lines, start=int(source["line"])):
        if lineno in skip:
            continue
        try:
            utt = parse_manifest_line(bline, lineno, fmt)
        except ManifestLineError as exc:
            raise ManifestError(line_error(split, path, lineno, exc)) from None
        if utt is not None:
            utts.append(replace(utt, origin=origin) if origin else utt)
    return utts


def _parse_tsv_line(line: str, lineno: int) -> Utterance:
    cells = line.split("\t")
    if len(cells) < 2 or not cells[0] or not cells[1]:
        raise ValueError(f"expected 'utt_id<TAB>wav_path[<TAB>text[<TAB>speaker_id]]', got {len(cells)} field(s)")
    if len(cells) > 4:
        raise ValueError(f"expected at most 4 tab-separated fields, got {len(cells)}")
    text = cells[2] if len(cells) > 2 else ""
    speaker = cells[3] if len(cells) > 3 else ""
    return Utterance(cells[0], cells[1], text, speaker, lineno)


def _parse_lhotse_line(line: str, lineno: int) -> Utterance:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON object: {exc.msg}") from None
    if not isinstance(d, dict) or "id" not in d:
        raise ValueError("a lhotse cut needs an 'id'")
    rec = d.get("recording") or {}
    sources = rec.get("sources") or []
    if not sources:
        raise ValueError(f"cut {d['id']!r} has no recording source")
    sup = (d.get("supervisions") or [{}])[0] if d.get("supervisions") else {}
    return Utterance(str(d["id"]), str(sources[0].get("source", "")), str(sup.get("text") or ""),
                     str(sup.get("speaker") or ""), lineno, d)


def write_skipped_tsv(items: list[SkippedItem]) -> str:
    """The text of ``skipped.tsv`` (a header line, then one line per skipped item)."""
    return "\n".join([SKIPPED_HEADER, *(s.tsv_line() for s in items)]) + "\n"
