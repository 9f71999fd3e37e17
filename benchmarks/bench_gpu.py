"""Benchmark: every GPU path of the product, measured in one call (issue "GPU, measured whenever a
device is lent").

Parts (``--only``), each timed through the product's own code on ``--device``:

- ``hubert``: collect-stats features of a HuBERT-base-sized model (``torchaudio.models.hubert_base``
  built from its config, random weights: ``espnet3_flows.frontends.ssl.SSLFeatures``) through
  ``frontend.type: model``: one utterance at a time vs padded batches (``max_batch_samples``),
  float32 vs ``bf16`` / ``fp16`` autocast; audio-seconds per second, the model's achieved TFLOP/s
  (its FLOPs per audio second, counted on the CPU by ``torch.utils.flop_counter``, times that), the
  padding of the batches, the share of the product path's time the model alone does not take
  (host work: staging, copies, cutting), peak GPU memory, and the error of each against float32
  one at a time (max |Δ| / max |ref| and relative RMS); and extract-features' own path: calls of
  16 (the job's default ``batch_size``) and 256 utterances, features written into a Kaldi ark; and
  ``frontend.bucket_shapes`` (batches padded to a few fixed shapes, cuDNN's attention on) beside the
  same batches as they are, each on a second pass, with their padding and distinct shapes.
- ``fbank``: 80-dim lhotse fbank through ``frontend.device`` (frames of a call's utterances
  gathered into one matrix: ``FastFbank.batch``) vs the CPU path on one core; the collect-stats
  sums (float64) of both.
- ``ecapa``: a full-size ECAPA-TDNN (speechbrain's spkrec-ecapa-voxceleb layout, random weights)
  through ``embed_waveforms`` with exact padding at batch 1 / 32 / 128; utt/s and the worst cosine
  of a batched embedding against the same utterance alone.
- ``rawnet3``: the recipe's RawNet3 (full size, random weights) likewise at batch 1 / 16 / 64.
- ``datapath``: what feeds a GPU: ``load_many`` decoding FLAC files (16 kHz, as LibriSpeech's) on
  1, 2, 4, ... threads of one process (``decode_threads``), as decoded audio-seconds per second and
  per core used; on the CPU wherever it runs.
- ``local_gpu``: collect-stats of a generated corpus by the engine (``runner.run``) on
  ``parallel.env: local_gpu`` (dask-cuda, one worker per GPU) with ``frontend.device: cuda``, against
  the same run on the CPU in this process; the stats must agree.

``--device cpu --quick`` runs every part at toy sizes: CI runs it (``tests/benchmarks``) so that
every step the device takes has run on the CPU first. On the device machine run it through
``benchmarks/gpu_check.sh`` (installs the carried wheels, runs the ``gpu`` tests, then this).

Run ``python -m benchmarks.bench_gpu --device cuda [--quick] [--only hubert fbank ...]``; results go to
``$ESPNET3_BENCH_RESULTS/gpu.json`` (one row per measurement) and ``gpu/<part>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks import common
from benchmarks.gpu_measure import (
    bucket_shape_rows, feature_error, flops_per_audio_second, min_cosine, moments_error, padding_fraction,
    peak_memory_mb, profile_table, reset_peak, timed, written_rows,
)
from benchmarks.gpu_report import table, targets

NAME = "gpu"
SR = common.SAMPLE_RATE
PARTS = ("hubert", "fbank", "ecapa", "rawnet3", "local_gpu", "datapath")


# ---- helpers -----------------------------------------------------------------------------
def waves(count: int, low: float, high: float, seed: int) -> list[np.ndarray]:
    """``count`` noise-like utterances of ``low``-``high`` s (speech-level amplitude)."""
    rng = np.random.default_rng(seed)
    return [(0.05 * rng.standard_normal(int(SR * rng.uniform(low, high)), dtype=np.float32)) for _ in range(count)]


def seconds(ws: Sequence[np.ndarray]) -> float:
    return float(sum(len(w) for w in ws)) / SR


# ---- parts -------------------------------------------------------------------------------
def part_hubert(device: str, quick: bool) -> dict[str, Any]:
    from espnet3_flows.frontends.frontend import model_frontend
    from espnet3_flows.frontends.precision import precision_scope
    from espnet3_flows.frontends.ssl import SSLFeatures

    torch.manual_seed(0)
    model = SSLFeatures("hubert_base")
    flops = flops_per_audio_second(model)  # (per audio second: x real time makes it FLOP/s)
    # (quick: bf16 on a CPU without bf16 matrix units runs at ~0.1x real time)
    data = waves(2 if quick else 384, 0.5 if quick else 2, 1 if quick else 16, seed=1)
    subset = data if quick else data[:48]
    batch_sizes = [64_000] if quick else [4_000_000, 16_000_000]
    precisions = ["float32", "tf32", "bf16", "fp16"] if device.startswith("cuda") else ["float32", "bf16"]
    rows: list[dict[str, Any]] = []
    lengths = [len(w) for w in data]
    alone = model_frontend(model, device)
    alone(subset[:1], {})  # warm-up: kernels, cuDNN plans
    elapsed, ref = timed(device, lambda: alone(subset, {}))
    rows.append({"part": "hubert", "mode": "one at a time", "precision": "float32", "max_batch_samples": 0,
                 "utts": len(subset), "audio_s": seconds(subset), "wall_s": elapsed,
                 "x_realtime": seconds(subset) / elapsed, "peak_mb": peak_memory_mb(device), "max_rel": 0.0,
                 "rel_rms": 0.0})
    for precision in precisions:
        for mbs in batch_sizes:
            frontend = model_frontend(model, device, mbs, precision)
            frontend(data[:2], {})  # warm-up at this precision
            reset_peak(device)
            elapsed, _ = timed(device, lambda frontend=frontend: frontend(data, {}))
            peak = peak_memory_mb(device)
            err = feature_error(frontend(subset, {}), ref)
            rows.append({"part": "hubert", "mode": "batched", "precision": precision, "max_batch_samples": mbs,
                         "utts": len(data), "audio_s": seconds(data), "wall_s": elapsed,
                         "x_realtime": seconds(data) / elapsed, "peak_mb": peak, **err,
                         "padding": padding_fraction(frontend.batches(lengths), lengths)})
    rows += written_rows(model, device, data, batch_sizes[0], seconds(data))
    rows += bucket_shape_rows(model, device, data, subset, ref, batch_sizes[0], seconds(data))
    for precision in ("float32", "bf16"):  # collect-stats: only the moments come back
        frontend = model_frontend(model, device, batch_sizes[-1], precision)
        frontend.moments(data[:2], {})
        elapsed, _ = timed(device, lambda frontend=frontend: frontend.moments(data, {}))
        rows.append({"part": "hubert", "mode": "collect-stats moments", "precision": precision,
                     "max_batch_samples": batch_sizes[-1], "utts": len(data), "audio_s": seconds(data),
                     "wall_s": elapsed, "x_realtime": seconds(data) / elapsed, "peak_mb": None,
                     **moments_error(frontend.moments(subset, {}).moments, ref),
                     "padding": padding_fraction(frontend.batches(lengths), lengths)})
    # the model alone on padded batches already on the device: what the frontend's host work costs
    frontend = model_frontend(model, device, batch_sizes[-1])
    groups = frontend.batches([len(w) for w in data])
    batches = []
    for group in groups:
        lengths = torch.tensor([len(data[i]) for i in group])
        speech = torch.zeros(len(group), int(lengths.max()))
        for row, i in enumerate(group):
            speech[row, : len(data[i])] = torch.from_numpy(data[i])
        batches.append((speech.to(device), lengths.to(device)))

    def model_only(precision: str) -> None:
        with torch.inference_mode(), precision_scope(device, precision):
            for speech, lengths in batches:
                model.collect_feats(speech, lengths)

    for precision in precisions:
        model_only(precision)
        elapsed, _ = timed(device, lambda precision=precision: model_only(precision))
        rows.append({"part": "hubert", "mode": "model only (batches on the device)", "precision": precision,
                     "max_batch_samples": batch_sizes[-1], "utts": len(data), "audio_s": seconds(data),
                     "wall_s": elapsed, "x_realtime": seconds(data) / elapsed, "peak_mb": None, "max_rel": None,
                     "rel_rms": None})
    low = precisions[-2]  # bf16
    profile = profile_table(device, lambda: model_only(low))
    print(f"[gpu] hubert: busiest operators, {low}, model only:\n{profile}", flush=True)
    batches.clear()  # (their device memory)
    for row in rows:
        row["tflops"] = flops * row["x_realtime"] / 1e12
    return {"rows": rows, "model_parameters": sum(p.numel() for p in model.parameters()), "profile": profile,
            "gflop_per_audio_s": flops / 1e9}


def part_fbank(device: str, quick: bool) -> dict[str, Any]:
    from espnet3_flows.frontends.fbank import DEFAULT_BATCH_SAMPLES
    from espnet3_flows.frontends.frontend import FbankFrontend, FrontendConfig

    data = waves(16 if quick else 2000, 1 if quick else 2, 3 if quick else 16, seed=2)
    subset = data if quick else data[:100]
    cpu = FbankFrontend(FrontendConfig())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU row is per core
    try:
        cpu_s, cpu_feats = timed("cpu", lambda: cpu(subset, {}))
    finally:
        torch.set_num_threads(threads)
    ours = FbankFrontend(FrontendConfig(device=device))
    # on the CPU the product computes one utterance at a time; the gathered path is forced here so
    # that the rehearsal runs every step the GPU takes
    def run(ws: list) -> Any:
        return ours.fbank.batch(ws, device, DEFAULT_BATCH_SAMPLES, gather=True)

    run(data[:2])  # warm-up
    reset_peak(device)
    elapsed, _ = timed(device, lambda: run(data))
    peak = peak_memory_mb(device)
    dev = torch.device(device)

    def no_copy_back() -> None:  # the features stay on the device (what collect-stats could sum there)
        for _ in ours.fbank._gathered(data, dev, DEFAULT_BATCH_SAMPLES, lambda *done: done):
            if dev.type == "cuda":  # (what a caller does per batch: wait for it)
                torch.cuda.synchronize(dev)

    no_copy_back()
    kernel_s, _ = timed(device, no_copy_back)
    ours.fbank.moments(data[:2], device)
    moments_s, _ = timed(device, lambda: ours.fbank.moments(data, device))  # collect-stats' product path
    moments_err = moments_error(ours.fbank.moments(subset, device).moments, cpu_feats)
    sub = run(subset)
    feats_err = max(float(np.abs(a - b).max()) for a, b in zip(sub, cpu_feats, strict=True))

    def sums(fs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        cat = np.concatenate(fs).astype(np.float64)
        return cat.sum(0), (cat ** 2).sum(0)

    (s_gpu, q_gpu), (s_cpu, q_cpu) = sums(sub), sums(cpu_feats)
    stats_rel = float(max(np.abs(s_gpu - s_cpu).max() / np.abs(s_cpu).max(),
                          np.abs(q_gpu - q_cpu).max() / np.abs(q_cpu).max()))
    rows = [{"part": "fbank", "mode": "CPU, one core, one at a time", "utts": len(subset), "audio_s": seconds(subset),
             "wall_s": cpu_s, "x_realtime": seconds(subset) / cpu_s},
            {"part": "fbank", "mode": f"{device}, gathered batches", "utts": len(data), "audio_s": seconds(data),
             "wall_s": elapsed, "x_realtime": seconds(data) / elapsed, "peak_mb": peak,
             "max_abs_feature_diff": feats_err, "stats_rel_diff": stats_rel},
            {"part": "fbank", "mode": f"{device}, collect-stats moments", "utts": len(data), "audio_s": seconds(data),
             "wall_s": moments_s, "x_realtime": seconds(data) / moments_s, **moments_err},
            {"part": "fbank", "mode": f"{device}, features left on the device", "utts": len(data),
             "audio_s": seconds(data), "wall_s": kernel_s, "x_realtime": seconds(data) / kernel_s}]
    return {"rows": rows}


def _embed_rows(part: str, device: str, embed: Any, data: list[np.ndarray], subset: list[np.ndarray],
                runs: Sequence[tuple[int, str]]) -> list[dict[str, Any]]:
    """Batch 1 in float32 on ``subset`` (the reference), then each ``(batch, precision)`` of ``runs``
    on ``data``, with the worst cosine of its embeddings of ``subset`` against the reference."""
    from espnet3_flows.xvector import embed_waveforms
    from espnet3_flows.xvector.job import with_precision

    exact = with_precision(embed, device, "float32")
    embed_waveforms(exact, data[:2], 2)  # warm-up
    elapsed, alone = timed(device, lambda: embed_waveforms(exact, subset, 1))
    rows = [{"part": part, "batch": 1, "precision": "float32", "utts": len(subset), "audio_s": seconds(subset),
             "wall_s": elapsed, "utt_per_s": len(subset) / elapsed, "min_cosine_vs_alone": 1.0, "peak_mb": None}]
    for b, precision in runs:
        model = with_precision(embed, device, precision)
        embed_waveforms(model, data[:b], b)  # warm-up
        reset_peak(device)
        elapsed, _ = timed(device, lambda model=model, b=b: embed_waveforms(model, data, b))
        peak = peak_memory_mb(device)
        batched = embed_waveforms(model, subset, b)
        rows.append({"part": part, "batch": b, "precision": precision, "utts": len(data), "audio_s": seconds(data),
                     "wall_s": elapsed, "utt_per_s": len(data) / elapsed,
                     "min_cosine_vs_alone": min_cosine(batched, alone), "peak_mb": peak})
    return rows


def part_ecapa(device: str, quick: bool) -> dict[str, Any]:
    from espnet3_flows.xvector import load_speechbrain_encoder, speechbrain_embedder
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_ecapa_dir(Path(tmp) / "ecapa", full_size=not quick)
        encoder = load_speechbrain_encoder(model_dir, Path(tmp) / "save", device=device)
        embed = speechbrain_embedder(encoder, exact_padding=True)
        data = waves(8 if quick else 1024, 1 if quick else 3, 2 if quick else 8, seed=3)
        subset = data if quick else data[:64]
        runs = [(4, "float32"), (4, "bf16")] if quick else [
            (32, "float32"), (128, "float32"), (128, "tf32"), (128, "bf16"), (128, "fp16"), (256, "fp16")]
        rows = _embed_rows("ecapa", device, embed, data, subset, runs)
        from espnet3_flows.xvector import embed_waveforms
        from espnet3_flows.xvector.job import with_precision

        b, precision = runs[-1]
        model = with_precision(embed, device, precision)
        profile = profile_table(device, lambda: embed_waveforms(model, data[: 2 * b], b))
        print(f"[gpu] ecapa: busiest operators, batch {b}, {precision}:\n{profile}", flush=True)
        return {"rows": rows, "profile": profile}


def part_rawnet3(device: str, quick: bool) -> dict[str, Any]:
    from espnet3_flows.xvector.random_spk import build_random_rawnet3
    from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3, rawnet_embedder

    with tempfile.TemporaryDirectory() as tmp:
        weights = build_random_rawnet3(Path(tmp) / "model.pt", full_size=not quick)
        embed = rawnet_embedder(load_recipe_rawnet3(weights, device))
        data = waves(4 if quick else 512, 1 if quick else 3, 2 if quick else 8, seed=4)
        subset = data if quick else data[:32]
        runs = [(4, "float32"), (4, "fp16")] if quick else [(16, "float32"), (16, "tf32"), (16, "bf16"), (32, "fp16")]
        return {"rows": _embed_rows("rawnet3", device, embed, data, subset, runs)}


def part_local_gpu(device: str, quick: bool) -> dict[str, Any]:
    from espnet3_flows.inputs.demo import make_demo_corpus
    from espnet3_flows.parallel.parallel_config import ParallelConfig
    from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner
    from espnet3_flows.frontends.frontend import FrontendConfig

    gpu = device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_demo_corpus(Path(tmp) / "corpus", n_utts=40 if quick else 400, splits={"train": 1.0})["train"]
        rows, stats = [], {}
        for label, env, dev in (("CPU, serial", "serial", "cpu"),
                                (f"{'local_gpu' if gpu else 'local'}, frontend on {device}",
                                 "local_gpu" if gpu else "local", device)):
            out = Path(tmp) / env
            parallel = ParallelConfig(env=env, **({} if env in ("serial", "local_gpu") else {"n_workers": 1}))
            cfg = CollectStatsConfig(manifests={"train": str(manifest)}, output_dir=str(out), shard_size=16,
                                     frontend=FrontendConfig(device=dev), parallel=parallel)
            t0 = time.perf_counter()
            outcome = CollectStatsRunner(cfg, "train").run(parallel=cfg.parallel, progress=False)
            wall = time.perf_counter() - t0
            with np.load(out / "train" / "feats_stats.npz") as z:
                stats[env] = {k: z[k].astype(np.float64) for k in z.files}
            rows.append({"part": "local_gpu", "mode": label, "shards": len(outcome.shards),
                         "computed": outcome.computed, "wall_s": wall})
        (cpu_stats, dev_stats) = stats.values()
        rel = max(float(np.abs(dev_stats[k] - cpu_stats[k]).max() / max(np.abs(cpu_stats[k]).max(), 1e-30))
                  for k in cpu_stats if cpu_stats[k].size)
        rows[-1]["stats_rel_diff"] = rel
        return {"rows": rows}


def part_datapath(device: str, quick: bool) -> dict[str, Any]:
    import os

    import soundfile as sf

    from espnet3_flows.inputs.audio import AudioConfig, load_many
    from espnet3_flows.inputs.records import Utterance

    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        utts = []
        for i, wave in enumerate(waves(16 if quick else 400, 1 if quick else 2, 2 if quick else 16, seed=5)):
            path = Path(tmp) / f"{i}.flac"
            sf.write(path, wave, SR, subtype="PCM_16")
            utts.append(Utterance(f"u{i}", str(path), line=i + 1))
        load_many(utts, AudioConfig())  # into the page cache: decoding is measured, not the disk
        audio_s = None
        for threads in [t for t in (1, 2, 4, 8, 16) if t <= max(2, cores)]:
            elapsed, loaded = timed("cpu", lambda threads=threads: load_many(utts, AudioConfig(decode_threads=threads)))
            audio_s = sum(len(w) for w, _ in loaded) / SR
            rows.append({"part": "datapath", "threads": threads, "cores": cores, "utts": len(utts),
                         "audio_s": audio_s, "wall_s": elapsed, "audio_s_per_s": audio_s / elapsed,
                         "per_core": audio_s / elapsed / min(threads, cores)})
    return {"rows": rows}


PART_FUNCTIONS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "hubert": part_hubert, "fbank": part_fbank, "ecapa": part_ecapa, "rawnet3": part_rawnet3,
    "local_gpu": part_local_gpu, "datapath": part_datapath}


# ---- result ------------------------------------------------------------------------------
def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name} ({props.total_memory / 1024 ** 3:.0f} GiB), torch {torch.__version__}"
    return f"CPU ({common.machine()['cpu']}), torch {torch.__version__}"


def run(quick: bool = False, device: str | None = None, parts: Sequence[str] = PARTS) -> dict[str, Any]:
    """Run ``parts`` on ``device`` (a CUDA GPU when one is visible, else the CPU); a part that fails
    is recorded with its error and the others still run."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for part in parts:
        print(f"[gpu] {part} on {device}{' (quick)' if quick else ''} ...", flush=True)
        t0 = time.perf_counter()
        try:
            out = PART_FUNCTIONS[part](device, quick)
        except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others' numbers
            failures[part] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            out = {"rows": [], "error": failures[part]}
        print(f"[gpu] {part}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows += out["rows"]
        (common.RESULTS / "gpu").mkdir(parents=True, exist_ok=True)
        (common.RESULTS / "gpu" / f"{part}.json").write_text(
            json.dumps({"part": part, "device": device_name(device), **out}, indent=2, default=common._json_default))
    notes = [f"Device: {device_name(device)}."]
    notes += [f"{part} FAILED: {why}" for part, why in failures.items()]
    return common.write_result(NAME, quick, rows, targets(rows, device), notes, device=device_name(device),
                               failures=failures, command=f"benchmarks/gpu_check.sh{' --quick' if quick else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when visible)")
    parser.add_argument("--quick", action="store_true", help="toy sizes (the CPU rehearsal CI runs)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART",
                        help=f"parts to run ({', '.join(PARTS)}; default: all)")
    parser.add_argument("--table", type=Path, metavar="GPU_JSON", help="only print the tables of a gpu.json")
    args = parser.parse_args(argv)
    if args.table:  # (the README's section adds the targets itself: benchmarks.run.section)
        result = json.loads(args.table.read_text())
        print(table(result) + "\n\n" + common.targets_table(result.get("targets") or []))
        return 0
    result = run(args.quick, args.device, args.only)
    print(table(result) + "\n\n" + common.targets_table(result["targets"]), flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
