"""The lhotse format: a CutSet as JSON lines (``.jsonl[.gz]``); its audio is loaded through lhotse."""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping

import numpy as np

from espnet3_flows.inputs.audio_config import AudioConfig, AudioError, check_max_duration
from espnet3_flows.inputs.formats.base import ManifestFormat
from espnet3_flows.inputs.records import Utterance


class LhotseFormat(ManifestFormat):
    """A lhotse CutSet manifest, recognised by its name (``.jsonl`` or ``.jsonl.gz``)."""

    name = "lhotse"
    priority = 30

    def is_applicable(self, manifest: str, storage_options: Mapping[str, Any] | None = None) -> bool:
        return manifest.endswith(".jsonl") or manifest.endswith(".jsonl.gz")

    def parse_line(self, line: str, lineno: int) -> Utterance:
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
                         str(sup.get("speaker") or ""), lineno, payload=d, format=self.name)

    def runs_command(self, raw: bytes, entry: str) -> bool:
        if super().runs_command(raw, entry):
            return True
        if b'"command"' not in raw:
            return False
        try:
            cut = json.loads(raw)
        except ValueError:
            return False  # not JSON: reported as a bad line by the parser
        return isinstance(cut, dict) and lhotse_runs_commands(cut)

    def load_audio(self, utt: Utterance, config: AudioConfig,
                   storage_options: Mapping[str, Any] | None) -> tuple[np.ndarray, int]:
        from lhotse import CutSet

        if not config.allow_pipes and lhotse_runs_commands(utt.payload or {}):
            raise AudioError("the cut's recording is read by a command (source type 'command') and allow_pipes is "
                             "false")
        check_max_duration(float((utt.payload or {}).get("duration") or 0.0), config)  # from the manifest, before decoding
        cut = CutSet.from_dicts([dict(utt.payload or {})])[0]
        audio = cut.load_audio()
        return np.asarray(audio, dtype=np.float32).reshape(-1, audio.shape[-1]), int(cut.sampling_rate)

    def audio_header(self, utt: Utterance, config: AudioConfig,
                     storage_options: Mapping[str, Any] | None) -> tuple[int, int]:
        cut = utt.payload or {}
        seconds = float(cut.get("duration", 0.0))
        check_max_duration(seconds, config)
        native = (cut.get("recording") or {}).get("sampling_rate") or cut.get("sampling_rate")
        return int(round(seconds * config.sampling_rate)), int(native or config.sampling_rate)


def lhotse_runs_commands(cut: Mapping[str, Any]) -> bool:
    """Whether loading a lhotse cut would run a shell command (any recording source of type
    ``command``, in the cut or in the tracks of a mixed cut)."""
    recordings = [cut.get("recording") or {}]
    recordings += [(t.get("cut") or {}).get("recording") or {} for t in cut.get("tracks") or () if isinstance(t, dict)]
    return any(isinstance(src, dict) and src.get("type") == "command"
               for rec in recordings if isinstance(rec, dict) for src in rec.get("sources") or ())
