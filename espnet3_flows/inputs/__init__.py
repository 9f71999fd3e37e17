"""Inputs: utterance records, manifest formats as a registry, the streaming planner, file
fingerprints, Kaldi data directories and audio reading.

Imports point down this list (nothing here imports a job, the runner or orchestration):

- :mod:`.records`: :class:`~.records.Utterance`, skipped items, id checks, manifest errors;
- :mod:`.fingerprints`: size and mtime (or ETag) of input files, at the storage's speed;
- :mod:`.formats.base`: the registry (:class:`~.formats.base.ManifestFormat`);
- :mod:`.audio`: decoding, segments, archives, commands; asks the registry for formats that
  load their own audio;
- :mod:`.kaldi_dir`: joining a Kaldi data directory into one line per utterance;
- :mod:`.formats` ``.tsv``, ``.lhotse``, ``.kaldi``, ``.hf``: one module per format;
- :mod:`.manifest`: a manifest's lines, parsed by its format; a shard's byte range;
- :mod:`.planner`: a split's manifest streamed into a compact shard plan.
"""
