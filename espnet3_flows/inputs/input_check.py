"""What a dry run checks of a split's inputs before anything runs: every local audio file of
the shards a run would compute is stat'ed (missing, not a regular file, empty, unreadable: the
message a run gives, with its file and line), and the header of a sample of files spread over
the split is read for its sampling rate. Nothing is decoded but those headers; no command runs
(a ``cmd |`` entry is left to the run, as are archive entries and remote files' stats)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

import fsspec

from espnet3_flows.inputs.audio import audio_header, load_audio
from espnet3_flows.inputs.audio_config import AudioConfig, AudioError
from espnet3_flows.inputs.manifest import read_manifest_slice
from espnet3_flows.inputs.records import Utterance, entry_kind
from espnet3_flows.sharding import Shard

#: Files whose headers a dry run reads, spread evenly over a split's utterances
HEADER_SAMPLE = 100
#: Problems a dry run lists per split (the count says how many more)
LISTED_PROBLEMS = 20


@dataclass
class InputCheck:
    """What :func:`check_inputs` found in one split.

    Attributes:
        utterances: Utterances looked at (those of the shards a run would compute).
        stat_checked: Of them, local audio files stat'ed.
        problems: ``where: message`` of the first :data:`LISTED_PROBLEMS` bad inputs.
        problem_count: Every bad input found.
        rates: Native rate → files among the headers read.
    """

    utterances: int = 0
    stat_checked: int = 0
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0
    rates: dict[int, int] = field(default_factory=dict)

    def add_problem(self, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < LISTED_PROBLEMS:
            self.problems.append(text)


def is_local_file(utt: Utterance) -> bool:
    """Whether ``utt`` reads a local audio file (not a command, archive entry, remote object or a
    format's own entry)."""
    return (not utt.format and entry_kind(utt.path) == "file"
            and fsspec.core.split_protocol(utt.path)[0] in (None, "file"))


def file_looks_readable(path: str) -> bool:
    """A regular, non-empty file this process may read (one ``stat``, no open)."""
    local = fsspec.core.strip_protocol(path) if path.startswith("file://") else path
    try:
        st = os.stat(local)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0 and os.access(local, os.R_OK)


def check_inputs(split: str, shards: Sequence[Shard], audio: AudioConfig,
                 storage_options: Mapping[str, Any] | None = None, sample: int = HEADER_SAMPLE) -> InputCheck:
    """Check the inputs of ``shards`` (the split's shards a run would compute), reading each
    shard's utterances from its byte range of the manifest as a worker does.

    A local file that is not a readable, non-empty regular file is read the way a run reads it
    (:func:`~espnet3_flows.inputs.audio.load_audio`), so its problem is the run's own message.
    ``sample`` headers spread over the utterances give their native rates; a header that cannot
    be read is a problem too."""
    total = sum(s.num_items for s in shards)
    n = min(sample, total)
    picked = {k * total // n for k in range(n)}  # evenly over the utterances
    found = InputCheck()
    pos = 0
    for shard in shards:
        for utt in read_manifest_slice(shard.source or {}, split, storage_options):
            sampled = pos in picked
            pos += 1
            found.utterances += 1
            local = is_local_file(utt)
            try:
                if local:
                    found.stat_checked += 1
                    if not file_looks_readable(utt.path):
                        load_audio(utt, audio, storage_options)
                        continue  # (read after all: a file that appeared meanwhile)
                if sampled and not utt.format and entry_kind(utt.path) == "file":
                    rate = audio_header(utt, audio, storage_options)[1]
                    found.rates[rate] = found.rates.get(rate, 0) + 1
            except AudioError as exc:
                found.add_problem(f"{utt.where(split)}: {exc}")
    return found
