"""Merged x-vector outputs: ``xvector.{ark,scp}``, speaker means ``spk_xvector.{ark,scp}``, summary."""

from __future__ import annotations

import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from espnet3_flows.manifest import SkippedItem, write_skipped_tsv
from espnet3_flows.parallel.results import ShardResult, shard_summary
from espnet3_flows.xvector.outputs import (
    relocate_scp,
    speaker_means,
    write_speaker_xvector_ark_scp,
    write_xvector_ark_scp,
)

if TYPE_CHECKING:
    from espnet3_flows.xvector.job import XVectorRunner


def load_shard_embeddings(runner: "XVectorRunner", results: list[ShardResult], scratch: Path) -> dict[str, np.ndarray]:
    """Every utterance's embedding, read back from the shards' published arks."""
    import kaldiio

    store = runner.storage
    assert store is not None
    out: dict[str, np.ndarray] = {}
    for r in results:
        ark_rel = next((f for f in r.files if f.endswith("/xvector.ark")), None)
        if ark_rel is None:
            continue
        local = Path(store.path(ark_rel)) if store.is_local else scratch / f"{r.shard.name}.ark"
        if not store.is_local:
            store.get_file(ark_rel, local)
        for key, vec in kaldiio.load_ark(str(local)):
            out[key] = np.asarray(vec, dtype=np.float32)
    return out


def publish_split(runner: "XVectorRunner", results: list[ShardResult]) -> dict[str, Any]:
    """Write and publish one split's merged outputs; ``summary.json`` is published last."""
    store = runner.storage
    assert store is not None, "x-vector extraction needs a save_path"
    rel, split = runner.outputs_rel, runner.split
    rows = sorted((row for r in results for row in r.result["utts"]), key=lambda row: row[0])
    skipped = [*runner.manifest_skipped(), *(SkippedItem.from_dict(s) for r in results for s in r.skipped)]
    stage = Path(tempfile.mkdtemp(prefix=f"espnet3-xvector-merge-{split}-"))
    try:
        embeddings = load_shard_embeddings(runner, results, stage)
        missing = [u for u, _, _ in rows if u not in embeddings]
        if missing:
            raise RuntimeError(f"split {split}: shard arks lack embeddings for {missing[:5]} ({len(missing)} in all)")
        files: list[str] = []
        if embeddings:
            _, scp = write_xvector_ark_scp(stage / "utt", embeddings, name="xvector")
            relocate_scp(scp, store.uri(rel, "xvector.ark"))
            files += ["xvector.ark", "xvector.scp"]
        utt2spk = {u: spk for u, spk, _ in rows if spk}
        means = speaker_means({u: embeddings[u] for u in utt2spk}, utt2spk) if utt2spk else {}
        if means:
            _, spk_scp = write_speaker_xvector_ark_scp(stage / "spk", means, name="spk_xvector")
            relocate_scp(spk_scp, store.uri(rel, "spk_xvector.ark"))
            files += ["spk_xvector.ark", "spk_xvector.scp"]
        (stage / "utt2spk").write_text("".join(f"{u} {s}\n" for u, s in sorted(utt2spk.items())))
        (stage / "skipped.tsv").write_text(write_skipped_tsv(skipped))
        files += ["utt2spk", "skipped.tsv"]
        sources = {"xvector.ark": "utt", "xvector.scp": "utt", "spk_xvector.ark": "spk", "spk_xvector.scp": "spk"}
        for name in files:  # arks before their scps: a published scp never points at a missing ark
            store.publish_file(stage / sources.get(name, "") / name, posixpath.join(rel, name))
        dims = {int(r.result["dim"]) for r in results if r.result.get("dim")}
        sr = runner.cfg.xvector.sampling_rate
        summary = {
            "split": split,
            "utterances": len(rows),
            "seconds": float(sum(n for _, _, n in rows) / sr),
            "embedding_dim": dims.pop() if len(dims) == 1 else None,
            "speakers": len(means),
            "utterances_without_speaker": len(rows) - len(utt2spk),
            "skipped": len(skipped),
            **shard_summary(results),
            "files": {name: store.uri(rel, name) for name in files},
        }
        store.write_json(posixpath.join(rel, "summary.json"), summary)
        summary["files"]["summary.json"] = store.uri(rel, "summary.json")
        return summary
    finally:
        shutil.rmtree(stage, ignore_errors=True)
