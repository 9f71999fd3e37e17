"""The manifest-format registry: what a format declares, and how a manifest finds its format.

A format is a subclass of :class:`ManifestFormat` with a ``name``, registered in :data:`FORMATS`
(one instance). The planner, the shard reader and audio loading ask the registry; nothing else
names a format. The built-in formats are classes of this package's modules, named in
:data:`BUILTIN_FORMATS` as an entry point names one and imported on the first lookup (so that
:mod:`espnet3_flows.inputs.audio`, which they import, can ask the registry without a cycle);
another package adds one through the entry-point group ``espnet3_flows.formats`` (``name =
"package.module:FormatClass"``, :mod:`espnet3_flows.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from collections.abc import Mapping

from espnet3_flows.registry import Registry
from espnet3_flows.inputs.records import ManifestError, SkippedItem, Utterance, entry_kind, fingerprint_target

if TYPE_CHECKING:
    from espnet3_flows.inputs.audio_config import AudioConfig
    from espnet3_flows.storage import Storage

#: The built-in formats' classes, as an entry point names one
BUILTIN_FORMATS = {
    "tsv": "espnet3_flows.inputs.formats.tsv:TsvFormat",
    "lhotse": "espnet3_flows.inputs.formats.lhotse:LhotseFormat",
    "kaldi": "espnet3_flows.inputs.formats.kaldi:KaldiFormat",
    "hf": "espnet3_flows.inputs.formats.hf:HfDatasetFormat",
}


@dataclass(frozen=True)
class PreparedManifest:
    """The line file a format wrote for the workers from a manifest that is not one (a Kaldi
    data directory, a dataset on disk), beside the outputs.

    Attributes:
        path: The file the workers read by byte range (URI).
        origin: The file its line numbers count in, for messages (empty: the line file itself).
        cwd: The directory commands (``cmd |`` entries) run in.
        skipped: Items left out while it was written (``on_error: skip``).
        checked: Whether its ids are valid and unique and its lines well formed by construction,
            its speaker ids too when :meth:`ManifestFormat.prepare` was asked to check them (one
            planning pass then; otherwise it is checked as any manifest).
    """

    path: str
    origin: str = ""
    cwd: str = ""
    skipped: list[SkippedItem] = field(default_factory=list)
    checked: bool = False


class ManifestFormat:
    """One kind of manifest: how it is recognised, parsed into :class:`Utterance` records,
    prepared for planning, and how audio its records do not name by a plain path is loaded.

    A manifest is planned from lines (:mod:`espnet3_flows.inputs.planner`): the manifest's own
    lines, or those of the file :meth:`prepare` writes. A worker parses only its shard's byte
    range of them with :meth:`parse_line`.

    Subclass and set ``name`` to register; override what differs from a TSV-like line file.
    """

    #: the name plans record (``source["format"]``) and utterances carry (:attr:`Utterance.format`)
    name: ClassVar[str] = ""
    #: formats are asked by :func:`detect_format` in decreasing priority (the TSV fallback is lowest)
    priority: ClassVar[int] = 0
    #: lines starting with it are comments (``None``: none are)
    comment_prefix: ClassVar[str | None] = "#"

    def __repr__(self) -> str:
        return f"<manifest format {self.name!r}>"

    # recognising
    def is_applicable(self, manifest: str, storage_options: Mapping[str, Any] | None = None) -> bool:
        """Whether ``manifest`` (a path or URL, as ``manifests.<split>`` gives it) is of this format."""
        raise NotImplementedError

    # planning
    def prepare(self, manifest: str, split: str, *, spool: Storage | None, spool_rel: str, on_error: str,
                storage_options: Mapping[str, Any] | None, allow_pipes: bool,
                check_speakers: bool = False) -> PreparedManifest | None:
        """The line file to plan, written below ``spool/spool_rel``; ``None`` plans the manifest's
        own lines (decompressed into the spool first when it is gzipped). ``check_speakers``: the
        job keys files by speaker id, so a ``checked`` file must hold only speaker ids that pass
        :func:`~espnet3_flows.inputs.records.validate_speaker_id` (an unchecked one is checked
        by the planner)."""
        return None

    def line_id(self, line: str) -> str:
        """The utterance id a bad line's message names (empty when it cannot be told)."""
        return ""

    def parse_line(self, line: str, lineno: int) -> Utterance:
        """The utterance of one decoded line (neither blank nor a comment); the id is checked
        by the caller.

        Raises:
            ValueError: a malformed line (the caller adds split, file and line).
        """
        raise NotImplementedError

    def quick_fields(self, bline: bytes, lineno: int) -> tuple[str, str] | None:
        """``(utt_id, entry)`` of a common, valid line without a full parse, or ``None`` to parse it."""
        return None

    def planning_entry(self, utt: Utterance) -> str:
        """What planning checks for commands and fingerprints: the audio entry."""
        return utt.path

    def fingerprint_path(self, entry: str) -> str:
        """The file whose size and mtime stand for ``entry`` in shard hashes."""
        return fingerprint_target(entry) if entry.startswith("ark:") or "|" in entry else entry

    def hash_payload(self, raw: bytes) -> bytes:
        """What a shard hash covers of a raw line (besides the audio's fingerprint)."""
        return raw.rstrip(b"\r\n")

    def runs_command(self, raw: bytes, entry: str) -> bool:
        """Whether reading this line's audio would run a shell command."""
        return "|" in entry and entry_kind(entry) == "pipe"

    # audio (only for utterances whose ``format`` is this format's name)
    def load_audio(self, utt: Utterance, config: AudioConfig,
                   storage_options: Mapping[str, Any] | None) -> tuple[Any, int]:
        """``(channels × samples float32 array, native rate)`` of an utterance of this format."""
        raise NotImplementedError(f"format {self.name!r} does not load audio itself")

    def audio_header(self, utt: Utterance, config: AudioConfig,
                     storage_options: Mapping[str, Any] | None) -> tuple[int, int]:
        """``(length in samples at config.sampling_rate, native rate)`` without decoding, if it can."""
        raise NotImplementedError(f"format {self.name!r} does not read audio headers itself")


