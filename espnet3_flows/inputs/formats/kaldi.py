"""The Kaldi format: a data directory (``wav.scp``, optional ``segments``, ``utt2spk``, ``text``),
joined into one line per utterance (:mod:`espnet3_flows.inputs.kaldi_dir`) that workers read."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from espnet3_flows.inputs import kaldi_dir
from espnet3_flows.inputs.formats.base import ManifestFormat, PreparedManifest
from espnet3_flows.inputs.records import ManifestError, Utterance, fingerprint_target
from espnet3_flows.storage import Storage


class KaldiFormat(ManifestFormat):
    """A Kaldi data directory: any directory no other format claims (one without ``wav.scp`` is
    an error naming it when it is prepared)."""

    name = "kaldi"
    priority = 10
    comment_prefix = None  # a joined line's id may start with '#'

    def is_applicable(self, manifest: str, storage_options: Mapping[str, Any] | None = None) -> bool:
        return kaldi_dir.is_data_dir(manifest, storage_options)

    def prepare(self, manifest: str, split: str, *, spool: Storage | None, spool_rel: str, on_error: str,
                storage_options: Mapping[str, Any] | None, allow_pipes: bool,
                check_speakers: bool = False) -> PreparedManifest:
        if spool is None:
            raise ManifestError(f"split {split!r}: a data directory ({manifest}) needs an output location to join "
                                "its files into")
        joined = kaldi_dir.prepare_joined(manifest, split, spool, spool_rel, on_error=on_error,
                                          storage_options=storage_options, check_speakers=check_speakers)
        if not allow_pipes:
            kaldi_dir.refuse_pipes(joined, split)  # naming the wav.scp line, not the joined one
        return PreparedManifest(joined.path, joined.join.origin, joined.join.cwd, list(joined.join.skipped),
                                checked=True)

    def line_id(self, line: str) -> str:
        return line.split("\t", 1)[0]

    def parse_line(self, line: str, lineno: int) -> Utterance:
        return kaldi_dir.parse_joined_line(line)

    def quick_fields(self, bline: bytes, lineno: int) -> tuple[str, str] | None:
        # joined lines: ids were checked when the data directory was joined
        cells = bline.decode("utf-8", "replace").rstrip("\r\n").split("\t", 7)
        return (cells[0], cells[7]) if len(cells) == 8 else None

    def fingerprint_path(self, entry: str) -> str:
        return fingerprint_target(entry)

    def hash_payload(self, raw: bytes) -> bytes:
        return kaldi_dir.joined_hash_payload(raw)

    def runs_command(self, raw: bytes, entry: str) -> bool:
        return False  # refused when the directory was prepared, naming its wav.scp line
