"""Benchmark: padding waste and batch count of our budgeted batches vs lhotse's bucketing sampler.

The lhotse side is ``DynamicBucketingSampler``.

Both sides see the same utterances (lognormal durations, median 4 s, sigma 0.5, clipped
to [0.5, 30] s, whole 10 ms frames) and the same budget: lhotse's ``max_duration`` caps
``batch size * longest cut`` in a batch, which is what our ``length`` batches' ``max_duration``
means too. Padding is measured identically for both:
``(padded - real) / padded`` frames with ``padded = sum(batch size * longest)``.

Run ``python benchmarks/bench_batching.py [--quick]``; writes
``benchmarks/results/batching.json`` and ``batching.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from espnet3_flows.batching import BatchConfig, LengthTable, build_batch_plan, padding_stats

FRAME_SHIFT = 0.01
RESULTS = Path(os.environ.get("ESPNET3_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def utterance_frames(count: int, seed: int) -> np.ndarray:
    """Frame counts of ``count`` lognormal utterance durations."""
    rng = np.random.default_rng(seed)
    durations = np.clip(rng.lognormal(np.log(4.0), 0.5, count), 0.5, 30.0)
    return np.rint(durations / FRAME_SHIFT).astype(np.int64)


def dummy_cuts(frames: np.ndarray) -> Any:
    """A CutSet of audio-less dummy cuts lasting exactly ``frames`` 10 ms frames each."""
    from lhotse import CutSet
    from lhotse.testing.dummies import dummy_cut

    return CutSet.from_cuts(
        dummy_cut(i, duration=float(f) * FRAME_SHIFT) for i, f in enumerate(frames)
    )


def measure(lengths: np.ndarray, batches: list[list[int]], budget: float) -> dict[str, float]:
    """Batch count, padding fraction and the share of batches over budget."""
    real, padded = padding_stats(lengths, batches)
    over = sum(len(b) * lengths[b].max() > budget for b in batches)
    return {
        "num_batches": len(batches),
        "padding_fraction": (padded - real) / padded,
        "over_budget": over / len(batches),
        "utterances": sum(len(b) for b in batches),
    }


def ours(cuts: Any, max_duration: float) -> tuple[np.ndarray, list[list[int]], float]:
    """Our plan under lhotse's budget (``max_duration``: n * longest); returns (lengths, batches, seconds)."""
    start = time.perf_counter()
    table = LengthTable.from_cuts(cuts, frame_shift=FRAME_SHIFT)
    plan = build_batch_plan(table, BatchConfig(batch_type="length", max_duration=max_duration))
    return table.primary, plan.batches, time.perf_counter() - start


def lhotse_batches(
    cuts: Any, index: dict[str, int], max_duration: float, buckets: int, shuffle: bool, seed: int
) -> tuple[list[list[int]], float]:
    """One epoch of DynamicBucketingSampler, as row indices; returns (batches, seconds)."""
    from lhotse.dataset import DynamicBucketingSampler

    start = time.perf_counter()
    with warnings.catch_warnings():
        # it warns that an eagerly read CutSet gains nothing from streaming; true, irrelevant
        warnings.simplefilter("ignore")
        sampler = DynamicBucketingSampler(
            cuts, max_duration=max_duration, num_buckets=buckets, shuffle=shuffle,
            seed=seed, world_size=1, rank=0,
        )
        batches = [[index[c.id] for c in batch] for batch in sampler]
    return batches, time.perf_counter() - start


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": float(np.median(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
    }


OURS = "ours length max_duration (sorted greedy)"


