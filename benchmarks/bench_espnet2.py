"""Benchmark: ESPnet2 frontend collect-stats, this flow vs ESPnet2's own, on the same data and cores.

On a Kaldi data directory of the cached benchmark corpus (2,000 utterances of 2–6 s; 120 with
``--quick``), ESPnet2's ``default`` frontend (``n_fft 512, hop 128, n_mels 80``), each side a
fresh process (start-up included):

- **ESPnet2, 1 process**: ``benchmarks/espnet2_reference.py`` (ESPnet2's ``collect_stats`` with
  its ``SoundScpReader`` and ``DefaultFrontend``), torch's default threads;
- **ESPnet2, N jobs + aggregate**: ``wav.scp`` split in N = usable cores, N such processes at once
  with 1 torch thread each, then ESPnet2's ``aggregate_stats_dirs`` (as ``asr.sh`` stage 10 runs
  it with ``--nj``);
- **this flow**: ``python flows/collect_stats.py manifests.train=<data dir> frontend.type=espnet2
  ...`` with ``parallel.n_workers`` = usable cores, cold (a fresh ``output_dir``), then a no-op
  rerun.

ESPnet2 runs batch size 1 (per utterance, as this flow does by default: features that do not
depend on padding). Target: the flow ≥ 3× ESPnet2's best, end to end.

Run ``python benchmarks/run.py --only espnet2 [--quick]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

NAME = "espnet2"
HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "espnet2_reference.py"
FRONTEND = ["frontend.type=espnet2", "frontend.name=default", "frontend.conf.n_fft=512",
            "frontend.conf.hop_length=128", "frontend.conf.n_mels=80", "frontend.conf.fs=16k"]


def _data_dir(n: int, root: Path) -> Path:
    d = root / f"data_{n}"
    d.mkdir(parents=True, exist_ok=True)
    rows = [line.split("\t")[:2] for line in common.corpus_manifest(n).read_text().splitlines() if line.strip()]
    common.write_lines(d / "wav.scp", (f"{u} {p}\n" for u, p in sorted(rows)))
    return d


def _timed(cmds: list[list[str]], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in cmds]
    for p, c in zip(procs, cmds):
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{' '.join(c)} failed ({p.returncode}): {err.decode(errors='replace')[-2000:]}")
    return time.perf_counter() - t0


def _espnet2_one(data: Path, out: Path, env: dict[str, str]) -> float:
    return _timed([[sys.executable, str(REFERENCE), str(data / "wav.scp"), str(out)]], env)


def _espnet2_jobs(data: Path, out: Path, jobs: int, env: dict[str, str]) -> float:
    lines = (data / "wav.scp").read_text().splitlines()
    parts = []
    for j in range(jobs):
        part = out / f"split{jobs}" / f"wav.{j}.scp"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text("".join(line + "\n" for line in lines[j::jobs]))
        parts.append(part)
    t0 = time.perf_counter()
    _timed([[sys.executable, str(REFERENCE), str(p), str(out / f"stats.{j}"), "--threads", "1"]
            for j, p in enumerate(parts)], env)
    agg = [sys.executable, "-m", "espnet2.bin.aggregate_stats_dirs", *sum((["--input_dir", str(out / f"stats.{j}")]
                                                                          for j in range(jobs)), []),
           "--output_dir", str(out / "stats")]
    _timed([agg], env)
    return time.perf_counter() - t0


def _flow(data: Path, out: Path, workers: int, env: dict[str, str]) -> float:
    cmd = common.flow_cli("collect_stats", f"manifests.train={data}", f"output_dir={out}", *FRONTEND,
                          "parallel.env=local", f"parallel.n_workers={workers}", "shard_size=100")
    return _timed([cmd], env)


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``espnet2.json`` and return the result."""
    import numpy as np

    n = 120 if quick else 2000
    cores = max(1, len(os.sched_getaffinity(0)))
    root = common.scratch("espnet2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(common.REPO), os.environ.get("PYTHONPATH", "")]
                                                       if p)}
    try:
        data = _data_dir(n, root)
        common.read_into_page_cache([line.split()[1] for line in (data / "wav.scp").read_text().splitlines()])
        seconds = common.audio_seconds([line.split()[1] for line in (data / "wav.scp").read_text().splitlines()])
        one = _espnet2_one(data, root / "espnet2_one", env)
        jobs = _espnet2_jobs(data, root / "espnet2_jobs", cores, env)
        cold = _flow(data, root / "flow", cores, env)
        noop = _flow(data, root / "flow", cores, env)
        import json

        compute = float(json.loads((root / "flow" / "train" / "summary.json").read_text())["compute_seconds"])
        ref = np.load(root / "espnet2_one" / "train" / "feats_stats.npz")
        ours = np.load(root / "flow" / "train" / "feats_stats.npz")
        count_equal = int(ref["count"]) == int(ours["count"])
        mean_err = float(np.max(np.abs(ours["sum"] / ours["count"] - ref["sum"] / ref["count"])
                                / np.abs(ref["sum"] / ref["count"])))
    finally:
        common.clean_scratch(root)
    best = min(one, jobs)
    rows = [{"method": "ESPnet2 collect_stats, 1 process", "wall_s": one, "utt_per_s": n / one},
            {"method": f"ESPnet2 collect_stats, {cores} jobs + aggregate_stats_dirs", "wall_s": jobs,
             "utt_per_s": n / jobs},
            {"method": f"this flow, {cores} workers, cold", "wall_s": cold, "utt_per_s": n / cold},
            {"method": f"this flow, {cores} workers, no-op rerun", "wall_s": noop, "utt_per_s": n / noop}]
    for r in rows:
        r["speedup_vs_espnet2_best"] = best / r["wall_s"]
    targets = [common.target("cold flow vs ESPnet2's best, end to end", "≥ 3×", round(best / cold, 2), best / cold >= 3),
               common.target("same statistics (count equal, mean rel. error)", "count equal, < 1e-5",
                             f"{'equal' if count_equal else 'DIFFERENT'}, {mean_err:.1e}",
                             count_equal and mean_err < 1e-5)]
    notes = [f"{n} utterances ({seconds:.0f} s of 16 kHz audio), {cores} usable cores, audio in the page cache; each "
             "row a fresh process (start-up included), one repetition, all rows of one run side by side.",
             "Both sides run ESPnet2's DefaultFrontend on one utterance at a time: the frontend's arithmetic is "
             "the same, so the flow's gain can only come from running on every core at once (ESPnet2's N jobs do "
             "that too) and from reruns; the no-op rerun is what a nightly rerun on unchanged data costs.",
             f"Of the flow's cold {cold:.1f} s, its workers computed shards for {compute:.1f} s in all "
             f"({compute / cores:.1f} s of wall on {cores} workers, {1000 * compute / n:.1f} ms an utterance: reading, "
             f"checks, the frontend, exact float64 sums); the other ~{cold - compute / cores:.0f} s are fixed costs "
             "(interpreter, Prefect's flow and task bookkeeping, starting the workers, which import torch, librosa "
             "and ESPnet2, and the merge). ESPnet2's whole job takes less than that here: its frontend runs at "
             f"~{seconds / one:.0f}x real time on this machine, so at this size no orchestration can be 3x faster "
             "end to end; the gap closes with corpus size (fixed costs stay, compute grows)."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.barh([r["method"] for r in rows][::-1], [r["wall_s"] for r in rows][::-1], color="#4c72b0")
    ax.set_xlabel("wall seconds (lower is better)")
    ax.set_title("collect-stats with ESPnet2's default frontend")
    common.save_figure(fig, path)


def table(result: dict[str, Any]) -> str:
    """Markdown table of the rows."""
    return common.markdown_table(["method", "wall (s)", "utt/s", "speedup vs ESPnet2's best"],
                                 [[r["method"], f"{r['wall_s']:.1f}", f"{r['utt_per_s']:.1f}",
                                   f"{r['speedup_vs_espnet2_best']:.2f}×"] for r in result["rows"]])
