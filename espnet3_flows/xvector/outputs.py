"""Writers for x-vectors in the ESPnet2 TTS layout: per-utterance .pt files, kaldi ark/scp, speaker means.

Functions over local directories, and the shard writer :class:`EmbeddingWriter`; publishing
(upload / atomic rename) is the caller's job. Layout written into ``out_dir``::

    {utt_id}.pt           float32 tensor [D] per utterance (torch.save, loads with weights_only=True)
    xvector.ark/.scp      utterance embeddings keyed by utt id (kaldiio), keys sorted
    spk_xvector.ark/.scp  mean embedding per speaker keyed by speaker id, keys sorted

kaldiio writes the ark path into the scp verbatim and a reader opens it relative to its own working
directory, not the scp's. So the scp written here names the ark by its absolute local path; when
the pair is published, the scp is pointed at the ark's published URI
(:func:`espnet3_flows.scp.point_scps_at_published`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import numpy as np

from espnet3_flows.inputs.records import id_file_name, validate_speaker_id, validate_utt_id
from espnet3_flows.storage import replace_atomically

UTTS = "utts.tsv"  # a shard's per-utterance rows (written by EmbeddingWriter)



def _embedding_vector(key: str, value: object, kind: str = "utterance") -> np.ndarray:
    """``value`` as a finite 1-D float32 vector; ValueError naming ``key`` otherwise."""
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{kind} {key!r}: expected a 1-D embedding, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{kind} {key!r}: expected numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise ValueError(f"{kind} {key!r}: embedding contains NaN or infinite values")
    return arr


def _validate_key(key: object, kind: str) -> str:
    """An ark/scp key of another kind than an utterance (a speaker): a string that reads back whole
    (the rule of :func:`~espnet3_flows.inputs.records.validate_speaker_id`, which the planning of a
    job writing such keys applied already)."""
    if not isinstance(key, str):
        raise ValueError(f"{kind} id must be a string, got {key!r}")
    return validate_speaker_id(key)


def write_utterance_tensors(out_dir: str | Path, embeddings: Mapping[str, np.ndarray]) -> list[Path]:
    """Write each embedding as ``out_dir/{utt_id}.pt`` (float32 torch tensor of shape [D]).

    Every id is checked with `espnet3_flows.inputs.manifest.validate_utt_id` and every vector for shape
    and finiteness before any file is written. Each file appears atomically (temporary name,
    then rename). Returns the written paths in key order.
    """
    import torch

    out = Path(out_dir)
    checked = {}
    for utt_id, value in embeddings.items():
        validate_utt_id(utt_id)
        checked[utt_id] = _embedding_vector(utt_id, value)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for utt_id in sorted(checked):
        path = out / id_file_name(utt_id, ".pt")
        tensor = torch.from_numpy(checked[utt_id].copy())
        # one file per utterance into a shard's staging directory: renamed, not fsync-ed (the
        # shard's done record is written after they are published)
        replace_atomically(path, lambda f, t=tensor: torch.save(t, f), fsync=False)
        paths.append(path)
    return paths


def write_xvector_ark_scp(
    out_dir: str | Path, embeddings: Mapping[str, np.ndarray], name: str = "xvector", kind: str = "utterance"
) -> tuple[Path, Path]:
    """Write ``out_dir/{name}.ark`` and ``{name}.scp`` (kaldi binary float vectors, keys sorted).

    Keys are utterance ids checked with ``validate_utt_id`` (``kind="utterance"``) or, for any
    other ``kind`` such as ``"speaker"``, with ``validate_speaker_id``. The scp names the ark
    by its absolute path (see the module's note). Returns (ark_path, scp_path).
    """
    import kaldiio

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith((".", "-")):
        raise ValueError(f"invalid ark/scp base name {name!r}")
    checked: dict[str, np.ndarray] = {}
    for key in sorted(embeddings):
        if kind == "utterance":
            validate_utt_id(key)
        else:
            _validate_key(key, kind)
        checked[key] = _embedding_vector(key, embeddings[key], kind)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ark = (out / f"{name}.ark").resolve()
    scp = (out / f"{name}.scp").resolve()
    _check_ark_path(str(ark))
    kaldiio.save_ark(str(ark), checked, scp=str(scp))
    return ark, scp


def _check_ark_path(path: str) -> None:
    """Reject ark paths that kaldiio would misparse from an scp line."""
    if not path or path != path.strip() or any(c in path for c in "\n\r\0[]"):
        raise ValueError(f"ark path {path!r} cannot be written into an scp file")
    if path.startswith("|") or path.endswith("|"):
        raise ValueError(f"ark path {path!r} would be read as a shell pipe")


class SpeakerMeans:
    """Running per-speaker mean embeddings (float64 sums): memory per speaker, not per utterance."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def add(self, utt_id: str, speaker: str, embedding: np.ndarray) -> None:
        """Count one utterance's embedding for its speaker (ValueError on a missing speaker or a
        dimension that differs from the speaker's other utterances)."""
        if not speaker:
            raise ValueError(f"utterance {utt_id!r} has no speaker in utt2spk")
        vec = _embedding_vector(utt_id, embedding).astype(np.float64)
        if speaker in self.sums:
            if self.sums[speaker].shape != vec.shape:
                raise ValueError(
                    f"utterance {utt_id!r}: embedding dimension {vec.shape[0]} differs from "
                    f"{self.sums[speaker].shape[0]} of other utterances of speaker {speaker!r}"
                )
            self.sums[speaker] += vec
            self.counts[speaker] += 1
        else:
            self.sums[speaker] = vec.copy()
            self.counts[speaker] = 1

    def means(self) -> dict[str, np.ndarray]:
        """Mean embedding per speaker (float32), keys sorted."""
        return {spk: (self.sums[spk] / self.counts[spk]).astype(np.float32) for spk in sorted(self.sums)}


def speaker_means(embeddings: Mapping[str, np.ndarray], utt2spk: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Mean embedding per speaker (accumulated in float64, returned float32), keys sorted.

    Every utterance in ``embeddings`` must have a speaker in ``utt2spk`` (ValueError naming it);
    ``utt2spk`` entries without an embedding (e.g. skipped utterances) are ignored.
    """
    acc = SpeakerMeans()
    for utt_id in sorted(embeddings):
        acc.add(utt_id, utt2spk.get(utt_id) or "", embeddings[utt_id])
    return acc.means()


def write_speaker_xvector_ark_scp(
    out_dir: str | Path, spk_embeddings: Mapping[str, np.ndarray], name: str = "spk_xvector"
) -> tuple[Path, Path]:
    """Write per-speaker embeddings (e.g. from `speaker_means`) as ``{name}.ark/.scp`` keyed by speaker id."""
    return write_xvector_ark_scp(out_dir, spk_embeddings, name=name, kind="speaker")


class EmbeddingWriter:
    """An x-vector shard's files: ``utts.tsv`` (``utt_id, speaker, samples`` per utterance, in
    manifest order) and ``xvector.ark/.scp`` in the shard's directory, and one ``{utt_id}.pt`` per
    utterance beside the split's outputs. Embeddings are kept until :meth:`close` (a shard's are a
    few MB) so that the ark is written in one go.

    Args:
        shard_dir: The shard's directory (staged).
        pt_dir: Where the ``.pt`` files go (staged: the split's output directory).
    """

    def __init__(self, shard_dir: Path, pt_dir: Path):
        self.shard_dir = shard_dir
        self.pt_dir = pt_dir
        self.embeddings: dict[str, np.ndarray] = {}
        self.rows = open(shard_dir / UTTS, "w", encoding="utf-8")  # noqa: SIM115 - the shard's writer state: open until close() at the shard's end

    def write(self, result: list[dict[str, Any]]) -> None:
        """Keep one ``forward`` result's embeddings and write their rows."""
        for r in result:
            self.embeddings[r["utt_id"]] = r["embedding"]
            self.rows.write(f"{r['utt_id']}\t{r['speaker']}\t{r['samples']}\n")

    def close(self) -> None:
        """Write the ``.pt`` files and the ark."""
        self.rows.close()
        if self.embeddings:
            write_utterance_tensors(self.pt_dir, self.embeddings)
            write_xvector_ark_scp(self.shard_dir, self.embeddings, name="xvector")
