"""``*.pipes`` manifests: one ``utt_id|audio path`` line per utterance."""

from __future__ import annotations

from espnet3_flows.inputs.formats import ManifestFormat
from espnet3_flows.inputs.records import Utterance


class PipeFormat(ManifestFormat):
    """``utt_id|path`` lines; ``#`` starts a comment."""

    name = "pipes"
    priority = 50

    def is_applicable(self, manifest, storage_options=None):
        return manifest.endswith(".pipes")

    def line_id(self, line):
        return line.partition("|")[0]

    def parse_line(self, line, lineno):
        utt_id, sep, path = line.strip().partition("|")
        if not sep or not path:
            raise ValueError("expected 'utt_id|path'")
        return Utterance(utt_id, path, line=lineno)
