"""Benchmark: ESPnet-SPK and RawNet3 speaker embeddings, ours beside ESPnet's extractor logic, same model and data.

N synthetic utterances of 2-6 s at 16 kHz (16; 8 with ``--quick``), one torch thread, models with
random weights built offline (full size: ESPnet's VoxCeleb RawNet3 config, 192-d, and the recipe's
RawNet3, 256-d; ``--quick`` uses small ones). Rows, per toolkit:

- ``espnet``: **ESPnet sequential** (``extract_spk_embed.py``: ``Speech2Embedding`` on each
  utterance); **ESPnet parallel** (``extract_spk_embed_parallel.py``'s ``extract_batch``: the
  utterances in arrival order, zero-padded to the longest, through ``spk_model`` with no lengths);
  **ours** (``toolkit: espnet``: length-sorted batches, features per utterance, encoder batched
  with length hooks) at several batch sizes.
- ``rawnet``: **recipe** (``_rawnet_extract_embd`` per utterance: ten 3-s windows) and **ours**
  (``toolkit: rawnet``: the windows of a batch of utterances in one call), on the first 6.

Each repetition times every method once, in rotating order, by wall clock and process CPU time;
every row also gives its worst cosine and max abs difference against the sequential reference.
GPU throughput is measured by the same code with ``--device cuda`` where a GPU is present.

Run ``python -m benchmarks --only spk_embed [--quick]`` (or this file with ``--device``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from benchmarks import common

NAME = "spk_embed"
RAWNET_UTTS = 6  # the recipe runs ten 3-s windows per utterance: the full-size RawNet3 is slow on a CPU


def _waves(count: int, seed: int = 0) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    waves = []
    for _ in range(count):
        t = np.arange(int(rng.uniform(2.0, 6.0) * common.SAMPLE_RATE)) / common.SAMPLE_RATE
        wave = 0.02 * rng.standard_normal(t.size)
        for amp, freq, rate in rng.uniform([0.05, 100, 2], [0.3, 1500, 7], (5, 3)):
            wave += amp * np.sin(2 * np.pi * freq * t + 3 * np.sin(2 * np.pi * rate * t))
        waves.append(wave.astype(np.float32))
    return waves


def _compare(out: Any, ref: Any) -> tuple[float, float]:
    import numpy as np

    cos = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
    return float(np.abs(out - ref).max()), float(cos.min())


def _methods(waves: list[Any], tmp: Path, quick: bool, device: str) -> tuple[dict[str, dict[str, Callable]], dict]:
    """Per toolkit: method name -> callable returning [N, D] embeddings; and model descriptions."""
    import numpy as np
    import torch

    from espnet3_flows.xvector.espnet_spk import espnet_embedder, import_speaker_task, load_espnet_spk_model

    import_speaker_task()  # first: ESPnet's own import would try to download NLTK data
    from espnet2.bin.spk_inference import Speech2Embedding
    from espnet3_flows.xvector.model import embed_waveforms
    from espnet3_flows.xvector.random_spk import build_random_espnet_spk, build_random_rawnet3
    from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3, rawnet_embedder, recipe_windows

    pth = build_random_espnet_spk(tmp / "espnet", "rawnet3", full_size=not quick)
    s2e = Speech2Embedding(model_file=str(pth), device=device)
    ours = espnet_embedder(load_espnet_spk_model(str(pth), device))
    sizes = (8,) if quick else (1, 8, 16)

    def sequential() -> Any:
        return np.stack([s2e(torch.from_numpy(w).to(device)).cpu().numpy().reshape(-1) for w in waves])

    def parallel_script(batch: int = 8) -> Any:  # extract_batch of extract_spk_embed_parallel.py
        out = []
        for i in range(0, len(waves), batch):
            chunk = waves[i: i + batch]
            padded = np.zeros((len(chunk), max(len(w) for w in chunk)), dtype=np.float32)
            for row, w in enumerate(chunk):
                padded[row, : len(w)] = w
            with torch.inference_mode():
                emb = s2e.spk_model(speech=torch.from_numpy(padded).to(device), spk_labels=None, task_tokens=None,
                                    extract_embd=True)
            out.append(emb.cpu().numpy())
        return np.concatenate(out)

    espnet = {"ESPnet sequential (Speech2Embedding)": sequential,
              "ESPnet parallel script (padded, bs 8)": parallel_script}
    for b in sizes:
        espnet[f"ours toolkit=espnet (bs {b})"] = lambda b=b: embed_waveforms(ours, waves, b)

    weights = build_random_rawnet3(tmp / "rawnet.pt", full_size=not quick)
    rawnet = load_recipe_rawnet3(weights, device)

    raw_waves = waves[:RAWNET_UTTS]

    def recipe() -> Any:
        out = []
        for w in raw_waves:
            with torch.no_grad():
                out.append(rawnet(torch.from_numpy(recipe_windows(w)).to(device)).mean(0).cpu().numpy())
        return np.stack(out)

    raw = {"recipe rawnet (per utterance)": recipe}  # on the first RAWNET_UTTS utterances (30 s of windows each)
    for b in sizes[-1:]:
        raw[f"ours toolkit=rawnet (bs {b})"] = lambda b=b: embed_waveforms(rawnet_embedder(rawnet), raw_waves, b)
    params = {"espnet": sum(p.numel() for p in s2e.spk_model.parameters() if p.requires_grad),
              "rawnet": sum(p.numel() for p in rawnet.parameters())}
    return {"espnet": espnet, "rawnet": raw}, params


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Time every method, write ``results/spk_embed.json`` and return the result."""
    import torch

    torch.set_num_threads(1)
    count, reps = (8, 1) if quick else (16, 2)
    waves = _waves(count)
    audio_s = sum(len(w) for w in waves) / common.SAMPLE_RATE
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        toolkits, params = _methods(waves, Path(tmp), quick, device)
        for toolkit, methods in toolkits.items():
            names = list(methods)
            methods[names[0]]()  # warm-up
            wall: dict[str, list[float]] = {n: [] for n in names}
            cpu: dict[str, list[float]] = {n: [] for n in names}
            outputs: dict[str, Any] = {}
            for rep in range(reps):
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    with common.Stopwatch() as sw:
                        outputs[name] = methods[name]()
                        if device.startswith("cuda"):
                            torch.cuda.synchronize()
                    wall[name].append(sw.wall)
                    cpu[name].append(sw.cpu)
            base = common.spread(wall[names[0]])["median"]
            for name in names:
                max_abs, cosine = _compare(outputs[name], outputs[names[0]])
                w = common.spread(wall[name])
                n = len(outputs[name])
                rows.append({"toolkit": toolkit, "method": name, "utterances": n, "wall": w,
                             "utt_per_s": n / w["median"], "cpu_utt_per_s": n / common.spread(cpu[name])["median"],
                             "speedup": base / w["median"], "max_abs_vs_sequential": max_abs,
                             "min_cosine_vs_sequential": cosine})
    ours = [r for r in rows if r["method"].startswith("ours")]
    worst_cos = min(r["min_cosine_vs_sequential"] for r in ours)
    worst_abs = max(r["max_abs_vs_sequential"] for r in ours)
    script = next(r for r in rows if "parallel script" in r["method"])
    best_ours = max(r["utt_per_s"] for r in ours if r["toolkit"] == "espnet")
    targets = [common.target("ours equal to the sequential extractor, every batch size (worst cosine)", "≥ 0.99999",
                             round(worst_cos, 8), worst_cos >= 0.99999),
               common.target("ours: max abs difference to the sequential extractor", "≤ 1e-5", f"{worst_abs:.1e}",
                             worst_abs <= 1e-5),
               common.target("toolkit=espnet throughput vs the parallel script's logic (best batch size)", "≥ 0.8×",
                             f"{best_ours / script['utt_per_s']:.2f}×", best_ours >= 0.8 * script["utt_per_s"])]
    size = "small random-weight models (--quick)" if quick else "full-size random-weight models"
    notes = [f"{count} utterances of 2–6 s ({audio_s:.0f} s of audio; rawnet rows: the first {RAWNET_UTTS}), {size}: "
             "ESPnet-SPK RawNet3 "
             f"({params['espnet'] / 1e6:.1f} M parameters, asteroid sinc frontend, chn_attn_stat, 192-d) and the "
             f"recipe's RawNet3 ({params['rawnet'] / 1e6:.1f} M, 256-d, ten 3-s windows); device {device}, 1 torch "
             f"thread; {reps} repetition(s) in rotating order, cells median [min–max].",
             f"The parallel script's padded batch is not exact (worst cosine "
             f"{script['min_cosine_vs_sequential']:.4f} against one utterance at a time): its padding reaches the "
             "instance norm, mean normalisation, convolutions, AFMS and pooling. Ours batches the encoder with "
             "those layers length-aware and computes the cheap features per utterance.",
             "GPU throughput: not measured here (no GPU on this machine); "
             "`python -m benchmarks.bench_spk_embed --device cuda` runs the same rows on one."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    common.bar_chart(path, [r["method"] for r in rows], [r["utt_per_s"] for r in rows],
                     "utterances / s (wall, median; higher is better)",
                     "speaker embeddings: ESPnet's extractor logic vs ours", color="#55a868", height=3.2)


def table(result: dict[str, Any]) -> str:
    """Markdown table of the rows."""
    return common.markdown_table(
        ["toolkit", "method", "wall (s)", "utt/s", "utt/s (CPU time)", "speedup", "max abs vs sequential",
         "worst cosine"],
        [[r["toolkit"], r["method"], common.fmt(r["wall"]), f"{r['utt_per_s']:.2f}", f"{r['cpu_utt_per_s']:.2f}",
          f"{r['speedup']:.2f}×", f"{r['max_abs_vs_sequential']:.1e}", f"{r['min_cosine_vs_sequential']:.6f}"]
         for r in result["rows"]])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 utterances, small models, one repetition")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = parser.parse_args()
    print(table(run(args.quick, args.device)))
