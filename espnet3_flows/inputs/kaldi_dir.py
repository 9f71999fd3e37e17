"""Kaldi data directories as manifests: ``wav.scp`` with optional ``segments``, ``utt2spk`` and ``text``.

An ESPnet recipe's ``data/<set>`` directory is accepted wherever a manifest path is. Planning
joins its files once into one line per utterance, the *joined manifest*, written beside the
outputs (``<split>/shards/inputs/``) and reused until a file of the directory changes. It is then
planned and read by byte range like any manifest: a worker reads its shard's lines and nothing
else.

The join streams the files in Kaldi's order (keys sorted as ``LC_ALL=C sort`` sorts them, which
``utils/validate_data_dir.sh`` requires); a file out of order is sorted on local disk in chunks
first, so the driver's memory does not grow with the utterances. With ``segments``, ``wav.scp``
is held in memory: one entry per recording, not per utterance.

``wav.scp`` entries (what :mod:`espnet3_flows.inputs.audio` reads):

- a path or fsspec URL of an audio file (relative paths are relative to the directory the job is
  started in, as in a recipe);
- ``file.ark:offset`` (or ``ark:file.ark:offset``): a WAV stored in a Kaldi archive (kaldiio);
- ``command |``: the command's standard output is the audio. Commands run only when the job's
  ``allow_pipes`` is true: a manifest read from storage or given as a UI parameter must not
  execute commands otherwise.

A joined line is ``utt_id, line, recording, start, end, speaker, text, entry`` (tab-separated;
``line`` is the utterance's line in ``segments``, or in ``wav.scp`` without segments).
"""

from __future__ import annotations

import os
import posixpath
import re
import tempfile
from dataclasses import dataclass, field
from typing import IO, Any
from collections.abc import Iterator, Mapping

import fsspec

from espnet3_flows.config import check_on_error
from espnet3_flows.deadlines import with_deadlines
from espnet3_flows.errors import quote
from espnet3_flows.inputs.fingerprints import fingerprint_files
from espnet3_flows.inputs.kaldi_files import BadLine, Line, SortedLookup, Unsorted, in_order, parse_lines, sorted_on_disk
from espnet3_flows.inputs.records import (
    ManifestError,
    SkippedItem,
    Utterance,
    entry_kind,
    validate_speaker_id,
    validate_utt_id,
)
from espnet3_flows.hashing import token
from espnet3_flows.storage import Storage

#: The files of a data directory this module reads (``wav.scp`` is required)
DATA_DIR_FILES = ("wav.scp", "segments", "utt2spk", "text")
#: Version of the joined line layout (part of the joined file's name)
JOINED_VERSION = "kaldi-join/1"
_ARK_OFFSET = re.compile(r".+:\d+(\[[^\]]*\])?")


def normalize_entry(rest: str, cwd: str) -> str:
    """A ``wav.scp`` entry as :class:`~espnet3_flows.inputs.manifest.Utterance.path` holds it.

    ``file.ark:offset`` becomes ``ark:/abs/file.ark:offset``; a relative local path becomes
    absolute against ``cwd`` (workers may start elsewhere); URLs and commands are kept.
    """
    entry = rest.strip()
    if entry.startswith("/") and ":" not in entry and "|" not in entry:
        return entry  # the common case: an absolute path
    if entry_kind(entry) == "pipe":
        return entry
    if entry.startswith("ark:"):
        return "ark:" + _absolute(entry[len("ark:"):], cwd)
    if "://" not in entry and _ARK_OFFSET.fullmatch(entry):
        return "ark:" + _absolute(entry, cwd)
    return _absolute(entry, cwd)


def _absolute(path: str, cwd: str) -> str:
    if "://" in path or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(cwd, path))


