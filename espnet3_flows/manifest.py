"""Input manifests: utterance records from TSV files or lhotse CutSets, validated line by line."""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import fsspec

ON_ERROR_POLICIES = ("fail", "skip")
_UNSAFE_CHARS = {"/", "\\", "\0", "\n", "\r", "\t", " "}


class ManifestError(ValueError):
    """A manifest file or one of its lines is invalid; the message names split, file and line."""


@dataclass(frozen=True)
class Utterance:
    """One input item of a speech job.

    Attributes:
        utt_id: Unique id; safe to use as a file name (see :func:`validate_utt_id`).
        path: Local path or fsspec URL of the audio file.
        text: Transcript (may be empty).
        speaker: Speaker id (may be empty).
        line: 1-based line in the manifest (0 for lhotse cuts without lines).
        cut: For lhotse manifests, the cut as a dict; audio is then loaded through lhotse.
    """

    utt_id: str
    path: str
    text: str = ""
    speaker: str = ""
    line: int = 0
    cut: Mapping[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Utterance":
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(d))

    def where(self, split: str = "") -> str:
        """Human-readable location: ``split train, line 12, utt 'u1' (/data/u1.wav)``."""
        parts = [f"split {split}"] if split else []
        if self.line:
            parts.append(f"line {self.line}")
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


def read_manifest(
    path: str,
    split: str = "",
    on_error: str = "fail",
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[list[Utterance], list[SkippedItem]]:
    """Read a TSV (``utt_id<TAB>wav_path[<TAB>text[<TAB>speaker_id]]``) or lhotse CutSet manifest.

    Blank lines and lines starting with ``#`` are ignored. Malformed lines, unsafe or
    duplicate ids and undecodable bytes raise :class:`ManifestError` naming the split, file
    and line, or are returned as skipped items under ``on_error="skip"``. A manifest with
    no usable line is always an error.

    Returns:
        The utterances in manifest order and the skipped lines.
    """
    if on_error not in ON_ERROR_POLICIES:
        raise ValueError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            raw = f.read()
    except FileNotFoundError:
        raise ManifestError(f"split {split!r}: manifest not found: {path}") from None
    except Exception as exc:  # noqa: BLE001 - remote back ends raise many types
        raise ManifestError(f"split {split!r}: cannot read manifest {path}: {exc}") from exc
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    parse = _parse_lhotse_line if is_lhotse_manifest(path) else _parse_tsv_line
    utts: list[Utterance] = []
    skipped: list[SkippedItem] = []
    seen: dict[str, int] = {}
    for lineno, bline in enumerate(io.BytesIO(raw), start=1):
        try:
            line = bline.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            problem = f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            uid = "" if is_lhotse_manifest(path) else bline.split(b"\t", 1)[0].decode("utf-8", "backslashreplace")
            _fail_or_skip(on_error, skipped, split, path, lineno, uid, "", problem)
            continue
        if not line.strip() or line.startswith("#"):
            continue
        try:
            utt = parse(line, lineno)
            validate_utt_id(utt.utt_id)
            if utt.utt_id in seen:
                raise ValueError(f"duplicate utterance id {utt.utt_id!r} (first on line {seen[utt.utt_id]})")
        except ValueError as exc:
            uid = line.split("\t", 1)[0] if not is_lhotse_manifest(path) else ""
            _fail_or_skip(on_error, skipped, split, path, lineno, uid, "", str(exc))
            continue
        seen[utt.utt_id] = lineno
        utts.append(utt)
    if not utts:
        raise ManifestError(f"split {split!r}: manifest {path} has no usable utterance")
    return utts, skipped


def _fail_or_skip(on_error: str, skipped: list[SkippedItem], split: str, path: str, lineno: int,
                  utt_id: str, audio: str, problem: str) -> None:
    msg = f"split {split!r}: {path}:{lineno}: " + (f"utt {utt_id!r}: " if utt_id else "") + problem
    if on_error == "fail":
        raise ManifestError(msg)
    skipped.append(SkippedItem(split, utt_id, lineno, audio, f"manifest: {problem}"))


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
