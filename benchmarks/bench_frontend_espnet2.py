"""Benchmark: ESPnet2's ``default`` frontend alone, ESPnet2's class vs the exact fast path, per core.

Issue "Faster than ESPnet2's own stage 10, with ESPnet2's own frontend": the features of
``DefaultFrontend`` computed by ESPnet2's class and by
:class:`~espnet3_flows.frontends.espnet2_default.FastDefaultFrontend`, on the first N utterances
of the cached benchmark corpus (2–6 s at 16 kHz; N = 1,000, 60 with ``--quick``,
``ESPNET3_BENCH_FRONTEND_UTTS`` sets another), decoded into memory first, one torch thread, one
utterance per call, in one process:

- **ESPnet2's class, as the flow runs it**: ``frontend.espnet2_class=true``'s frontend
  (:func:`~espnet3_flows.frontends.frontend.espnet2_frontend`: a batch of one, ``frontend(speech,
  lengths)``, the valid frames);
- **ESPnet2's class, bare**: ``DefaultFrontend()(speech[None], lengths)`` and nothing else;
- **fast path**: the default of ``frontend.type=espnet2`` with ``name: default``.

Each is timed over the whole set in process CPU seconds (what one core spent: steadier than wall
time on a shared machine; wall is recorded too), ``ESPNET3_BENCH_FRONTEND_REPEATS`` (default 3)
times, interleaved in rotating order, for ESPnet2's default configuration and for the
LibriSpeech recipes' (``n_fft 512, win_length 400, hop_length 160``). The features of every
utterance are compared with the class's (max abs. and rel. error), and their statistics (count,
float64 sum and sum of squares). Targets: ≥ 2× ESPnet2's class per core, errors at float32
rounding.

Run ``python -m benchmarks --only frontend_espnet2 [--quick]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from collections.abc import Callable

from benchmarks import common

NAME = "frontend_espnet2"
CONFS = {"ESPnet2's default (n_fft 512, hop 128, 80 mels)": {"n_fft": 512, "hop_length": 128, "n_mels": 80,
                                                              "fs": "16k"},
         "LibriSpeech recipes' (n_fft 512, win 400, hop 160, 80 mels)": {"n_fft": 512, "win_length": 400,
                                                                          "hop_length": 160, "n_mels": 80,
                                                                          "fs": "16k"}}
#: float32 rounding of log-mel values of magnitude ~1-25 (tests/frontends/test_espnet2_default.py)
MAX_ABS_ERROR = 5e-6


def _waves(n: int) -> list[Any]:
    import soundfile as sf

    return [sf.read(p, dtype="float32")[0] for p in common.manifest_paths(common.corpus_manifest(n))[:n]]


def _implementations(conf: dict[str, Any]) -> dict[str, Callable[[Any], Any]]:
    import torch
    from espnet2.asr.frontend.default import DefaultFrontend

    from espnet3_flows.frontends.espnet2_default import FastDefaultFrontend, read_default_conf
    from espnet3_flows.frontends.frontend import espnet2_frontend

    as_flow_runs_it = espnet2_frontend(DefaultFrontend(**conf))
    bare = DefaultFrontend(**conf).eval()
    fast = FastDefaultFrontend(read_default_conf(conf)[0])

    def bare_call(wave: Any) -> Any:
        with torch.inference_mode():
            feats, _ = bare(torch.from_numpy(wave)[None], torch.tensor([len(wave)]))
        return feats[0].numpy()

    return {"ESPnet2's class, as the flow runs it": lambda w: as_flow_runs_it([w], {})[0],
            "ESPnet2's class, bare": bare_call,
            "fast path (FastDefaultFrontend)": fast}


def _errors(waves: list[Any], reference: Callable[[Any], Any], fast: Callable[[Any], Any]) -> dict[str, float]:
    """Max abs. and rel. error of the features, rel. errors of the float64 statistics."""
    import numpy as np

    worst_abs = worst_rel = 0.0
    count = [0, 0]
    sums = [np.zeros(1), np.zeros(1)]
    squares = [np.zeros(1), np.zeros(1)]
    for wave in waves:
        ref, got = reference(wave), fast(wave)
        if ref.shape != got.shape:
            return {"max_abs": float("inf"), "max_rel": float("inf"), "sum_rel": float("inf"),
                    "sum_square_rel": float("inf"), "count_equal": False}
        diff = np.abs(got.astype(np.float64) - ref)
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / np.maximum(np.abs(ref), 1e-3)).max()))
        for k, f in enumerate((ref.astype(np.float64), got.astype(np.float64))):
            count[k] += len(f)
            sums[k] = sums[k] + f.sum(0)
            squares[k] = squares[k] + (f ** 2).sum(0)
    return {"max_abs": worst_abs, "max_rel": worst_rel, "count_equal": count[0] == count[1],
            "sum_rel": float(np.max(np.abs(sums[1] - sums[0]) / np.abs(sums[0]))),
            "sum_square_rel": float(np.max(np.abs(squares[1] - squares[0]) / np.abs(squares[0])))}


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``frontend_espnet2.json`` and return the result."""
    import torch

    n = int(os.environ.get("ESPNET3_BENCH_FRONTEND_UTTS") or (60 if quick else 1000))
    repeats = 1 if quick else int(os.environ.get("ESPNET3_BENCH_FRONTEND_REPEATS") or 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        waves = _waves(n)
        seconds = sum(len(w) for w in waves) / common.SAMPLE_RATE
        rows, targets = [], []
        for conf_name, conf in CONFS.items():
            impls = _implementations(conf)
            names = list(impls)
            cpu: dict[str, list[float]] = {k: [] for k in names}
            wall: dict[str, list[float]] = {k: [] for k in names}
            for name in names:  # warm up (first-call allocations, FFT plans)
                impls[name](waves[0])
            for rep in range(repeats):  # interleaved, in rotating order
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    extract = impls[name]
                    with common.Stopwatch() as sw:
                        for wave in waves:
                            extract(wave)
                    cpu[name].append(n / sw.cpu)
                    wall[name].append(n / sw.wall)
            errors = _errors(waves, impls[names[1]], impls[names[2]])
            base = common.spread(cpu[names[1]])["median"]
            for name in names:
                rate = common.spread(cpu[name])
                rows.append({"config": conf_name, "implementation": name, "utt_per_core_s": rate,
                             "wall_utt_per_s": common.spread(wall[name]),
                             "real_time_factor_per_core": rate["median"] * seconds / n,
                             "speedup_vs_class": rate["median"] / base,
                             **({"errors_vs_class": errors} if name == names[2] else {})})
            speedup = common.spread(cpu[names[2]])["median"] / base
            targets += [common.target(f"{conf_name}: fast path vs ESPnet2's class, per core", "≥ 2×",
                                      f"{speedup:.2f}×", speedup >= 2),
                        common.target(f"{conf_name}: same features (max abs. error of the log-mel values; "
                                      "float64 statistics)", f"≤ {MAX_ABS_ERROR:g}, count equal",
                                      f"{errors['max_abs']:.1e} (rel. {errors['max_rel']:.1e}); sums rel. "
                                      f"{errors['sum_rel']:.1e}, squares {errors['sum_square_rel']:.1e}",
                                      errors["max_abs"] <= MAX_ABS_ERROR and errors["count_equal"])]
    finally:
        torch.set_num_threads(threads)
    notes = [f"{n} utterances of the benchmark corpus ({seconds:.0f} s of 16 kHz audio), decoded into memory; one "
             f"torch thread, one utterance per call, one process; {repeats} repetitions interleaved in rotating "
             "order (cells: median [min–max] of utterances per CPU second, i.e. per core).",
             "'as the flow runs it' is what frontend.espnet2_class=true computes in a worker (a padded batch of one, "
             "its valid frames); 'bare' is the class's forward alone. The fast path's errors are against the bare "
             "class on every utterance of the set."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    common.bar_chart(path, [f"{r['implementation']}\n{r['config'].split(' (')[0]}" for r in rows],
                     [r["utt_per_core_s"]["median"] for r in rows], "utterances per CPU second (higher is better)",
                     "ESPnet2's DefaultFrontend, one core")


def table(result: dict[str, Any]) -> str:
    """Markdown table of the rows."""
    return common.markdown_table(
        ["config", "implementation", "utt/s per core", "× real time per core", "wall utt/s", "vs ESPnet2's class"],
        [[r["config"], r["implementation"], common.fmt(r["utt_per_core_s"], 0),
          f"{r['real_time_factor_per_core']:.0f}", common.fmt(r["wall_utt_per_s"], 0),
          f"{r['speedup_vs_class']:.2f}×"] for r in result["rows"]], align="llrrrr")


if __name__ == "__main__":
    common.script_main(NAME)
