"""Benchmark: padding waste and batch count of our budgeted batches vs lhotse's bucketing sampler.

The lhotse side is ``DynamicBucketingSampler``.

Both sides see the same utterances (lognormal durations, median 4 s, sigma 0.5, clipped
to [0.5, 30] s, whole 10 ms frames) and the same budget: lhotse's ``max_duration`` caps
``batch size * longest cut`` in a batch, which is what our ``length`` batches' ``max_duration``
means too. Padding is measured identically for both:
``(padded - real) / padded`` frames with ``padded = sum(batch size * longest)``.

Run ``python -m benchmarks --only batching [--quick]``.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

from espnet3_flows.batching import BatchConfig, LengthTable, build_batch_plan, padding_stats

NAME = "batching"
FRAME_SHIFT = 0.01


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


OURS = "ours length max_duration (sorted greedy)"


def run(quick: bool = False) -> dict[str, Any]:
    """Compare on 20,000 utterances and 5 seeds (2,000 and 3 with ``quick``); write ``batching.json`` /
    ``.png`` and return the result.

    Each row is one (method, max_duration) with median/min/max over seeds of batch count, padding
    fraction, share of batches over budget, and planning seconds. ``target_met[max_duration]``
    says whether ours has no more padding and no more batches than every lhotse variant (medians).
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
         **{key: common.spread([r[key] for r in runs]) for key in runs[0]}}
        for (method, max_duration), runs in samples.items()
    ]
    setup = {"utterances": count, "seeds": seeds, "frame_shift": FRAME_SHIFT,
             "durations": "lognormal(median 4 s, sigma 0.5) clipped to [0.5, 30] s",
             "budget": "batch size * longest utterance <= max_duration (both methods)"}
    target_met, targets = {}, []
    for duration in max_durations:
        mine = next(r for r in rows if r["method"] == OURS and r["max_duration"] == duration)
        others = [r for r in rows if r["method"] != OURS and r["max_duration"] == duration]
        target_met[str(duration)] = all(mine[key]["median"] <= other[key]["median"] for other in others
                                        for key in ("padding_fraction", "num_batches"))
        best_pad = min(r["padding_fraction"]["median"] for r in others)
        best_batches = min(r["num_batches"]["median"] for r in others)
        targets.append(common.target(
            f"max_duration {duration:.0f} s: padding and batches ≤ every lhotse variant", "ours ≤ lhotse (medians)",
            f"padding {mine['padding_fraction']['median']:.4f} vs {best_pad:.4f}; "
            f"batches {mine['num_batches']['median']:.0f} vs {best_batches:.0f}", target_met[str(duration)]))
    notes = [f"{count} utterances, durations {setup['durations']}; budget: {setup['budget']}; seeds {seeds}; cells "
             "are median [min, max] over seeds."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path), setup=setup,
                               target_met=target_met)


def table(result: dict[str, Any]) -> str:
    """A markdown table: median [min, max] over seeds."""
    rows = result["rows"]
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
    plt = common.pyplot()
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != OURS, m))
    durations = sorted({r["max_duration"] for r in rows})
    by_key = {(r["method"], r["max_duration"]): r for r in rows}
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(methods)
    positions = np.arange(len(durations))
    for k, method in enumerate(methods):
        for axis, key in zip(axes, ["padding_fraction", "num_batches"], strict=True):
            stats = [by_key[(method, d)][key] for d in durations]
            medians = np.array([s["median"] for s in stats])
            spread = np.array([medians - [s["min"] for s in stats],
                               [s["max"] for s in stats] - medians])
            axis.bar(positions + k * width, medians, width, yerr=spread, label=method, capsize=3)
    titles = ["padding fraction (lower is better)", "batches per epoch (lower is better)"]
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xticks(positions + 0.4 - width / 2, [f"max_duration={d:.0f} s" for d in durations])
        axis.set_title(title)
    axes[0].legend(fontsize=8)
    common.save_figure(figure, path, dpi=120)


if __name__ == "__main__":
    common.script_main(NAME)