def _accept_format(name: str, obj: Any) -> ManifestFormat:
    """A format's :class:`ManifestFormat` subclass (a built-in one's or a plugin's), instantiated."""
    if not (isinstance(obj, type) and issubclass(obj, ManifestFormat) and obj.name):
        raise TypeError(f"{obj!r} is not a ManifestFormat subclass with a name")
    if obj.name != name:
        raise TypeError(f"the entry point is named {name!r} but the format {obj.name!r}")
    return obj()


#: every format by name: the built-in ones, then those of the ``espnet3_flows.formats`` entry points
FORMATS: Registry[ManifestFormat] = Registry(
    "manifest format", "format", accept=_accept_format,
    builtins=BUILTIN_FORMATS,
    error=ManifestError)


def known_formats() -> dict[str, ManifestFormat]:
    """Every registered format by name, the built-in ones and the installed packages' included."""
    return FORMATS.items()


def format_named(name: str | ManifestFormat) -> ManifestFormat:
    """The registered format called ``name`` (a format passes through).

    Raises:
        ManifestError: no format has that name.
    """
    if isinstance(name, ManifestFormat):
        return name
    return FORMATS.get(name)


def detect_format(manifest: str, storage_options: Mapping[str, Any] | None = None) -> ManifestFormat:
    """The format of ``manifest``: the applicable registered format of highest priority.

    Raises:
        ManifestError: none applies.
    """
    formats = known_formats()
    for fmt in sorted(formats.values(), key=lambda f: -f.priority):
        if fmt.is_applicable(manifest, storage_options):
            return fmt
    raise ManifestError(f"no manifest format reads {manifest}; known: {sorted(formats)}")
