"""One split's merged outputs of extract-features, sorted by utterance id, written shard by shard
(memory per shard and sort chunk).

- ``feats.scp``: ``utt_id <ark URI>:<offset>`` into the published ``feats/feats.<shard>.ark``
  (Kaldi's and ESPnet2's format: ``kaldiio.load_scp`` reads it);
- ``feats_shape``: ``utt_id frames,dim`` (ESPnet2's shape file);
- ``cuts.jsonl.gz``: a lhotse ``CutSet`` (cut id = utterance id) whose features are those of
  ``feats.scp`` (lhotse storage type ``kaldiio``, read by lhotse with ``kaldi_native_io``);
  transcript and speaker as a supervision; ``duration`` = frames × frame shift;
- ``skipped.tsv`` and ``summary.json`` last.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

from espnet3_flows.external_sort import sorted_lines
from espnet3_flows.inputs.records import SkippedItem
from espnet3_flows.parallel.results import ShardResult, shard_summary
from espnet3_flows.scp import scp_offsets
from espnet3_flows.storage import Storage
from espnet3_flows.frontend_job import native_rates_summary
from espnet3_flows.frontends.config import FrontendConfig
from espnet3_flows.utterance_job import UtteranceRunner, publish_split_files


ROWS = "rows.tsv"  # a shard's per-utterance rows (written by FeatureShardWriter)


class FeatureShardWriter:
    """An extract-features shard's files: the features in one Kaldi ark (published beside the
    split's outputs, at :func:`shard_ark_rel`) with its scp, and ``rows.tsv`` (``utt_id, samples,
    frames, dim, text, speaker`` per utterance, in manifest order), both in the shard's directory.

    Args:
        shard_dir: The shard's directory (staged).
        ark: Where the ark goes (staged, beside the split's outputs).
    """

    def __init__(self, shard_dir: Path, ark: Path):
        import kaldiio

        ark.parent.mkdir(parents=True, exist_ok=True)
        self.rows = open(shard_dir / ROWS, "w", encoding="utf-8")  # noqa: SIM115 - the shard's writer state: open until close() at the shard's end
        self.ark = kaldiio.WriteHelper(f"ark,scp:{ark},{shard_dir / 'feats.scp'}")

    def write(self, result: list[dict[str, Any]]) -> None:
        """Write one ``forward`` result's utterances."""
        import numpy as np

        for r in result:
            f = np.asarray(r["feats"], dtype=np.float32)
            self.ark(r["utt_id"], f)
            text = " ".join(str(r["text"]).split())  # one line, one field
            self.rows.write(f"{r['utt_id']}\t{r['speech_len']}\t{f.shape[0]}\t{f.shape[1]}\t{text}\t"
                            f"{r['speaker']}\n")

    def close(self) -> None:
        """Complete the files."""
        self.rows.close()
        self.ark.close()


def shard_ark_rel(outputs_rel: str, shard: str) -> str:
    """A shard's feature ark, relative to the output location."""
    return f"{outputs_rel}/feats/feats.{shard}.ark"


def frame_shift_seconds(fe: FrontendConfig, results: Sequence[ShardResult] = ()) -> float:
    """Seconds between frames of the frontend's features (lhotse's ``frame_shift``): what its
    type says of the config (:meth:`~espnet3_flows.frontends.config.FrontendType.frame_shift`),
    else the hop the shards' built frontend stated (``hop_samples`` in their ``done`` records,
    over ``frontend.sampling_rate``), else ``frontend.frame_shift``."""
    shift = fe.kind.frame_shift(fe)
    if shift is not None:
        return shift
    hops = {r.result.get("hop_samples") for r in results if isinstance(r.result, Mapping)} - {None}
    return hops.pop() / fe.sampling_rate if len(hops) == 1 else float(fe.frame_shift)


def _shard_rows(store: Storage, result: ShardResult, outputs_rel: str) -> Iterator[str]:
    """Each utterance of one shard as its ``rows.tsv`` line with ``<ark URI>:<offset>`` appended
    (a tab-separated field), in manifest order."""
    ark_uri = store.uri(shard_ark_rel(outputs_rel, result.shard.name))
    offsets = scp_offsets(store.read_bytes(result.file("feats.scp")).decode("utf-8"), result.shard.name)
    for line in store.read_bytes(result.file(ROWS)).decode("utf-8").splitlines():
        utt = line.split("\t", 1)[0]
        if utt not in offsets:
            raise RuntimeError(f"{result.shard.name}: the scp of its ark lacks utterance {utt!r}")
        yield f"{line}\t{ark_uri}:{offsets[utt]}"


def _cut(utt: str, frames: int, dim: int, text: str, speaker: str, shift: float, rate: int, kind: str,
         scp_uri: str) -> dict[str, Any]:
    duration = round(frames * shift, 6)
    cut: dict[str, Any] = {
        "id": utt, "start": 0.0, "duration": duration, "channel": 0,
        "features": {"type": kind, "num_frames": frames, "num_features": dim, "frame_shift": shift,
                     "sampling_rate": rate, "start": 0.0, "duration": duration, "storage_type": "kaldiio",
                     "storage_path": scp_uri, "storage_key": utt, "recording_id": None, "channels": 0},
        "supervisions": [], "type": "MonoCut"}
    if text or speaker:
        sup = {"id": utt, "recording_id": utt, "start": 0.0, "duration": duration, "channel": 0}
        if text:
            sup["text"] = text
        if speaker:
            sup["speaker"] = speaker
        cut["supervisions"].append(sup)
    return cut


def publish_split(runner: UtteranceRunner, results: list[ShardResult]) -> dict[str, Any]:
    """Write and publish one split's ``feats.scp``, ``feats_shape`` and ``cuts.jsonl.gz``, sorted
    by utterance id and streamed shard by shard; ``summary.json`` is published last."""
    store = runner.storage
    assert store is not None, "extract-features needs an output_dir"
    split, fe = runner.split, runner.cfg.frontend
    rel = runner.outputs_rel
    skipped = [*runner.manifest_skipped(), *(SkippedItem.from_dict(s) for r in results for s in r.skipped)]
    shift, kind = frame_shift_seconds(fe, results), fe.kind.label(fe)
    scp_uri = store.uri(rel, "feats.scp")
    stage = Path(tempfile.mkdtemp(prefix=f"espnet3-features-merge-{split}-"))
    try:
        n_utts = frames = samples = 0
        dims: set[int] = set()
        with open(stage / "feats.scp", "w", encoding="utf-8") as scp, \
                open(stage / "feats_shape", "w", encoding="utf-8") as shape, \
                gzip.open(stage / "cuts.jsonl.gz", "wt", encoding="utf-8") as cuts:
            # sorted by utterance id, as Kaldi and ESPnet2 keep scp and shape files (external
            # merge through local disk: memory per shard and sort chunk)
            rows = (row for r in results for row in _shard_rows(store, r, rel))
            for row in sorted_lines(rows, str(stage)):
                utt, n, n_frames, dim, text, speaker, loc = row.split("\t")
                scp.write(f"{utt} {loc}\n")
                shape.write(f"{utt} {n_frames},{dim}\n")
                cuts.write(json.dumps(_cut(utt, int(n_frames), int(dim), text, speaker, shift, fe.sampling_rate,
                                           kind, scp_uri), ensure_ascii=False) + "\n")
                n_utts += 1
                frames += int(n_frames)
                samples += int(n)
                dims.add(int(dim))
        staged = [(name, stage / name) for name in ("feats.scp", "feats_shape", "cuts.jsonl.gz")] if n_utts else []
        summary = {"split": split, "utterances": n_utts, "frames": frames,
                   "seconds": float(samples / fe.sampling_rate), "feature_dim": dims.pop() if len(dims) == 1 else None,
                   "frame_shift": shift, "frontend": kind, **shard_summary([r.status() for r in results]),
                   **native_rates_summary(split, results, n_utts, fe.sampling_rate)}
        return publish_split_files(store, rel, staged, skipped, summary)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
