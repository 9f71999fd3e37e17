"""The HuggingFace ``datasets`` format: a dataset saved with ``save_to_disk``, one utterance a row.

``manifests.<split>`` names the directory (it holds ``state.json`` and ``dataset_info.json``).
Columns: ``id``, ``audio`` (an ``Audio`` column, ``{"path", "bytes"}``, or a string column of
paths), optional ``speaker`` and ``text``; other names go after the directory as a query,
``data/hf_train?id=key&audio=file&speaker=spk&text=sentence``.

Planning streams the rows, a batch at a time and without their audio bytes, into one JSON line
per row beside the outputs (line ``n`` is row ``n-1``), which is then planned and read by byte
range like any manifest. A row whose audio is a path (no bytes) is an ordinary utterance, read
and fingerprinted (size, mtime) as a TSV line's file. A row with embedded bytes has no usable
path: its line carries the dataset's fingerprint and the row, its shard hash covers them with
the stat of ``state.json``, and the worker reads that row's bytes from the memory-mapped arrow
files (decoded with soundfile; ``datasets``' own decoding is never used).
"""

from __future__ import annotations

import io
import json
import math
import os
import posixpath
import re
from functools import lru_cache
from typing import Any
from collections.abc import Mapping
from urllib.parse import parse_qsl

import numpy as np

from espnet3_flows.errors import Espnet3FlowsError
from espnet3_flows.inputs.audio import decode_audio, read_header
from espnet3_flows.inputs.audio_config import AudioConfig, AudioError, check_max_duration
from espnet3_flows.inputs.formats.base import ManifestFormat, PreparedManifest
from espnet3_flows.inputs.formats.hf_fingerprint import dataset_fingerprint
from espnet3_flows.inputs.records import ManifestError, Utterance
from espnet3_flows.hashing import token
from espnet3_flows.storage import Storage

#: Column roles and their default names
DEFAULT_COLUMNS = {"id": "id", "audio": "audio", "speaker": "speaker", "text": "text"}
#: Version of the exported line layout (part of the exported file's name)
EXPORT_VERSION = "hf-rows/1"
_MARKERS = ("state.json", "dataset_info.json")
_BATCH = 4096


def split_spec(manifest: str) -> tuple[str, dict[str, str]]:
    """The dataset directory and the column names of ``dir?role=column&...``.

    Raises:
        ManifestError: an unknown role in the query.
    """
    path, _, query = manifest.partition("?")
    columns = dict(DEFAULT_COLUMNS)
    for role, name in parse_qsl(query, keep_blank_values=True):
        if role not in columns:
            raise ManifestError(f"manifest {manifest}: unknown column role {role!r} (known: {sorted(columns)})")
        columns[role] = name
    return path.rstrip("/"), columns


class HfDatasetFormat(ManifestFormat):
    """A dataset directory written by ``datasets.Dataset.save_to_disk``."""

    name = "hf"
    priority = 20  # before the Kaldi format, which takes any directory

    def is_applicable(self, manifest: str, storage_options: Mapping[str, Any] | None = None) -> bool:
        path = split_spec(manifest)[0] if "?" in manifest else manifest
        if "://" in path and not path.startswith("file://"):
            return False  # load_from_disk of a remote dataset is not supported here
        local = path[len("file://"):] if path.startswith("file://") else path
        return all(os.path.isfile(os.path.join(local, m)) for m in _MARKERS)

    def prepare(self, manifest: str, split: str, *, spool: Storage | None, spool_rel: str, on_error: str,
                storage_options: Mapping[str, Any] | None, allow_pipes: bool,
                check_speakers: bool = False) -> PreparedManifest:
        # its rows are planned as any manifest's lines (not ``checked``): the planner checks speaker ids
        directory, columns = split_spec(manifest)
        directory = directory[len("file://"):] if directory.startswith("file://") else directory
        if spool is None:
            raise ManifestError(f"split {split!r}: a dataset directory ({directory}) needs an output location to "
                                "write its rows into")
        ds = _open_dataset(directory, split)
        missing = [c for r, c in columns.items() if r in ("id", "audio") and c not in ds.column_names]
        if missing:
            raise ManifestError(f"split {split!r}: dataset {directory} has no column {missing[0]!r} (columns: "
                                f"{ds.column_names}; name others with {directory}?id=...&audio=...)")
        state = os.stat(os.path.join(directory, "state.json"))
        fingerprint = dataset_fingerprint(ds)
        key = token(EXPORT_VERSION, [directory, fingerprint, state.st_size, state.st_mtime_ns,
                                     sorted(columns.items()), os.getcwd()], 16)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", posixpath.basename(directory) or "dataset")
        name = posixpath.join(spool_rel, f"{stem}-{key}.hf.jsonl")
        if not spool.exists(name):
            _export(ds, fingerprint, directory, columns, spool, name)
        return PreparedManifest(spool.uri(name), origin=directory)

    def parse_line(self, line: str, lineno: int) -> Utterance:
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object: {exc.msg}") from None
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        uid, text, speaker = d.get("id"), str(d.get("text") or ""), str(d.get("speaker") or "")
        if not isinstance(uid, str):
            raise ValueError(f"row {lineno - 1}: the id is {uid!r}, not a string")
        if "dataset" in d:  # embedded bytes: the row is where the audio is
            where = f"{d['dataset']}[row {d['row']}]"
            return Utterance(uid, where, text, speaker, lineno, payload=d, format=self.name)
        if not d.get("path"):
            raise ValueError(f"row {lineno - 1}: utt {uid!r} has neither audio bytes nor a path")
        return Utterance(uid, str(d["path"]), text, speaker, lineno)

    def planning_entry(self, utt: Utterance) -> str:
        if utt.payload is not None:  # embedded rows change only when the dataset is saved again
            return posixpath.join(str(utt.payload["dataset"]), "state.json")
        return utt.path

    def load_audio(self, utt: Utterance, config: AudioConfig,
                   storage_options: Mapping[str, Any] | None) -> tuple[np.ndarray, int]:
        return decode_audio(io.BytesIO(_row_bytes(utt)), config)

    def audio_header(self, utt: Utterance, config: AudioConfig,
                     storage_options: Mapping[str, Any] | None) -> tuple[int, int]:
        frames, rate = read_header(io.BytesIO(_row_bytes(utt)))
        if frames <= 0:
            raise AudioError("zero-length audio")
        check_max_duration(frames / rate, config)
        return int(math.ceil(frames * config.sampling_rate / rate)), int(rate)


