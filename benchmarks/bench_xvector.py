"""Benchmark: x-vector throughput of length-sorted padded batches vs one utterance at a time.

A full-size ECAPA-TDNN (speechbrain/spkrec-ecapa-voxceleb architecture, 20.8 M parameters,
random weights, built offline by ``espnet3_flows.xvector.random_ecapa``) runs on the CPU with one thread over
N synthetic utterances of 2-6 s at 16 kHz (60; 12 with --quick). "alone" calls
``encoder.encode_batch`` on each utterance by itself; "batched" is ``embed_waveforms`` with
length-sorted batches and exact padding. Each repetition times every method once, in rotating
order, by wall clock and by process CPU time (the fairer measure on a shared machine); the table
gives the median and min-max throughput, the speedup over "alone" by both clocks, and the
minimum cosine similarity between batched and one-by-one embeddings.

Run ``python -m benchmarks --only xvector [--quick]``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

from benchmarks import common

from espnet3_flows.xvector import embed_waveforms, load_speechbrain_encoder, speechbrain_embedder
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

NAME = "xvector"
SR = common.SAMPLE_RATE


def synthetic_waves(count: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` utterances of 2-6 s: a few tones with vibrato plus noise."""
    rng = np.random.default_rng(seed)
    waves = []
    for _ in range(count):
        t = np.arange(int(rng.uniform(2.0, 6.0) * SR)) / SR
        wave = 0.02 * rng.standard_normal(t.size)
        for amp, freq, rate in rng.uniform([0.05, 100, 2], [0.3, 1500, 7], (5, 3)):
            wave += amp * np.sin(2 * np.pi * freq * t + 3 * np.sin(2 * np.pi * rate * t))
        waves.append(wave.astype(np.float32))
    return waves


def one_by_one(encoder: Any, waves: list[np.ndarray]) -> np.ndarray:
    """The baseline: encode_batch on each utterance alone."""
    with torch.inference_mode():
        return np.stack([encoder.encode_batch(torch.from_numpy(w)[None])[0, 0].numpy() for w in waves])


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def run(quick: bool = False) -> dict[str, Any]:
    """Time both methods, write ``xvector.json`` / ``.png`` and return the result."""
    torch.set_num_threads(1)
    count, reps = (12, 2) if quick else (60, 3)
    batch_sizes = (8,) if quick else (1, 8, 16)
    waves = synthetic_waves(count)
    audio_s = sum(w.size for w in waves) / SR

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_ecapa_dir(Path(tmp) / "ecapa", full_size=True)
        encoder = load_speechbrain_encoder(model_dir, savedir=Path(tmp) / "save")
    n_params = sum(p.numel() for p in encoder.mods.embedding_model.parameters())
    embedder = speechbrain_embedder(encoder)

    methods: dict[str, Callable[[], np.ndarray]] = {"alone": lambda: one_by_one(encoder, waves)}
    for b in batch_sizes:
        methods[f"batched (bs {b})"] = lambda b=b: embed_waveforms(embedder, waves, batch_size=b)

    embedder(torch.from_numpy(waves[0][: 2 * SR])[None], torch.ones(1))  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in methods}
    outputs: dict[str, np.ndarray] = {}
    names = list(methods)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs[name] = methods[name]()
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)

    rows = []
    base = float(np.median(seconds["alone"]))
    cpu_base = float(np.median(cpu_seconds["alone"]))
    for name in names:
        s = np.array(seconds[name])
        cpu = float(np.median(cpu_seconds[name]))
        rows.append({
            "method": name,
            "seconds_median": float(np.median(s)),
            "seconds_min": float(s.min()),
            "seconds_max": float(s.max()),
            "utt_per_s_median": count / float(np.median(s)),
            "utt_per_s_min": count / float(s.max()),
            "utt_per_s_max": count / float(s.min()),
            "audio_s_per_s_median": audio_s / float(np.median(s)),
            "speedup_median": base / float(np.median(s)),
            "cpu_seconds_median": cpu,
            "cpu_utt_per_s_median": count / cpu,
            "cpu_speedup_median": cpu_base / cpu,
            "min_cosine_vs_alone": min_cosine(outputs[name], outputs["alone"]),
        })

    batched = [r for r in rows if r["method"] != "alone"]
    worst = min(r["min_cosine_vs_alone"] for r in batched)
    best = max(r["speedup_median"] for r in batched)
    targets = [common.target("batched embeddings equal one-by-one ones (min cosine)", "≥ 0.999", round(worst, 6),
                             worst >= 0.999),
               common.target("length-sorted batches vs per-utterance loop (best batch size, CPU)", "≥ 1.5",
                             round(best, 2), best >= 1.5)]
    notes = [f"ECAPA-TDNN, {n_params / 1e6:.1f} M parameters, CPU, {torch.get_num_threads()} torch thread; {count} "
             f"utterances ({audio_s:.0f} s of audio), {reps} repetitions; throughput by wall clock (median, min–max) "
             "and by process CPU time.",
             "Batching does not pay on one CPU thread: ECAPA's 1x1 convolutions already run near the core's "
             "arithmetic limit per utterance, and batches add memory traffic (attentive pooling builds "
             "[B, 9216, T] tensors). The job therefore uses batch size 1 on CPU and 16 on CUDA (untested here: "
             "no GPU)."]
    return common.write_result(
        NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path),
        model="ECAPA-TDNN channels [1024,1024,1024,1024,3072], lin_neurons 192, random weights", parameters=n_params,
        device="cpu", torch_threads=torch.get_num_threads(), utterances=count, audio_seconds=audio_s, repetitions=reps)


def table(result: dict[str, Any]) -> str:
    """The markdown table of a result."""
    lines = [[r["method"], f"{r['utt_per_s_median']:.2f} [{r['utt_per_s_min']:.2f}–{r['utt_per_s_max']:.2f}]",
              f"{r['audio_s_per_s_median']:.1f}", f"{r['speedup_median']:.2f}×", f"{r['cpu_utt_per_s_median']:.2f}",
              f"{r['cpu_speedup_median']:.2f}×", f"{r['min_cosine_vs_alone']:.6f}"] for r in result["rows"]]
    return common.markdown_table(["method", "utt/s (wall)", "audio s/s", "speedup (wall)", "utt/s (CPU time)",
                                  "speedup (CPU)", "min cosine vs alone"], lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    med = [r["utt_per_s_median"] for r in rows]
    err = [[m - r["utt_per_s_min"] for m, r in zip(med, rows, strict=True)], [r["utt_per_s_max"] - m for m, r in zip(med, rows, strict=True)]]
    ax.bar([r["method"] for r in rows], med, yerr=err, capsize=4, color="tab:green")
    ax.set_ylabel("utterances / s (wall, median, min–max)")
    ax.set_title("x-vector extraction, ECAPA-TDNN on CPU, 1 thread")
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.script_main(NAME)
