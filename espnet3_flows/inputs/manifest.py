"""Reading manifests: a manifest's raw lines, one line parsed by its format, a whole small
manifest, and the byte range of one shard (what a worker reads). Formats come from the registry
(:mod:`espnet3_flows.inputs.formats`)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import zlib
from dataclasses import replace
from typing import IO, Any
from collections.abc import Iterator, Mapping

import fsspec

from espnet3_flows.config import check_on_error
from espnet3_flows.deadlines import with_deadlines
from espnet3_flows.errors import clip
from espnet3_flows.inputs.formats import ManifestFormat, detect_format, format_named
from espnet3_flows.inputs.records import (
    ManifestError,
    ManifestLineError,
    SkippedItem,
    Utterance,
    line_error,
    validate_speaker_id,
    validate_utt_id,
)

BOM = b"\xef\xbb\xbf"
#: The most bytes a manifest line may have, its newline included (1 MiB). A longer line is a bad
#: line (named, and left out under ``on_error: skip``); it is never held whole in memory.
MAX_LINE_BYTES = 1 << 20


class OversizeLine(bytes):
    """The first :data:`MAX_LINE_BYTES` bytes of a longer manifest line; ``size`` is the whole
    line's length (what it occupies in the file). Every reader of manifest lines sees this head in
    its place, so a shard's digest covers the same bytes on the driver and on the worker."""

    size: int

    def __new__(cls, head: bytes, size: int) -> OversizeLine:
        line = super().__new__(cls, head)
        line.size = size
        return line


def line_size(bline: bytes) -> int:
    """The bytes a line read by :func:`bounded_lines` occupies in its file."""
    return bline.size if isinstance(bline, OversizeLine) else len(bline)


def bounded_lines(stream: IO[bytes], limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """A binary stream's lines (split on ``\\n`` only, as a file iterates), never holding more than
    ``limit`` bytes of one: a longer line comes as an :class:`OversizeLine` of its first ``limit``
    bytes, the rest read and dropped ``limit`` bytes at a time."""
    if not isinstance(stream, io.BufferedIOBase):  # fsspec's remote files: readline takes no limit
        stream = io.BufferedReader(stream)  # type: ignore[arg-type]
    readline = stream.readline
    while line := readline(limit):
        if len(line) < limit or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while (rest := readline(limit)):
            size += len(rest)
            if rest.endswith(b"\n"):
                break
        yield line if size == limit else OversizeLine(line, size)  # a last line of exactly ``limit`` bytes


def iter_manifest_lines(path: str, split: str = "",
                        storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[int, int, bytes]]:
    """Stream a manifest's raw lines as ``(line number, byte offset after the line, bytes)``.

    Offsets count bytes of the decompressed text (``.gz`` manifests are decompressed on the
    fly), so ``[end of line k, end of line m)`` is the byte range of lines ``k+1..m``. A line
    longer than :data:`MAX_LINE_BYTES` comes as an :class:`OversizeLine` (see :func:`bounded_lines`).

    Raises:
        ManifestError: the file is missing, unreadable, or not the gzip its name says, naming
            split and file.
    """
    try:
        with contextlib.ExitStack() as stack:
            raw = stack.enter_context(fsspec.open(path, "rb", **with_deadlines(storage_options, path)))
            stream = stack.enter_context(gzip.GzipFile(fileobj=raw)) if path.endswith(".gz") else raw
            end, held = 0, None
            # one line held back: a truncated gzip stream ends in a partial line, then EOFError,
            # and the error must name the file, not the partial line's parse failure
            for lineno, bline in enumerate(bounded_lines(stream), start=1):
                if held is not None:
                    yield held
                end += line_size(bline)
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
    except Exception as exc:  # remote back ends raise many types
        raise ManifestError(f"split {split!r}: cannot read manifest {path}: {type(exc).__name__}: {exc}") from exc


def parse_manifest_line(bline: bytes, lineno: int, fmt: str | ManifestFormat = "tsv",
                        speakers: bool = False) -> Utterance | None:
    """Parse one raw manifest line of format ``fmt`` (a registered format or its name); ``None``
    for a blank or comment line.

    A UTF-8 byte-order mark at the start of line 1 is dropped. With ``speakers`` (a job that
    keys files by speaker id) a speaker id is checked too
    (:func:`~espnet3_flows.inputs.records.validate_speaker_id`).

    Raises:
        ManifestLineError: undecodable bytes, a malformed line or an unsafe id.
    """
    fmt = format_named(fmt)
    if lineno == 1 and bline.startswith(BOM):
        bline = bline[len(BOM):]
    if isinstance(bline, OversizeLine):
        uid = fmt.line_id(bline[:4 * 200].decode("utf-8", "backslashreplace"))
        raise ManifestLineError(f"line is longer than {MAX_LINE_BYTES} bytes (1 MiB), the most a manifest line may "
                                "have", clip(uid))
    try:
        line = bline.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        uid = fmt.line_id(bline.decode("utf-8", "backslashreplace"))
        raise ManifestLineError(f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})", clip(uid)) from None
    if not line.strip() or fmt.comment_prefix is not None and line.startswith(fmt.comment_prefix):
        return None
    try:
        utt = fmt.parse_line(line, lineno)
        validate_utt_id(utt.utt_id)
        if speakers and utt.speaker:
            validate_speaker_id(utt.speaker)
    except ValueError as exc:
        raise ManifestLineError(str(exc), clip(fmt.line_id(line))) from None
    return utt


