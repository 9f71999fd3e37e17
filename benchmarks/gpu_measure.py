"""Measuring on a device for :mod:`benchmarks.bench_gpu`: synchronised timings, peak memory,
feature and embedding errors, and torch.profiler's busiest operators."""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks import common


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``fn()`` with the device drained before and after, and its value."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def peak_memory_mb(device: str) -> float | None:
    """The GPU memory peak since the last :func:`reset_peak`, in MB (``None`` on the CPU)."""
    return common.mb(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    """Free cached blocks and restart the peak count."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def feature_error(ours: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> dict[str, float]:
    """Worst max |Δ| / max |ref| and worst relative RMS over utterances."""
    worst_max = worst_rms = 0.0
    for a, b in zip(ours, ref, strict=True):
        if a.shape != b.shape:
            return {"max_rel": float("inf"), "rel_rms": float("inf")}
        d = a.astype(np.float64) - b
        worst_max = max(worst_max, float(np.abs(d).max() / max(np.abs(b).max(), 1e-30)))
        worst_rms = max(worst_rms, float(np.sqrt((d ** 2).mean() / max((b.astype(np.float64) ** 2).mean(), 1e-30))))
    return {"max_rel": worst_max, "rel_rms": worst_rms}


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The worst row-wise cosine similarity of two embedding matrices."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    cos = (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))
    return float(cos.min())


def profile_table(device: str, fn: Callable[[], Any], rows: int = 12) -> str:
    """torch.profiler's busiest operators of ``fn()`` on ``device`` (by device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    for key in (("self_device_time_total", "self_cuda_time_total") if device.startswith("cuda") else ()) + (
            "self_cpu_time_total",):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return ""


def moments_error(moments: Any, ref: Sequence[np.ndarray]) -> dict[str, float]:
    """How far device moments (:class:`~espnet3_flows.frontends.device_moments.Moments`) are from the
    host's float64 accumulator over ``ref``'s features: the largest difference of the mean and of
    the variance, relative to each one's largest magnitude."""
    from espnet3_flows.stats.accumulator import StatsAccumulator

    acc = StatsAccumulator()
    for f in ref:
        acc.update(f)
    count, mean, m2 = moments.to_host()
    if count != acc.count:
        return {"stats_rel_diff": float("inf")}
    var, ref_var = m2 / count, acc.variance()
    return {"stats_rel_diff": float(max(np.abs(mean - acc.mean).max() / np.abs(acc.mean).max(),
                                        np.abs(var - ref_var).max() / np.abs(ref_var).max()))}


def flops_per_audio_second(model: torch.nn.Module, samples: int = 8 * 16000) -> float:
    """Floating-point operations per audio second of ``model.collect_feats`` on one utterance of
    ``samples`` samples (8 s at 16 kHz: attention grows with length), counted by
    ``torch.utils.flop_counter`` on the CPU (matrix products, convolutions, attention): what a
    GPU's achieved FLOP/s is computed from. (Under ``no_grad``: the counter fails on weight-norm
    parametrizations under ``inference_mode``.)"""
    from torch.utils.flop_counter import FlopCounterMode

    device = next(model.parameters()).device
    model.to("cpu")
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.collect_feats(torch.zeros(1, samples), torch.tensor([samples]))
    finally:
        model.to(device)
    return float(counter.get_total_flops()) * 16000 / samples


def padding_fraction(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """The share of padding in the samples of padded batches ``groups`` (positions into ``lengths``)."""
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1.0 - sum(lengths[i] for g in groups for i in g) / computed if computed else 0.0


def written_features(frontend: Any, data: Sequence[np.ndarray], device: str, call: int) -> float:
    """Seconds of extract-features' product path over ``data``: calls of ``call`` waveforms (the
    job's ``batch_size``) in their given order, each call's features written into a Kaldi ark as a
    shard's are (``features.outputs.FeatureShardWriter``, into a temporary directory)."""
    import tempfile
    from pathlib import Path

    from espnet3_flows.features.outputs import FeatureShardWriter

    def run(tmp: Path) -> None:
        writer = FeatureShardWriter(tmp, tmp / "feats.ark")
        for start in range(0, len(data), call):
            part = data[start:start + call]
            writer.write([{"utt_id": f"u{start + i:07d}", "speech_len": len(w), "feats": f, "text": "",
                           "speaker": ""} for i, (w, f) in enumerate(zip(part, frontend(part, {}), strict=True))])
        writer.close()

    with tempfile.TemporaryDirectory(prefix="gpu-written-") as tmp:
        elapsed, _ = timed(device, lambda: run(Path(tmp)))
    return elapsed


def written_rows(model: Any, device: str, data: Sequence[np.ndarray], max_batch_samples: int,
                 audio_s: float) -> list[dict[str, Any]]:
    """The ``hubert`` part's rows of extract-features as a job runs it (:func:`written_features`):
    calls of 16 (the default ``batch_size``) and of 256 utterances, in bf16 on a GPU (float32 on a
    CPU core, where bf16 runs at ~0.1x real time)."""
    from espnet3_flows.frontends.frontend import model_frontend

    precision = "bf16" if device.startswith("cuda") else "float32"
    rows = []
    for call in (16, 256):
        elapsed = written_features(model_frontend(model, device, max_batch_samples, precision), data, device, call)
        rows.append({"part": "hubert", "mode": f"written, calls of {call}", "precision": precision,
                     "max_batch_samples": max_batch_samples, "utts": len(data), "audio_s": audio_s,
                     "wall_s": elapsed, "x_realtime": audio_s / elapsed, "peak_mb": None, "max_rel": None,
                     "rel_rms": None})
    return rows


def bucket_shape_rows(model: Any, device: str, data: Sequence[np.ndarray], subset: Sequence[np.ndarray],
                      ref: Sequence[np.ndarray], max_batch_samples: int, audio_s: float) -> list[dict[str, Any]]:
    """The ``hubert`` part's rows of ``frontend.bucket_shapes`` (issue 62, part 2), beside the same
    call padded as the batches are: every utterance in one call, in bf16 on a GPU (float32 on a CPU
    core), timed after a first pass that met every shape (so cuDNN's attention, on with fixed
    shapes, has planned them), with the padding and the distinct shapes of the batches."""
    from espnet3_flows.frontends.frontend import model_frontend

    precision = "bf16" if device.startswith("cuda") else "float32"
    lengths = [len(w) for w in data]
    rows = []
    for fixed in (False, True):
        frontend = model_frontend(model, device, max_batch_samples, precision, bucket_shapes=fixed)
        frontend(data, {})  # every shape once
        elapsed, _ = timed(device, lambda frontend=frontend: frontend(data, {}))
        shapes = [frontend.shape([lengths[i] for i in group]) for group in frontend.batches(lengths)]
        rows.append({"part": "hubert", "mode": "bucket shapes" if fixed else "padded as they are, second pass",
                     "precision": precision, "max_batch_samples": max_batch_samples, "utts": len(data),
                     "audio_s": audio_s, "wall_s": elapsed, "x_realtime": audio_s / elapsed, "peak_mb": None,
                     **feature_error(frontend(subset, {}), ref),
                     "padding": 1.0 - sum(lengths) / sum(rows_ * length for rows_, length in shapes),
                     "shapes": len(set(shapes))})
    return rows