class DatasetChangedError(Espnet3FlowsError):
    """The dataset a shard's rows point into is gone or was saved again since planning: the shard
    fails (it is not a bad item); a rerun plans the new dataset."""


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ManifestError("a HuggingFace dataset directory as a manifest needs the `datasets` package: "
                            "pip install 'espnet3-flows[hf]'") from None
    return datasets


def _open_dataset(directory: str, split: str = "") -> Any:
    datasets = _import_datasets()
    try:
        ds = datasets.load_from_disk(directory)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ManifestError(f"split {split!r}: cannot load dataset {directory}: {exc}") from None
    if not isinstance(ds, datasets.Dataset):
        raise ManifestError(f"split {split!r}: {directory} holds a DatasetDict; name one of its splits "
                            f"({', '.join(ds)}) as the manifest")
    return ds


@lru_cache(maxsize=8)
def _audio_column(directory: str, fingerprint: str, column: str) -> Any:
    """The audio column of a dataset, memory-mapped (a worker opens each dataset once)."""
    try:
        ds = _open_dataset(directory)
    except ManifestError as exc:
        raise DatasetChangedError(str(exc)) from None
    if dataset_fingerprint(ds) != fingerprint:
        raise DatasetChangedError(f"dataset {directory} changed since the run was planned; rerun to plan it again")
    return ds.data.table.column(column)


def _row_bytes(utt: Utterance) -> bytes:
    """The audio bytes of an embedded row, read from that row alone."""
    p = utt.payload or {}
    value = _audio_column(str(p["dataset"]), str(p["fingerprint"]), str(p["column"]))[int(p["row"])]
    data = value["bytes"].as_py()
    if not data:
        raise AudioError("the row has no audio bytes")
    return data


def _export(ds: Any, fingerprint: str, directory: str, columns: Mapping[str, str], spool: Storage,
            name: str) -> None:
    """Write one JSON line per row (``id``, ``path`` or the embedded row's location, ``fingerprint``,
    ``speaker``, ``text``), reading the rows a batch at a time and never their audio bytes."""
    import pyarrow.types as pat

    table = ds.data.table
    audio = columns["audio"]
    struct = pat.is_struct(table.schema.field(audio).type)  # an Audio column: {"bytes", "path"}
    extra = [r for r in ("speaker", "text") if columns[r] in ds.column_names]
    with spool.atomic_writer(name) as out:
        for start in range(0, table.num_rows, _BATCH):
            batch = table.slice(start, _BATCH)
            ids = batch.column(columns["id"]).to_pylist()
            col = batch.column(audio).combine_chunks()
            if struct:
                paths, embedded = col.field("path").to_pylist(), col.field("bytes").is_valid().to_pylist()
            else:
                paths, embedded = col.to_pylist(), [False] * len(ids)
            values = {r: batch.column(columns[r]).to_pylist() for r in extra}
            for i, uid in enumerate(ids):
                row: dict[str, Any] = {"id": uid if uid is None else str(uid)}
                if embedded[i]:
                    row.update(dataset=directory, fingerprint=fingerprint, column=audio, row=start + i)
                else:
                    row["path"] = paths[i]
                row.update({r: str(v[i]) for r, v in values.items() if v[i] is not None})
                out.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