def planning_fields(bline: bytes, lineno: int, fmt: str | ManifestFormat = "tsv",
                    speakers: bool = False) -> tuple[str, str] | None:
    """``(utt_id, audio entry)`` of a manifest line for planning; ``None`` for blank or comment lines.

    The format's quick path takes the common line; anything else, and every line when its speaker
    id is to be checked too (``speakers``), goes through :func:`parse_manifest_line` (same checks,
    same errors).

    Raises:
        ManifestLineError: as :func:`parse_manifest_line`.
    """
    fmt = format_named(fmt)
    if not speakers and (lineno > 1 or not bline.startswith(BOM)) and not isinstance(bline, OversizeLine):
        fields = fmt.quick_fields(bline, lineno)
        if fields is not None:
            return fields
    utt = parse_manifest_line(bline, lineno, fmt, speakers)
    return None if utt is None else (utt.utt_id, fmt.planning_entry(utt))


def read_manifest(
    path: str,
    split: str = "",
    on_error: str = "fail",
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[list[Utterance], list[SkippedItem]]:
    """Read a whole TSV (``utt_id<TAB>wav_path[<TAB>text[<TAB>speaker_id]]``) or lhotse CutSet manifest.

    For small manifests and tools; jobs stream manifests into shard plans instead
    (:mod:`espnet3_flows.inputs.planner`). Blank lines and lines starting with ``#`` are
    ignored. Malformed lines, unsafe or duplicate ids and undecodable bytes raise
    :class:`ManifestError` naming the split, file and line, or are returned as skipped items
    under ``on_error="skip"``. A manifest with no usable line is always an error.

    Returns:
        The utterances in manifest order and the skipped lines.
    """
    check_on_error(on_error)
    fmt = detect_format(path, storage_options)
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
            planned by :func:`espnet3_flows.inputs.planner.plan_manifest`: bytes ``[start, end)``
            of the (decompressed or joined) manifest, the number of their first line, lines left
            out (skipped or duplicate), the digest of the bytes, the line format, and for a data
            directory the file its utterances' line numbers count in.

    Raises:
        ManifestError: the bytes changed since planning (the manifest was edited: rerun).
    """
    path, start, end = str(source["path"]), int(source["start"]), int(source["end"])
    skip = set(source.get("skip") or ())
    fmt = format_named(source["format"]) if "format" in source else detect_format(path, storage_options)
    origin = str(source.get("origin") or "")
    kept: list[tuple[int, bytes]] = []
    digest = hashlib.sha256()
    try:
        fs, fpath = fsspec.core.url_to_fs(path, **with_deadlines(storage_options, path))
        with fs.open(fpath, "rb") as f:
            f.seek(start)
            lineno, at = int(source["line"]), start
            # line by line, as the planner read them: no line is held longer than the bound
            for bline in bounded_lines(f):
                if at >= end:
                    break
                at += line_size(bline)
                digest.update(bline)
                if lineno not in skip:
                    kept.append((lineno, bline))
                lineno += 1
    except FileNotFoundError:
        raise ManifestError(f"split {split!r}: manifest not found: {path}") from None
    if at != end or digest.hexdigest() != source["sha256"]:  # checked before any line is parsed
        raise ManifestError(f"split {split!r}: manifest {path} changed since the run was planned "
                            f"(bytes {start}-{end}); rerun to plan it again")
    utts = []
    for lineno, bline in kept:
        try:
            utt = parse_manifest_line(bline, lineno, fmt)
        except ManifestLineError as exc:
            raise ManifestError(line_error(split, path, lineno, exc)) from None
        if utt is not None:
            utts.append(replace(utt, origin=origin) if origin else utt)
    return utts
