"""Merged x-vector outputs: ``{tag}.{ark,scp}``, speaker means ``spk_{tag}.{ark,scp}``, summary
(``tag`` is ``xvector.spk_embed_tag``, ``xvector`` by default: ESPnet2's names)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from espnet3_flows.confinement import confine
from espnet3_flows.inputs.records import SkippedItem
from espnet3_flows.parallel.results import ShardResult, shard_summary
from espnet3_flows.utterance_job import UtteranceRunner, publish_split_files
from espnet3_flows.xvector.outputs import UTTS, SpeakerMeans, write_speaker_xvector_ark_scp


def _shard_embeddings(store: Any, result: ShardResult, scratch: Path) -> dict[str, np.ndarray]:
    """One shard's embeddings, read back from its published ark."""
    import kaldiio

    ark_rel = result.file("xvector.ark", required=False)
    if ark_rel is None:
        return {}
    # (a shard's name is its record's: a copy is downloaded, and removed, only inside the scratch directory)
    copy = f"{scratch}/{result.shard.name}.ark"
    local = Path(store.path(ark_rel)) if store.is_local else Path(confine(str(scratch), copy))
    if not store.is_local:
        store.get_file(ark_rel, local)
    try:
        return {key: np.asarray(vec, dtype=np.float32) for key, vec in kaldiio.load_ark(str(local))}
    finally:
        if not store.is_local:
            local.unlink(missing_ok=True)


def _shard_rows(store: Any, result: ShardResult) -> list[tuple[str, str, int]]:
    """One shard's ``(utt_id, speaker, samples)`` rows, in manifest order."""
    rows = []
    for line in store.read_bytes(result.file(UTTS)).decode("utf-8").splitlines():
        utt, spk, n = line.split("\t")
        rows.append((utt, spk, int(n)))
    return rows


def publish_split(runner: UtteranceRunner, results: list[ShardResult]) -> dict[str, Any]:
    """Write and publish one split's merged outputs; ``summary.json`` is published last.

    Shard by shard (manifest order): each shard's embeddings are appended to the split's
    ``{tag}.ark`` and folded into running speaker means, so memory is per shard and per
    speaker, never per utterance. Files are named after ``xvector.spk_embed_tag`` as ESPnet2's
    ``extract_xvectors.py`` names them: ``{tag}.{ark,scp}`` and ``spk_{tag}.{ark,scp}``.
    """
    import kaldiio

    store = runner.storage
    assert store is not None, "x-vector extraction needs a save_path"
    rel, split = runner.outputs_rel, runner.split
    tag = runner.cfg.xvector.spk_embed_tag
    utt_ark, utt_scp, spk_ark, spk_scp_name = f"{tag}.ark", f"{tag}.scp", f"spk_{tag}.ark", f"spk_{tag}.scp"
    skipped = [*runner.manifest_skipped(), *(SkippedItem.from_dict(s) for r in results for s in r.skipped)]
    stage = Path(tempfile.mkdtemp(prefix=f"espnet3-xvector-merge-{split}-"))
    try:
        (stage / "utt").mkdir()
        means = SpeakerMeans()
        n_utts = n_samples = without_speaker = 0
        with kaldiio.WriteHelper(f"ark,scp:{stage / 'utt' / utt_ark},{stage / 'utt' / utt_scp}") as ark, \
                open(stage / "utt2spk", "w", encoding="utf-8") as utt2spk:
            for r in results:
                embeddings = _shard_embeddings(store, r, stage)
                for utt, spk, n in _shard_rows(store, r):
                    if utt not in embeddings:
                        raise RuntimeError(f"split {split}: the ark of {r.shard.name} lacks the embedding of {utt!r}")
                    ark(utt, embeddings[utt])
                    n_utts += 1
                    n_samples += n
                    if spk:
                        utt2spk.write(f"{utt} {spk}\n")
                        means.add(utt, spk, embeddings[utt])
                    else:
                        without_speaker += 1
        files: list[str] = []
        if n_utts:
            files += [utt_ark, utt_scp]
        speakers = means.means()
        if speakers:
            write_speaker_xvector_ark_scp(stage / "spk", speakers, name=f"spk_{tag}")
            files += [spk_ark, spk_scp_name]
        files.append("utt2spk")
        sources = {utt_ark: "utt", utt_scp: "utt", spk_ark: "spk", spk_scp_name: "spk"}
        # arks before their scps: a published scp never points at a missing ark
        staged = [(name, stage / sources.get(name, "") / name) for name in files]
        dims = {int(r.result["dim"]) for r in results if r.result.get("dim")}
        sr = runner.cfg.xvector.sampling_rate
        summary = {
            "split": split,
            "utterances": n_utts,
            "seconds": float(n_samples / sr),
            "embedding_dim": dims.pop() if len(dims) == 1 else None,
            "speakers": len(speakers),
            "utterances_without_speaker": without_speaker,
            **shard_summary([r.status() for r in results]),
        }
        return publish_split_files(store, rel, staged, skipped, summary)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
