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
