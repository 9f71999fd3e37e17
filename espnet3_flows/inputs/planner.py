"""Streaming a split's manifest into a compact shard plan: one pass, memory per shard, not per utterance.

The driver reads each manifest once: it parses and checks every line, fingerprints the audio
files in batches, cuts content-defined shards and hashes them, and keeps, per shard, only the
byte range of its lines (plus the few lines to leave out). Duplicate ids are found from 64-bit
id hashes (8 bytes an utterance) and confirmed by a second look at the colliding ids only.
Workers then read just their shard's bytes (:func:`~espnet3_flows.inputs.manifest.read_manifest_slice`).
A gzip-compressed manifest is decompressed once (streamed, a line at a time) into a plain spool
file beside the outputs, which the workers read by byte range instead and reruns reuse; a line
longer than :data:`~espnet3_flows.inputs.manifest.MAX_LINE_BYTES` is left out (or fails the plan)
and only its first ``MAX_LINE_BYTES`` bytes are spooled in its place, so the spool is never larger
than the manifest's lines within the bound; a manifest that is not a line file (a Kaldi data
directory, a dataset on disk) is written into one such file by its format
(:meth:`~espnet3_flows.inputs.formats.ManifestFormat.prepare`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from array import array
from dataclasses import dataclass, field
from typing import IO, Any
from collections.abc import Mapping

import numpy as np

from espnet3_flows.config import check_on_error
from espnet3_flows.errors import quote
from espnet3_flows.inputs.fingerprints import MISSING, Fingerprinter, fingerprint_files
from espnet3_flows.inputs.formats import ManifestFormat, PreparedManifest, detect_format
from espnet3_flows.inputs.manifest import OversizeLine, iter_manifest_lines, parse_manifest_line, planning_fields
from espnet3_flows.inputs.records import ManifestError, ManifestLineError, SkippedItem, line_error
from espnet3_flows.hashing import code_salt, config_digest, id_hash64, item_key, token
from espnet3_flows.sharding import Shard, ShardCutter, ShardPlan, split_shard_size
from espnet3_flows.storage import Storage

#: Paths fingerprinted at a time while planning (one stat batch or one object-store listing)
FINGERPRINT_BLOCK = 4096
#: Bytes of manifest lines held at a time while planning (lines of up to 1 MiB each: a block of
#: long lines is fingerprinted before it has FINGERPRINT_BLOCK paths)
BLOCK_BYTES = 64 << 20


@dataclass
class SplitPlan:
    """A split's shard plan and what planning found.

    Attributes:
        plan: The shards; each ``source`` is a byte range of ``manifest``.
        skipped: Manifest lines left out under ``on_error: skip`` (bad lines, duplicate ids).
        manifest: The file the workers read (the manifest, or its decompressed spool).
    """

    plan: ShardPlan
    skipped: list[SkippedItem] = field(default_factory=list)
    manifest: str = ""


def _local_abspath(path: str) -> str:
    """Local paths made absolute, so workers in another directory read the same file."""
    if "://" in path and not path.startswith("file://"):
        return path
    return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)


def plan_manifest(
    manifest: str,
    split: str,
    shard_size: int,
    config: Mapping[str, Any],
    *,
    on_error: str = "fail",
    fingerprint: str = "stat",
    storage_options: Mapping[str, Any] | None = None,
    spool: Storage | None = None,
    spool_rel: str = "",
    salt: str | None = None,
    allow_pipes: bool = False,
    workers: int = 1,
    speakers: bool = False,
) -> SplitPlan:
    """Plan one split from its manifest in a streaming pass.

    A shard's hash covers each of its lines (id, path, text, ...) with the audio file's
    fingerprint, the job ``config`` and the code salt; boundaries follow the utterance ids
    (see :class:`~espnet3_flows.sharding.ShardCutter`).

    Args:
        manifest: TSV or lhotse ``.jsonl[.gz]`` manifest, or a Kaldi data directory; path or URL.
        split: Split name (for messages).
        shard_size: Mean utterances per shard.
        config: The job config that affects outputs.
        on_error: ``fail`` raises :class:`ManifestError` at the first bad line; ``skip`` leaves
            bad lines and repeated ids out and lists them.
        fingerprint: ``stat`` or ``manifest`` (see :mod:`espnet3_flows.inputs.fingerprints`).
        storage_options: fsspec options for a remote manifest and remote audio.
        spool: Storage where a compressed manifest is decompressed, or a data directory joined,
            for the workers.
        spool_rel: Directory below ``spool`` for that file.
        salt: Code-version salt (:func:`~espnet3_flows.hashing.code_salt` by default).
        allow_pipes: Whether commands (``cmd |``) may stand for audio; otherwise a data
            directory's first command entry is an error.
        workers: Shards computed at once: a split of fewer than ``2 × workers × shard_size``
            utterances is planned again, cut finer (:func:`~espnet3_flows.sharding.split_shard_size`);
            that second pass reads at most that many lines.
        speakers: Whether speaker ids are checked as utterance ids' characters are
            (:func:`~espnet3_flows.inputs.records.validate_speaker_id`): for a job that writes files
            keyed by them (``utt2spk``, ``spk_xvector.scp``).

    Raises:
        ManifestError: a bad line under ``fail``, a repeated id under ``fail``, an unreadable
            manifest, a refused command, or a manifest with no usable line.
    """
    planned = _plan_split(manifest, split, shard_size, config, on_error, fingerprint, storage_options, spool, spool_rel,
                          salt, allow_pipes, speakers)
    size = split_shard_size(shard_size, planned.plan.num_items, workers)
    if size == shard_size:
        return planned
    return _plan_split(manifest, split, size, config, on_error, fingerprint, storage_options, spool, spool_rel, salt,
                       allow_pipes, speakers)


def _plan_split(manifest: str, split: str, shard_size: int, config: Mapping[str, Any], on_error: str,
                fingerprint: str, storage_options: Mapping[str, Any] | None, spool: Storage | None, spool_rel: str,
                salt: str | None, allow_pipes: bool, speakers: bool) -> SplitPlan:
    """:func:`plan_manifest` with one shard size."""
    check_on_error(on_error)
    manifest = _local_abspath(manifest)
    fmt = detect_format(manifest, storage_options)
    # (asked only where a job needs it: a plugin format's older prepare() takes no such keyword)
    speaker_check = {"check_speakers": True} if speakers else {}
    prepared = fmt.prepare(manifest, split, spool=spool, spool_rel=spool_rel, on_error=on_error,
                           storage_options=storage_options, allow_pipes=allow_pipes, **speaker_check)
    if prepared is not None and prepared.checked:
        return _plan_checked(manifest, fmt, prepared, split, shard_size, config, fingerprint, storage_options, salt)
    source_path, writer_target = manifest, None
    if prepared is not None:
        source_path = prepared.path
    elif manifest.endswith(".gz"):
        if spool is None:
            raise ManifestError(f"split {split!r}: a compressed manifest ({manifest}) needs an output location "
                                "to decompress it into")
        source_path, writer_target = _spool_target(manifest, split, spool, spool_rel, storage_options)
    salt = code_salt() if salt is None else salt
    excluded: dict[int, str] = {}
    with Fingerprinter(fingerprint, storage_options) as fingerprinter:
        while True:
            # the first pass decompresses the manifest beside the outputs, visible once whole
            spooling = writer_target is not None
            read_from = manifest if spooling else source_path  # the spool once it is written
            source = _Source(source_path, fmt, origin=prepared.origin if prepared else "",
                             cwd=prepared.cwd if prepared else "")
            with (writer_target.atomic_writer(source_path[len(writer_target.uri()):].lstrip("/")) if spooling
                  else contextlib.nullcontext()) as spool_out:
                plan, skipped, id_hashes = _plan_pass(manifest, source, split, shard_size, config, on_error,
                                                      fingerprinter, storage_options, salt, excluded, spool_out,
                                                      read_from, allow_pipes, speakers)
            writer_target = None  # the spool is written by the first pass only
            repeated = _repeated_ids(source_path, fmt, split, id_hashes, storage_options, excluded)
            if not repeated:
                break
            if on_error == "fail":
                lineno, (uid, first) = min(repeated.items())
                raise ManifestError(f"split {split!r}: {manifest}:{lineno}: utt {uid!r}: duplicate utterance id "
                                    f"{uid!r} (first on line {first})")
            excluded.update({line: f"duplicate utterance id {uid!r} (first on line {first})"
                             for line, (uid, first) in repeated.items()})
    if not plan.shards:
        raise ManifestError(f"split {split!r}: manifest {manifest} has no usable utterance")
    return SplitPlan(plan, (prepared.skipped if prepared else []) + skipped, source_path)


def _plan_checked(manifest: str, fmt: ManifestFormat, prepared: PreparedManifest, split: str, shard_size: int,
                  config: Mapping[str, Any], fingerprint: str, storage_options: Mapping[str, Any] | None,
                  salt: str | None) -> SplitPlan:
    """Plan a prepared line file whose ids are unique and lines valid by construction (a joined
    Kaldi data directory): one pass, any bad line is a bug, not an item to skip."""
    source = _Source(prepared.path, fmt, origin=prepared.origin, cwd=prepared.cwd)
    with Fingerprinter(fingerprint, storage_options) as fingerprinter:
        plan, skipped, _ = _plan_pass(prepared.path, source, split, shard_size, config, "fail", fingerprinter,
                                      storage_options, code_salt() if salt is None else salt, {}, None, prepared.path,
                                      allow_pipes=True)  # the format refused commands while preparing
    return SplitPlan(plan, prepared.skipped + skipped, prepared.path)


@dataclass(frozen=True)
class _Source:
    """The file workers read and how: its line format, and for a prepared manifest (a joined data
    directory) the file line numbers count in and the directory commands run in."""

    path: str
    format: ManifestFormat
    origin: str = ""
    cwd: str = ""


def _spool_target(manifest: str, split: str, spool: Storage, rel: str,
                  storage_options: Mapping[str, Any] | None) -> tuple[str, Storage | None]:
    """Where the decompressed manifest lives (named by the compressed file's fingerprint) and,
    when it does not exist yet, the storage to write it to."""
    stamp = fingerprint_files([manifest], storage_options)[manifest]
    if stamp == MISSING:
        raise ManifestError(f"split {split!r}: manifest not found: {manifest}")
    name = posixpath.basename(manifest)[: -len(".gz")]
    stem, _, ext = name.rpartition(".")
    spool_name = posixpath.join(rel, f"{stem or name}-{token(None, [manifest, stamp], 16)}.{ext or 'txt'}")
    uri = spool.uri(spool_name)
    return (uri, None) if spool.exists(spool_name) else (uri, spool)


class _PassState:
    """The shard being cut during one planning pass."""

    def __init__(self, source: _Source, shard_size: int, config_hash: str, salt: str):
        self.source = source
        self.cutter = ShardCutter(shard_size, config_hash, salt)
        self.shards: list[Shard] = []
        self.id_hashes = array("Q")
        self.start, self.line, self.items = 0, 1, 0
        self.bytes = hashlib.sha256()
        self.skip: list[int] = []
        self.tail: list[tuple[int, bytes, bool]] = []  # lines after the last item: (line, raw, left out)
        self.last = (0, 0)  # line and end offset of the last item

    def add_block(self, block: list[tuple[int, int, bytes, str | None, str | bool]], prints: list[str]) -> None:
        """Add a block of lines: ``(line, end offset, raw, utt id or None, path or left-out flag)``."""
        fp = iter(prints)
        hash_payload = self.source.format.hash_payload
        cutter, tail, bytes_hash, append_hash = self.cutter, self.tail, self.bytes, self.id_hashes.append
        for lineno, end, raw, utt_id, path in block:
            if utt_id is None:  # blank, comment, or left out: in the next shard's range if an item follows
                tail.append((lineno, raw, path is True))
                continue
            if tail:
                for t_line, t_raw, left_out in tail:
                    bytes_hash.update(t_raw)
                    if left_out:
                        self.skip.append(t_line)
                tail.clear()
            bytes_hash.update(raw)
            h = id_hash64(utt_id)  # the same hash _repeated_ids checks candidates with
            append_hash(h)
            self.last = (lineno, end)
            if cutter.add(h, item_key(hash_payload(raw), next(fp))):
                self.close()
                bytes_hash = self.bytes

    def close(self) -> None:
        shard_hash, n = self.cutter.close()
        lineno, end = self.last
        src = self.source
        source: dict[str, Any] = {"path": src.path, "start": self.start, "end": end, "line": self.line,
                                  "sha256": self.bytes.hexdigest(), "format": src.format.name}
        if src.origin:
            source["origin"], source["cwd"] = src.origin, src.cwd
        if self.skip:
            source["skip"] = list(self.skip)
        self.shards.append(Shard(len(self.shards), self.items, self.items + n, shard_hash, source))
        self.start, self.line, self.items = end, lineno + 1, self.items + n
        self.bytes = hashlib.sha256()
        self.skip = []


def _plan_pass(manifest: str, source: _Source, split: str, shard_size: int, config: Mapping[str, Any],
               on_error: str, fingerprinter: Fingerprinter, storage_options: Mapping[str, Any] | None, salt: str,
               excluded: Mapping[int, str], spool_writer: IO[bytes] | None, read_from: str,
               allow_pipes: bool = False, speakers: bool = False) -> tuple[ShardPlan, list[SkippedItem], array]:
    """One streaming pass: shards, skipped lines and every kept id's 64-bit hash (in order).
    A command entry (``cmd |``) without ``allow_pipes`` is an error under any ``on_error``;
    with ``speakers``, speaker ids are checked too."""
    st = _PassState(source, shard_size, config_digest(config), salt)
    fmt = source.format
    skipped: list[SkippedItem] = []
    block: list[tuple[int, int, bytes, str | None, str | bool]] = []
    paths: list[str] = []
    held = 0
    for lineno, end, raw in iter_manifest_lines(read_from, split, storage_options):
        if spool_writer is not None:
            # an over-long line is spooled as its head (a line still over the bound), so offsets
            # and digests are the spool's, and the spool holds no more than the bound per line
            spool_writer.write(raw + b"\n" if isinstance(raw, OversizeLine) else raw)
            end = spool_writer.tell()
        held += len(raw)
        try:
            fields = planning_fields(raw, lineno, fmt, speakers)
            if fields is not None and lineno in excluded:
                raise ManifestLineError(excluded[lineno], fields[0])
        except ManifestLineError as exc:
            if on_error == "fail":
                raise ManifestError(line_error(split, manifest, lineno, exc)) from None
            skipped.append(SkippedItem(split, exc.utt_id, lineno, "", f"manifest: {exc}"))
            block.append((lineno, end, raw, None, True))  # left out: the worker must not parse it
            continue
        if fields is None:
            block.append((lineno, end, raw, None, False))
            continue
        if not allow_pipes and fmt.runs_command(raw, fields[1]):
            raise ManifestError(line_error(split, manifest, lineno, ManifestLineError(
                f"the audio entry {quote(fields[1])} is a command; commands run only with allow_pipes=true",
                fields[0])))
        block.append((lineno, end, raw, fields[0], fields[1]))
        paths.append(fmt.fingerprint_path(fields[1]))  # the file an archive entry or command reads
        if len(paths) >= FINGERPRINT_BLOCK or held >= BLOCK_BYTES:
            st.add_block(block, fingerprinter.fingerprints(paths))
            block, paths, held = [], [], 0
    st.add_block(block, fingerprinter.fingerprints(paths))
    if st.cutter.count:
        st.close()
    return ShardPlan(tuple(st.shards), shard_size, config_digest(config), salt), skipped, st.id_hashes


def _repeated_ids(manifest: str, fmt: ManifestFormat, split: str, id_hashes: array, storage_options: Mapping[str, Any] | None,
                  excluded: Mapping[int, str]) -> dict[int, tuple[str, int]]:
    """Lines whose id repeats an earlier line's: ``{line: (id, first line)}`` (empty when none).

    Sorting the 64-bit hashes finds candidates in 8 bytes an utterance; only candidates are then
    compared by their real ids, so a hash collision of two different ids is not an error.
    """
    if len(id_hashes) < 2:
        return {}
    arr = np.frombuffer(id_hashes, dtype=np.uint64)
    srt = np.sort(arr)
    candidates = set(srt[1:][srt[1:] == srt[:-1]].tolist())
    del arr, srt
    if not candidates:
        return {}
    first: dict[str, int] = {}
    repeated: dict[int, tuple[str, int]] = {}
    for lineno, _, raw in iter_manifest_lines(manifest, split, storage_options):
        if lineno in excluded:
            continue
        try:
            utt = parse_manifest_line(raw, lineno, fmt)
        except ManifestLineError:
            continue
        if utt is None or id_hash64(utt.utt_id) not in candidates:
            continue
        if utt.utt_id in first:
            repeated[lineno] = (utt.utt_id, first[utt.utt_id])
        else:
            first[utt.utt_id] = lineno
    return repeated