def run(quick: bool = False) -> dict[str, Any]:
    """Run the comparison and write ``benchmarks/results/batching.{json,png}``.

    Args:
        quick: 2,000 utterances and 3 seeds instead of 20,000 and 5.

    Returns:
        ``{"setup", "rows", "target_met"}``. Each row is one (method, max_duration) with
        median/min/max over seeds of batch count, padding fraction, share of batches
        over budget, and planning seconds. ``target_met[max_duration]`` says whether ours
        has no more padding and no more batches than every lhotse variant (medians).
    """
    count = 2_000 if quick else 20_000
    seeds = [0, 1, 2] if quick else [0, 1, 2, 3, 4]
    max_durations = [100.0, 200.0]
    variants = [(10, False), (10, True), (30, False), (30, True)]
    samples: dict[tuple[str, float], list[dict[str, float]]] = {}
    for seed in seeds:
        cuts = dummy_cuts(utterance_frames(count, seed))
        index = {cut_id: i for i, cut_id in enumerate(cuts.ids)}
        for max_duration in max_durations:
            budget = max_duration / FRAME_SHIFT
            lengths, batches, seconds = ours(cuts, max_duration)
            samples.setdefault((OURS, max_duration), []).append(
                {**measure(lengths, batches, budget), "seconds": seconds}
            )
            for buckets, shuffle in variants:
                batches, seconds = lhotse_batches(cuts, index, max_duration, buckets, shuffle, seed)
                name = f"lhotse DBS buckets={buckets} shuffle={shuffle}"
                samples.setdefault((name, max_duration), []).append(
                    {**measure(lengths, batches, budget), "seconds": seconds}
                )
    rows = [
        {"method": method, "max_duration": max_duration,
         **{key: _spread([r[key] for r in runs]) for key in runs[0]}}
        for (method, max_duration), runs in samples.items()
    ]
    result = {
        "setup": {
            "utterances": count, "seeds": seeds, "frame_shift": FRAME_SHIFT,
            "durations": "lognormal(median 4 s, sigma 0.5) clipped to [0.5, 30] s",
            "budget": "batch size * longest utterance <= max_duration (both methods)",
        },
        "rows": rows,
        "target_met": {str(d): _target_met(rows, d) for d in max_durations},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batching.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    _plot(rows, RESULTS / "batching.png")
    print(format_table(rows))
    print("target met (ours <= lhotse in padding and batches):", result["target_met"])
    return result


def _target_met(rows: list[dict[str, Any]], max_duration: float) -> bool:
    mine = next(r for r in rows if r["method"] == OURS and r["max_duration"] == max_duration)
    others = [r for r in rows if r["method"] != OURS and r["max_duration"] == max_duration]
    return all(
        mine[key]["median"] <= other[key]["median"]
        for other in others
        for key in ("padding_fraction", "num_batches")
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: median [min, max] over seeds."""
    lines = [
        "| max_duration | method | batches | padding fraction | over budget (max) | plan s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: (r["max_duration"], r["method"] != OURS, r["method"])):
        b, p = row["num_batches"], row["padding_fraction"]
        lines.append(
            f"| {row['max_duration']:.0f} s | {row['method']}"
            f" | {b['median']:.0f} [{b['min']:.0f}, {b['max']:.0f}]"
            f" | {p['median']:.4f} [{p['min']:.4f}, {p['max']:.4f}]"
            f" | {row['over_budget']['max']:.3f} | {row['seconds']['median']:.2f} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != OURS, m))
    durations = sorted({r["max_duration"] for r in rows})
    by_key = {(r["method"], r["max_duration"]): r for r in rows}
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(methods)
    positions = np.arange(len(durations))
    for k, method in enumerate(methods):
        for axis, key in zip(axes, ["padding_fraction", "num_batches"]):
            stats = [by_key[(method, d)][key] for d in durations]
            medians = np.array([s["median"] for s in stats])
            spread = np.array([medians - [s["min"] for s in stats],
                               [s["max"] for s in stats] - medians])
            axis.bar(positions + k * width, medians, width, yerr=spread, label=method, capsize=3)
    titles = ["padding fraction (lower is better)", "batches per epoch (lower is better)"]
    for axis, title in zip(axes, titles):
        axis.set_xticks(positions + 0.4 - width / 2, [f"max_duration={d:.0f} s" for d in durations])
        axis.set_title(title)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Compare batch padding with lhotse's sampler.")
    parser.add_argument("--quick", action="store_true", help="2,000 utterances, 3 seeds")
    run(quick=parser.parse_args().quick)
