"""The TSV manifest format: ``utt_id<TAB>wav_path[<TAB>text[<TAB>speaker_id]]``, the fallback for any file."""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from espnet3_flows.inputs.formats.base import ManifestFormat
from espnet3_flows.inputs.records import SAFE_ID, Utterance


class TsvFormat(ManifestFormat):
    """A TSV manifest (plain or ``.gz``): any manifest no other format claims."""

    name = "tsv"
    priority = -100

    def is_applicable(self, manifest: str, storage_options: Mapping[str, Any] | None = None) -> bool:
        return True

    def line_id(self, line: str) -> str:
        return line.split("\t", 1)[0]

    def parse_line(self, line: str, lineno: int) -> Utterance:
        cells = line.split("\t")
        if len(cells) < 2 or not cells[0] or not cells[1]:
            raise ValueError(f"expected 'utt_id<TAB>wav_path[<TAB>text[<TAB>speaker_id]]', got {len(cells)} field(s)")
        if len(cells) > 4:
            raise ValueError(f"expected at most 4 tab-separated fields, got {len(cells)}")
        text = cells[2] if len(cells) > 2 else ""
        speaker = cells[3] if len(cells) > 3 else ""
        return Utterance(cells[0], cells[1], text, speaker, lineno)

    def quick_fields(self, bline: bytes, lineno: int) -> tuple[str, str] | None:
        # the common line in one split and one regex match; anything else takes the full parse
        try:
            cells = bline.decode("utf-8").rstrip("\r\n").split("\t")
        except UnicodeDecodeError:
            return None
        if 2 <= len(cells) <= 4 and cells[1] and len(cells[0]) <= 63 and SAFE_ID.fullmatch(cells[0]):
            return cells[0], cells[1]
        return None
