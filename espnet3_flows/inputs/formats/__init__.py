"""Manifest formats as a registry: one module per format, each a :class:`ManifestFormat` subclass.

Built in: ``tsv`` (:mod:`.tsv`), ``lhotse`` CutSets (:mod:`.lhotse`), Kaldi data directories
(:mod:`.kaldi`) and HuggingFace ``datasets`` saved to disk (:mod:`.hf`). Adding one:
``docs/adding-a-format.md``. This package imports only :mod:`.base` eagerly; the format modules
are imported on the first registry lookup; another package adds formats through the entry-point
group ``espnet3_flows.formats``.
"""

from espnet3_flows.inputs.formats.base import (
    BUILTIN_FORMATS,
    FORMATS,
    ManifestFormat,
    PreparedManifest,
    detect_format,
    format_named,
    known_formats,
)

__all__ = ["BUILTIN_FORMATS", "FORMATS", "ManifestFormat", "PreparedManifest", "detect_format", "format_named",
           "known_formats"]