def is_data_dir(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``path`` is a directory (local or fsspec URL); one holding ``wav.scp`` is a data
    directory, see :func:`data_dir_files` for the error otherwise."""
    if "://" not in path or path.startswith("file://"):
        return os.path.isdir(path[len("file://"):] if path.startswith("file://") else path)
    try:
        fs, p = fsspec.core.url_to_fs(path, **with_deadlines(storage_options, path))
        return bool(fs.isdir(p))
    except Exception:  # noqa: BLE001 - a manifest that cannot be listed is reported when it is read
        return False


def data_dir_files(data_dir: str, split: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The files of a data directory that exist, by name (``wav.scp`` always).

    Raises:
        ManifestError: the directory has no ``wav.scp``.
    """
    base = data_dir.rstrip("/")
    paths = {name: posixpath.join(base, name) for name in DATA_DIR_FILES}
    prints = fingerprint_files(list(paths.values()), storage_options)
    found = {name: p for name, p in paths.items() if prints[p] != "missing"}
    if "wav.scp" not in found:
        raise ManifestError(f"split {split!r}: {data_dir} is a directory without wav.scp (a manifest is a TSV "
                            "file, a lhotse .jsonl[.gz] file, or a Kaldi data directory with wav.scp)")
    return found


@dataclass
class JoinResult:
    """What joining a data directory found.

    Attributes:
        origin: The file utterance line numbers count in (``segments`` or ``wav.scp``).
        utterances: Utterances written.
        skipped: Lines left out under ``on_error: skip``.
        first_pipe: ``{"file", "line", "command"}`` of the first command entry, if any.
        cwd: Directory relative paths and commands were resolved against.
    """

    origin: str
    utterances: int = 0
    skipped: list[SkippedItem] = field(default_factory=list)
    first_pipe: dict[str, Any] | None = None
    cwd: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (the joined file's sidecar)."""
        return {"version": JOINED_VERSION, "origin": self.origin, "utterances": self.utterances,
                "skipped": [s.to_dict() for s in self.skipped], "first_pipe": self.first_pipe, "cwd": self.cwd}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JoinResult:
        """Inverse of :meth:`to_dict`."""
        return cls(str(d["origin"]), int(d["utterances"]), [SkippedItem.from_dict(s) for s in d.get("skipped", [])],
                   d.get("first_pipe"), str(d.get("cwd", "")))


def join_data_dir(data_dir: str, split: str, out: IO[bytes], *, on_error: str = "fail",
                  storage_options: Mapping[str, Any] | None = None, cwd: str | None = None,
                  check_speakers: bool = False) -> JoinResult:
    """Write one joined line per utterance of a data directory to ``out``, in utterance id order.

    Bad lines (undecodable, malformed, an unsafe or repeated id, a segment whose end is not after
    its start, a segment of a recording missing from ``wav.scp``, and with ``check_speakers`` an
    ``utt2spk`` speaker id that fails :func:`~espnet3_flows.inputs.records.validate_speaker_id`)
    raise :class:`ManifestError` naming the file and line under ``on_error: fail``, and are left
    out and listed under ``skip``.

    Raises:
        ManifestError: a bad line under ``fail``, no ``wav.scp``, or no usable utterance.
    """
    check_on_error(on_error)
    files = data_dir_files(data_dir, split, storage_options)
    cwd = os.path.abspath(cwd or os.getcwd())
    to_sort: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="espnet3-kaldi-join-") as tmpdir:
        while True:
            out.seek(0)
            out.truncate()
            try:
                result = _join(files, split, out, on_error, storage_options, cwd, to_sort, tmpdir, check_speakers)
                break
            except Unsorted as exc:
                to_sort.add(exc.name)
    if not result.utterances:
        raise ManifestError(f"split {split!r}: data directory {data_dir} has no usable utterance")
    return result


def _join(files: Mapping[str, str], split: str, out: IO[bytes], on_error: str,
          storage_options: Mapping[str, Any] | None, cwd: str, to_sort: set[str], tmpdir: str,
          check_speakers: bool) -> JoinResult:
    segments = "segments" in files
    origin = files["segments" if segments else "wav.scp"]
    result = JoinResult(origin, cwd=cwd)

    def bad(name: str, lineno: int, key: str, problem: str) -> None:
        """A bad line: raised under ``fail``, listed under ``skip``. Keys of ``wav.scp`` are
        recording ids when there are segments, utterance ids everywhere else."""
        utt = key if name != "wav.scp" or not segments else ""
        recording = f"recording {quote(key)}: " if key and not utt else ""
        if on_error == "fail":
            who = f"utt {quote(utt)}: " if utt else recording
            raise ManifestError(f"split {split!r}: {files[name]}:{lineno}: {who}{problem}")
        result.skipped.append(SkippedItem(split, utt, lineno, files[name], f"{name}: {recording}{problem}"))

    def stream(name: str) -> Iterator[Line] | None:
        if name not in files:
            return None
        lines = parse_lines(files[name], name, split, storage_options, bad)
        return sorted_on_disk(lines, tmpdir) if name in to_sort else in_order(lines, name)

    recordings = _recordings(files["wav.scp"], split, storage_options, bad, cwd) if segments else {}
    speakers = SortedLookup(stream("utt2spk"), "utt2spk", bad)
    texts = SortedLookup(stream("text"), "text", bad)
    driver = stream("segments" if segments else "wav.scp")
    assert driver is not None
    origin_name = "segments" if segments else "wav.scp"
    prev_utt, prev_line = "", 0
    lines: list[str] = []
    for utt, rest, lineno in driver:
        if utt == prev_utt:
            bad(origin_name, lineno, utt, f"duplicate utterance id {utt!r} (first on line {prev_line})")
            continue
        prev_utt, prev_line = utt, lineno
        try:
            validate_utt_id(utt)
            if segments:
                rec, start, end = _parse_segment(rest)
                if rec not in recordings:
                    raise ValueError(f"recording {rec!r} is not in wav.scp")
                entry = recordings[rec][0]
                times = f"{start!r}\t{'' if end is None else repr(end)}"
            else:
                if not rest:
                    raise ValueError("no audio entry after the id")
                rec, entry, times = "", normalize_entry(rest, cwd), "0.0\t"
        except ValueError as exc:
            bad(origin_name, lineno, utt, str(exc))
            continue
        speaker = speakers.get(utt)
        if check_speakers and speaker:
            try:
                validate_speaker_id(speaker)
            except ValueError as exc:
                bad("utt2spk", speakers.line, utt, str(exc))
                continue
        if result.first_pipe is None and "|" in entry and entry_kind(entry) == "pipe":
            pipe_line = recordings[rec][1] if segments else lineno
            result.first_pipe = {"file": files["wav.scp"], "line": pipe_line, "command": entry}
        text = texts.get(utt)
        if "\t" in text or "\t" in speaker or "\r" in text or "\r" in speaker:  # the joined line's separators
            speaker = speaker.replace("\t", " ").replace("\r", " ")
            text = text.replace("\t", " ").replace("\r", " ")
        lines.append(f"{utt}\t{lineno}\t{rec}\t{times}\t{speaker}\t{text}\t{entry}\n")
        if len(lines) >= 4096:
            out.write("".join(lines).encode("utf-8"))
            result.utterances += len(lines)
            lines.clear()
    out.write("".join(lines).encode("utf-8"))
    result.utterances += len(lines)
    speakers.drain()
    texts.drain()
    return result


def _recordings(wav_scp: str, split: str, storage_options: Mapping[str, Any] | None, bad: BadLine,
                cwd: str) -> dict[str, tuple[str, int]]:
    """``wav.scp`` of a directory with segments: recording id → (audio entry, line)."""
    recordings: dict[str, tuple[str, int]] = {}
    for rec, rest, lineno in parse_lines(wav_scp, "wav.scp", split, storage_options, bad):
        if rec in recordings:
            bad("wav.scp", lineno, rec, f"duplicate recording id (first on line {recordings[rec][1]})")
            continue
        if not rest:
            bad("wav.scp", lineno, rec, "no audio entry after the id")
            continue
        recordings[rec] = (normalize_entry(rest, cwd), lineno)
    return recordings


def _parse_segment(rest: str) -> tuple[str, float, float | None]:
    """``recording start end`` of a segments line (``end`` -1: to the end of the recording)."""
    fields = rest.split()
    if len(fields) != 3:
        raise ValueError(f"expected 'utt_id recording_id start end', got {len(fields) + 1} field(s)")
    rec = fields[0]
    try:
        start, end = float(fields[1]), float(fields[2])
    except ValueError:
        raise ValueError(f"start and end must be numbers of seconds, got {fields[1]!r} and {fields[2]!r}") from None
    if not (start >= 0 and start < float("inf")):
        raise ValueError(f"start {fields[1]} must be a time >= 0")
    if end == -1:
        return rec, start, None
    if not end > start or end == float("inf"):
        raise ValueError(f"end {fields[2]} must be after start {fields[1]} (or -1 for the end of the recording)")
    return rec, start, end


def parse_joined_line(line: str) -> Utterance:
    """An :class:`~espnet3_flows.inputs.records.Utterance` from one joined line."""
    cells = line.split("\t", 7)
    if len(cells) != 8:
        raise ValueError(f"not a joined data-directory line ({len(cells)} fields)")
    utt, lineno, rec, start, end, speaker, text, entry = cells
    return Utterance(utt, entry, text, speaker, int(lineno), start=float(start),
                     end=float(end) if end else None, recording=rec)


def joined_hash_payload(raw: bytes) -> bytes:
    """What a shard hash covers of a joined line: everything but its line number, so lines added
    earlier in ``wav.scp`` do not change the hashes of later utterances."""
    utt, _, rest = raw.rstrip(b"\r\n").split(b"\t", 2)
    return utt + b"\t" + rest


# -- the joined file beside the outputs -----------------------------------------------


@dataclass
class JoinedDataDir:
    """A data directory joined for planning.

    Attributes:
        path: URI of the joined file the workers read.
        join: What the join found (origin, skipped lines, first command entry, cwd).
    """

    path: str
    join: JoinResult


def prepare_joined(data_dir: str, split: str, store: Storage, rel: str, *, on_error: str = "fail",
                   storage_options: Mapping[str, Any] | None = None, check_speakers: bool = False) -> JoinedDataDir:
    """The joined file of a data directory below ``store/rel``, joined now unless a join of the
    same files (by size and mtime, or ETag) with the same speaker-id check is already there.

    A join kept from an ``on_error: skip`` run that left lines out is an error under ``fail``.

    Raises:
        ManifestError: as :func:`join_data_dir`.
    """
    files = data_dir_files(data_dir, split, storage_options)
    prints = fingerprint_files(list(files.values()), storage_options)
    cwd = os.getcwd()
    # a join that checked speaker ids is another file: a join without the check may hold ids it refuses
    key = token(JOINED_VERSION, [sorted(files.items()), sorted(prints.items()), cwd, *(["speakers"] * check_speakers)],
                16)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", posixpath.basename(data_dir.rstrip("/")) or "data")
    name = posixpath.join(rel, f"{stem}-{key}.kaldi.tsv")
    meta = store.read_json(name + ".json") if store.exists(name) else None
    if meta is not None and meta.get("version") == JOINED_VERSION:
        result = JoinResult.from_dict(meta)
        if on_error == "fail" and result.skipped:
            raise ManifestError(_skipped_as_error(result.skipped[0], split))
        return JoinedDataDir(store.uri(name), result)
    with store.atomic_writer(name) as out:
        result = join_data_dir(data_dir, split, out, on_error=on_error, storage_options=storage_options, cwd=cwd,
                               check_speakers=check_speakers)
        store.write_json(name + ".json", result.to_dict())  # the sidecar first: the joined file marks completion
    return JoinedDataDir(store.uri(name), result)


def _skipped_as_error(item: SkippedItem, split: str) -> str:
    problem = item.reason.partition(": ")[2]  # "<file name>: problem"
    who = f"utt {item.utt_id!r}: " if item.utt_id else ""
    return f"split {split!r}: {item.path}:{item.line}: {who}{problem}"


def refuse_pipes(joined: JoinedDataDir, split: str) -> None:
    """Raise :class:`ManifestError` naming the first command entry (for ``allow_pipes: false``)."""
    pipe = joined.join.first_pipe
    if pipe:
        raise ManifestError(f"split {split!r}: {pipe['file']}:{pipe['line']}: the entry {pipe['command']!r} is a "
                            "command; commands in wav.scp run only with allow_pipes=true (set it only for data "
                            "directories you trust: the command runs on every worker)")


__all__ = ["DATA_DIR_FILES", "JoinResult", "JoinedDataDir", "data_dir_files", "is_data_dir", "join_data_dir",
           "joined_hash_payload", "normalize_entry", "parse_joined_line", "prepare_joined", "refuse_pipes"]
