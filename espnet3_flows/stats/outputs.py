"""Merged collect-stats outputs: ESPnet2 ``feats_stats.npz``, shape files, keys, summary, plot, scp."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import numpy as np

from espnet3_flows.external_sort import sorted_lines
from espnet3_flows.frontend_job import native_rates_summary
from espnet3_flows.inputs.records import SkippedItem, id_file_name
from espnet3_flows.parallel.results import ShardResult, shard_summary
from espnet3_flows.scp import scp_offsets
from espnet3_flows.stats.accumulator import StatsAccumulator
from espnet3_flows.stats.tokens import vocabulary_size
from espnet3_flows.utterance_job import UtteranceRunner, publish_split_files


SHAPES = "shapes.tsv"  # a shard's per-utterance rows (written by StatsShardWriter)

EPS = 1e-20  # ESPnet2 GlobalMVN's floor on the variance


def row_shape(row: Mapping[str, Any]) -> tuple[int, int] | None:
    """An utterance row's ``(frames, dim)``: its features' shape, or the ``shape`` a frontend that
    kept the features gave (:class:`~espnet3_flows.frontends.frontend.MomentsBatch`); ``None``
    without a frontend."""
    f = row["feats"]
    return (int(f.shape[0]), int(f.shape[1])) if f is not None else row.get("shape")


class StatsShardWriter:
    """A collect-stats shard's files: ``shapes.tsv`` (one ``utt_id, samples, frames,dim[, tokens]``
    row per utterance, in manifest order) in the shard's directory and, with ``feats_format``, the
    features: a Kaldi ark ``<collect_feats>/feats.<shard>.ark`` with its scp (``feats.scp``) in the
    shard's directory (``"ark"``), or one ``<collect_feats>/data_feats/<utt>.npy`` each (``"npy"``,
    ESPnet2's layout).

    Args:
        shard_dir: The shard's directory (``split.<hash>``, staged).
        collect_feats: The split's ``collect_feats`` directory (staged beside it).
        feats_format: ``None`` (no features written), ``"ark"`` or ``"npy"``.
    """

    def __init__(self, shard_dir: Path, collect_feats: Path, feats_format: str | None = None):
        self.npy_dir = collect_feats / "data_feats"
        self.shapes = open(shard_dir / SHAPES, "w", encoding="utf-8")  # noqa: SIM115 - the shard's writer state: open until close() at the shard's end
        self.feats_format = feats_format
        self.ark = None
        if feats_format == "npy":
            self.npy_dir.mkdir(parents=True, exist_ok=True)
        elif feats_format is not None:
            import kaldiio

            collect_feats.mkdir(parents=True, exist_ok=True)
            self.ark = kaldiio.WriteHelper(f"ark,scp:{collect_feats / shard_ark_name(shard_dir.name)},"
                                           f"{shard_dir / 'feats.scp'}")

    def write(self, result: list[dict[str, Any]]) -> None:
        """Write one ``forward`` result's utterances."""
        for r in result:
            f = r["feats"]
            dims = row_shape(r)
            shape = "" if dims is None else f"{dims[0]},{dims[1]}"
            tokens = "" if r.get("tokens") is None else f"\t{r['tokens']}"
            self.shapes.write(f"{r['utt_id']}\t{r['speech_len']}\t{shape}{tokens}\n")
            if self.feats_format == "npy":
                np.save(self.npy_dir / id_file_name(r["utt_id"], ".npy"), np.asarray(f, dtype=np.float32))
            elif self.ark is not None:
                self.ark(r["utt_id"], np.asarray(f, dtype=np.float32))

    def close(self) -> None:
        """Complete the files."""
        self.shapes.close()
        if self.ark is not None:
            self.ark.close()


def shard_ark_name(shard: str) -> str:
    """The file name of a shard's feature ark in ``collect_feats/``."""
    return f"feats.{shard}.ark"


def merge_stats(results: list[ShardResult]) -> StatsAccumulator:
    """Chan-merge the shards' count/mean/M2 (order-independent up to float64 rounding)."""
    acc = StatsAccumulator()
    for r in results:
        acc.merge(StatsAccumulator.from_dict(r.result["stats"]))
    return acc


def espnet_mvn(stats: dict[str, np.ndarray], eps: float = EPS) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std exactly as ``espnet2.layers.global_mvn.GlobalMVN`` derives them from the npz."""
    count = stats["count"]
    mean = stats["sum"] / count
    var = stats["sum_square"] / count - mean * mean
    return mean, np.sqrt(np.maximum(var, eps))


def _fold(parts: list[list[Any]]) -> tuple[int, Any, Any]:
    """Sum, min and max over the shards' ``[sum, min, max]``."""
    mins = [p[1] for p in parts if p[1] is not None]
    maxs = [p[2] for p in parts if p[2] is not None]
    return sum(p[0] for p in parts), (min(mins) if mins else None), (max(maxs) if maxs else None)


HIST_BINS = 50
_HIST_BATCH = 65_536  # lengths binned at a time


def publish_split(runner: UtteranceRunner, results: list[ShardResult]) -> dict[str, Any]:
    """Write and publish one split's merged outputs; ``summary.json`` is published last.

    Per-utterance rows are streamed from the shards' ``shapes.tsv`` into ``speech_shape`` /
    ``feats_shape`` / ``text_shape`` sorted by utterance id, as ESPnet2 writes them, through an
    external merge: memory is per shard and per sort chunk, not per utterance.

    Returns:
        The summary (utterances, frames, seconds, dims, lengths, skipped, shard counts, files).
    """
    store = runner.storage
    assert store is not None, "collect-stats needs an output_dir"
    plotting = _import_plotting_beside()  # (workers do not preload it: it would delay every first shard)
    split, cfg = runner.split, runner.cfg
    skipped = [*runner.manifest_skipped(), *(SkippedItem.from_dict(s) for r in results for s in r.skipped)]
    acc = merge_stats(results)
    sr = cfg.frontend.sampling_rate
    n_utts = sum(int(r.result["utterances"]) for r in results)
    samples = _fold([r.result["samples"] for r in results])
    frames = _fold([r.result["frames"] for r in results])
    in_frames = frames[1] is not None
    lo, hi = (frames[1], frames[2]) if in_frames else ((samples[1] or 0) / sr, (samples[2] or 0) / sr)
    edges = np.linspace(lo, hi if hi > lo else lo + 1, HIST_BINS + 1)
    stage = Path(tempfile.mkdtemp(prefix=f"espnet3-merge-{split}-"))
    try:
        tokens = cfg.tokens
        hist, frame_lengths = _write_shape_files(store, results, stage, tokens, sr, edges)
        files: list[str] = []
        if acc.count:
            np.savez(stage / "feats_stats.npz", **acc.to_espnet())
            # ESPnet2's collect_stats sums every output of collect_feats, feats_lengths too
            # (aggregate_stats_dirs.py reads each key of stats_keys): the same file, exact
            count, total, squares = frame_lengths
            np.savez(stage / "feats_lengths_stats.npz", count=np.int64(count), sum=np.int64(total),
                     sum_square=np.int64(squares))
            _write_lhotse_mvn(stage / "lhotse_global_mvn.pt", acc)
            files += ["feats_stats.npz", "feats_lengths_stats.npz", "lhotse_global_mvn.pt", "feats_shape"]
        (stage / "stats_keys").write_text("feats\nfeats_lengths\n" if acc.count else "")
        (stage / "batch_keys").write_text("speech\ntext\n" if tokens.enabled else "speech\n")
        if tokens.enabled:
            files += ["text_shape", f"text_shape.{tokens.token_type}"]
        files += ["speech_shape", "stats_keys", "batch_keys"]
        plotting.join()
        if n_utts and _plot(stage / "stats.png", acc, hist, edges, in_frames, f"{split}: {n_utts} utterances"):
            files.append("stats.png")
        if cfg.write_collected_feats:
            _merge_scp(runner, results, stage / "feats.scp")
        summary = _summary(split, cfg, acc, n_utts, samples, frames, results)
        staged = [(name, stage / name) for name in files]
        if cfg.write_collected_feats:  # after the shards' arks and npy files it points at
            staged.append(("collect_feats/feats.scp", stage / "feats.scp"))
        return publish_split_files(store, split, staged, skipped, summary)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _write_shape_files(store: Any, results: list[ShardResult], stage: Path, tokens: Any, sr: int,
                       edges: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """``speech_shape``, ``feats_shape`` and the ``text_shape`` files in ``stage``, sorted by
    utterance id as ESPnet2 writes them (aggregate_stats_dirs.py), through runs on local disk:
    memory stays flat at any number of utterances.

    Returns:
        The length histogram over ``edges`` (frames, or seconds without features) and the
        utterances with features, the sum and the sum of squares of their frame counts (exact ints).
    """
    hist = np.zeros(len(edges) - 1, dtype=np.int64)
    frame_lengths = [0, 0, 0]
    vocabulary = vocabulary_size(tokens) if tokens.enabled else 0
    with open(stage / "speech_shape", "w", encoding="utf-8") as speech_shape, \
            open(stage / "feats_shape", "w", encoding="utf-8") as feats_shape, \
            open(stage / "text_shape", "w", encoding="utf-8") as text_shape, \
            open(stage / f"text_shape.{tokens.token_type or 'none'}", "w", encoding="utf-8") as typed_shape:
        lengths: list[float] = []
        rows = (row for r in results for row in _shard_rows(store, r))
        for row in sorted_lines(rows, str(stage)):
            utt, n, shape, *count = row.split("\t")
            speech_shape.write(f"{utt} {n}\n")
            if count and tokens.enabled:
                text_shape.write(f"{utt} {count[0]}\n")
                typed_shape.write(f"{utt} {count[0]},{vocabulary}\n")  # as asr.sh derives it
            if shape:
                feats_shape.write(f"{utt} {shape}\n")
                n_frames = int(shape.split(",", 1)[0])
                lengths.append(n_frames)
                frame_lengths[0] += 1
                frame_lengths[1] += n_frames
                frame_lengths[2] += n_frames * n_frames
            else:
                lengths.append(int(n) / sr)
            if len(lengths) >= _HIST_BATCH:
                hist += np.histogram(np.asarray(lengths, dtype=np.float64), bins=edges)[0]
                lengths.clear()
        if lengths:
            hist += np.histogram(np.asarray(lengths, dtype=np.float64), bins=edges)[0]
    return hist, frame_lengths


def _summary(split: str, cfg: Any, acc: StatsAccumulator, n_utts: int, samples: list[Any], frames: list[Any],
             results: list[ShardResult]) -> dict[str, Any]:
    """The split's ``summary.json`` (without its files and skipped items, which publishing adds),
    and a warning (logged too) when much of its audio was recorded below the job's rate."""
    sr = cfg.frontend.sampling_rate
    in_frames = frames[1] is not None
    return {
        "split": split,
        "utterances": n_utts,
        "frames": int(frames[0]) if in_frames else 0,
        "seconds": float(samples[0] / sr) if n_utts else 0.0,
        "feature_dim": acc.dim,
        "frontend": cfg.frontend.type,
        "frames_min": frames[1],
        "frames_max": frames[2],
        "frames_mean": float(frames[0] / n_utts) if in_frames and n_utts else None,
        "seconds_min": float(samples[1] / sr) if n_utts else None,
        "seconds_max": float(samples[2] / sr) if n_utts else None,
        **shard_summary([r.status() for r in results]),
        **native_rates_summary(split, results, n_utts, sr),
        **padding_summary(results),
    }


def padding_summary(results: list[ShardResult]) -> dict[str, Any]:
    """``padding_fraction``: of the samples a frontend computed to get the features, the share that
    was padding of its batches (only from shards whose moments the frontend computed, which
    count it: none without them)."""
    counted = [r.result["computed_samples"] for r in results if r.result.get("computed_samples")]
    computed = sum(int(c[1]) for c in counted)
    if not computed:
        return {}
    return {"padding_fraction": round(1.0 - sum(int(c[0]) for c in counted) / computed, 6)}


def _shard_rows(store: Any, result: ShardResult) -> list[str]:
    """The rows of one shard's ``shapes.tsv`` (one shard at a time: memory per shard)."""
    return store.read_bytes(result.file(SHAPES)).decode("utf-8").splitlines()


def _write_lhotse_mvn(path: Path, acc: StatsAccumulator) -> None:
    import torch

    std = np.sqrt(np.maximum(acc.variance(), EPS))
    torch.save({"norm_means": torch.from_numpy(acc.mean.astype(np.float32)),  # type: ignore[union-attr]
                "norm_stds": torch.from_numpy(std.astype(np.float32))}, path)


def _merge_scp(runner: UtteranceRunner, results: list[ShardResult], dest: Path) -> None:
    """One scp for the split whose lines point at the published shard arks, or at the utterances'
    ``.npy`` files (absolute path or URL), in manifest order, written shard by shard."""
    store = runner.storage
    assert store is not None
    with open(dest, "w", encoding="utf-8") as out:
        for r in results:
            if runner.cfg.collected_feats_format == "npy":  # ESPnet2's NpyScpWriter layout
                for row in _shard_rows(store, r):
                    utt = row.split("\t", 1)[0]
                    out.write(f"{utt} {store.uri(runner.split, 'collect_feats', 'data_feats', id_file_name(utt, '.npy'))}\n")
                continue
            scp_rel = r.file("feats.scp", required=False)
            if scp_rel is None:
                continue
            ark_uri = store.uri(runner.split, "collect_feats", shard_ark_name(r.shard.name))
            for key, offset in scp_offsets(store.read_bytes(scp_rel).decode("utf-8"), r.shard.name).items():
                out.write(f"{key} {ark_uri}:{offset}\n")


def _import_plotting_beside() -> threading.Thread:
    """matplotlib's Figure and Agg canvas imported on a thread (~0.5 s) while the merge reads and
    sorts the shards' rows; join it before plotting (an import that fails there fails again, and
    is reported, in :func:`_plot`)."""
    def _import() -> None:
        with contextlib.suppress(Exception):
            import matplotlib.backends.backend_agg
            import matplotlib.figure  # noqa: F401

    thread = threading.Thread(target=_import, name="espnet3-import-matplotlib", daemon=True)
    thread.start()
    return thread


def _plot(path: Path, acc: StatsAccumulator, hist: np.ndarray, edges: np.ndarray, in_frames: bool,
          title: str = "") -> bool:
    """Per-dimension mean ± std and a length histogram, as a PNG titled ``title`` (the split)
    (False if nothing to plot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Figure + Agg canvas, not pyplot: no global figure registry on a worker, and pyplot's import is skipped
    fig = Figure(figsize=(10 if acc.count else 5, 3.2))
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, 2 if acc.count else 1))
    if acc.count:
        dims = np.arange(acc.dim or 0)
        std = np.sqrt(acc.variance())
        axes[0].plot(dims, acc.mean, lw=1.2, label="mean")
        axes[0].fill_between(dims, acc.mean - std, acc.mean + std, alpha=0.3, label="± std")  # type: ignore[operator]
        axes[0].set_xlabel("feature dimension")
        axes[0].set_ylabel("feature value")
        axes[0].set_title("per-dimension mean ± std")
        axes[0].legend(fontsize=8)
    ax = axes[-1]
    ax.stairs(hist, edges, fill=True)
    ax.set_xlabel("frames" if in_frames else "seconds")
    ax.set_ylabel("utterances")
    ax.set_title("utterance lengths")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.82 if title else 0.88, wspace=0.25)  # no tight_layout: it draws twice
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    path.write_bytes(buf.getvalue())
    return True
