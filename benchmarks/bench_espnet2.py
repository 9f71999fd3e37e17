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
depend on padding). The flow runs cold with no Prefect server configured (its private one) and
with ``PREFECT_API_URL`` at a running server. Targets: ≥ 0.75× ESPnet2's best with no server,
≥ 1.0× with one (issue "Everyday runs start fast"); the older ≥ 3× stays listed.

Run ``python benchmarks/run.py --only espnet2 [--quick]``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import process_tree  # noqa: E402

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


def _timed(cmds: list[list[str]], env: dict[str, str], logs: Path) -> float:
    """Wall seconds of ``cmds`` run at once, each a fresh process logging to ``logs``; raises if one fails."""
    from tests.support.servers import ManagedProcess

    procs = [ManagedProcess(c, name=f"cmd{i}", log_path=logs / f"cmd{i}.log", env=env) for i, c in enumerate(cmds)]
    t0 = time.perf_counter()
    try:
        for p in procs:
            p.start()
        for p in procs:
            if p.popen.wait():
                raise RuntimeError(f"{' '.join(p.argv)} failed ({p.popen.returncode}):\n{p.log_tail()}")
        return time.perf_counter() - t0
    finally:
        for p in procs:  # all of them, also after one failed
            p.stop()


def _espnet2_one(data: Path, out: Path, env: dict[str, str]) -> float:
    return _timed([[sys.executable, str(REFERENCE), str(data / "wav.scp"), str(out)]], env, out.with_suffix(".logs"))


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
            for j, p in enumerate(parts)], env, out / "logs")
    agg = [sys.executable, "-m", "espnet2.bin.aggregate_stats_dirs", *sum((["--input_dir", str(out / f"stats.{j}")]
                                                                          for j in range(jobs)), []),
           "--output_dir", str(out / "stats")]
    _timed([agg], env, out / "logs-aggregate")
    return time.perf_counter() - t0


#: A cold flow's instants (seconds since its process started), from its timeline
#: (``ESPNET3_FLOWS_TIMELINE``: the driver's events and the forkserver's ``forkserver_ready``)
INSTANTS = ("planned", "main", "server_ready", "forkserver_ready", "flow_started", "workers_ready", "first_shard",
            "shards_merged", "flow_returned", "end")


def _flow(data: Path, out: Path, workers: int, env: dict[str, str],
          instants: dict[str, list[float]] | None = None) -> float:
    cmd = process_tree.flow_cli("collect_stats", f"manifests.train={data}", f"output_dir={out}", *FRONTEND,
                          "parallel.env=local", f"parallel.n_workers={workers}", "shard_size=100")
    timeline = out.with_suffix(".timeline.jsonl")
    t0 = time.time()
    wall = _timed([cmd], {**env, "ESPNET3_FLOWS_TIMELINE": str(timeline)}, out.with_suffix(".logs"))
    if instants is not None:
        events = common.timeline_events(timeline, t0, end=t0 + wall)
        for name in INSTANTS:
            if name in events:
                instants.setdefault(name, []).append(events[name])
    return wall


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``espnet2.json`` and return the result."""
    import numpy as np

    from espnet3_flows.orchestration.local_server import LocalPrefectServer

    n = 120 if quick else 2000
    repeats = 1 if quick else int(os.environ.get("ESPNET3_BENCH_ESPNET2_REPEATS") or 3)
    cores = max(1, len(os.sched_getaffinity(0)))
    root = common.scratch("espnet2")
    os.environ.pop("PREFECT_API_URL", None)  # "no server" rows (run.py restores the environment)
    env = process_tree.child_env()
    server = LocalPrefectServer()
    server.start()  # for the "running server" rows
    served = {**env, "PREFECT_API_URL": server.api_url}
    walls: dict[str, list[float]] = {k: [] for k in ("one", "jobs", "cold", "cold_served")}
    try:
        data = _data_dir(n, root)
        common.read_into_page_cache([line.split()[1] for line in (data / "wav.scp").read_text().splitlines()])
        seconds = common.audio_seconds([line.split()[1] for line in (data / "wav.scp").read_text().splitlines()])
        instants: dict[str, dict[str, list[float]]] = {"cold": {}, "cold_served": {}}
        methods = {"one": lambda r: _espnet2_one(data, root / f"espnet2_one{r}", env),
                   "jobs": lambda r: _espnet2_jobs(data, root / f"espnet2_jobs{r}", cores, env),
                   "cold": lambda r: _flow(data, root / f"flow{r}", cores, env, instants["cold"]),
                   "cold_served": lambda r: _flow(data, root / f"flow_served{r}", cores, served,
                                                  instants["cold_served"])}
        names = list(methods)
        for rep in range(repeats):  # interleaved, in rotating order
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                walls[name].append(methods[name](rep))
        noop = _flow(data, root / "flow0", cores, env)
        import json

        compute = float(json.loads((root / "flow0" / "train" / "summary.json").read_text())["compute_seconds"])
        ref = np.load(root / "espnet2_one0" / "train" / "feats_stats.npz")
        ours = np.load(root / "flow0" / "train" / "feats_stats.npz")
        count_equal = int(ref["count"]) == int(ours["count"])
        mean_err = float(np.max(np.abs(ours["sum"] / ours["count"] - ref["sum"] / ref["count"])
                                / np.abs(ref["sum"] / ref["count"])))
    finally:
        server.stop()
        common.clean_scratch(root)
    med = {k: common.spread(v) for k, v in walls.items()}
    one, jobs, cold, cold_served = (med[k]["median"] for k in ("one", "jobs", "cold", "cold_served"))
    best = min(one, jobs)
    rows = [{"method": "ESPnet2 collect_stats, 1 process", "wall": med["one"]},
            {"method": f"ESPnet2 collect_stats, {cores} jobs + aggregate_stats_dirs", "wall": med["jobs"]},
            {"method": f"this flow, {cores} workers, cold, no server configured", "wall": med["cold"]},
            {"method": f"this flow, {cores} workers, cold, PREFECT_API_URL at a running server",
             "wall": med["cold_served"]},
            {"method": f"this flow, {cores} workers, no-op rerun", "wall": common.spread([noop])}]
    rows[2]["instants"], rows[3]["instants"] = ({k: float(np.median(v)) for k, v in instants[key].items()}
                                                for key in ("cold", "cold_served"))
    for r in rows:
        r["wall_s"] = r["wall"]["median"]
        r["utt_per_s"] = n / r["wall_s"]
        r["speedup_vs_espnet2_best"] = best / r["wall_s"]
    targets = [common.target("cold flow, no server configured, vs ESPnet2's best, end to end", "≥ 0.75×",
                             f"{best / cold:.2f}×", best / cold >= 0.75),
               common.target("cold flow, PREFECT_API_URL at a running server, vs ESPnet2's best", "≥ 1.0×",
                             f"{best / cold_served:.2f}×", best / cold_served >= 1.0),
               common.target("cold flow vs ESPnet2's best, end to end (issue \"ESPnet-native inputs\")", "≥ 3×",
                             f"{best / cold:.2f}×", best / cold >= 3),
               common.target("same statistics (count equal, mean rel. error)", "count equal, < 1e-5",
                             f"{'equal' if count_equal else 'DIFFERENT'}, {mean_err:.1e}",
                             count_equal and mean_err < 1e-5)]
    notes = [f"{n} utterances ({seconds:.0f} s of 16 kHz audio), {cores} usable cores, audio in the page cache; each "
             f"row a fresh process (start-up included), {repeats} repetitions interleaved in rotating order (cells: "
             "median [min–max] s), all rows of one run side by side; the no-op rerun once.",
             "Both sides run ESPnet2's DefaultFrontend on one utterance at a time: the frontend's arithmetic is "
             "the same, so the flow's gain can only come from running on every core at once (ESPnet2's N jobs do "
             "that too) and from reruns; the no-op rerun is what a nightly rerun on unchanged data costs.",
             f"Of the flow's cold {cold:.1f} s, its workers computed shards for {compute:.1f} s in all "
             f"({compute / cores:.1f} s of wall on {cores} workers, {1000 * compute / n:.1f} ms an utterance: reading, "
             f"checks, the frontend, exact float64 sums); the rest are fixed costs (interpreter and imports, the "
             "Prefect API server's start when none is configured, the flow run's bookkeeping, starting the workers, "
             "which import torch, librosa and ESPnet2, and the merge): `startup` breaks them down. ESPnet2's frontend "
             f"runs at ~{seconds / one:.0f}x real time here, so at this size no orchestration can be 3x faster end to "
             "end; the gap closes with corpus size (fixed costs stay, compute grows)."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.barh([r["method"] for r in rows][::-1], [r["wall_s"] for r in rows][::-1], color="#4c72b0")
    ax.set_xlabel("wall seconds (lower is better)")
    ax.set_title("collect-stats with ESPnet2's default frontend")
    common.save_figure(fig, path)


def table(result: dict[str, Any]) -> str:
    """Markdown table of the rows, then where the cold flows' time went (median instants)."""
    out = common.markdown_table(["method", "wall (s)", "utt/s", "speedup vs ESPnet2's best"],
                                [[r["method"], common.fmt(r["wall"], 1) if "wall" in r else f"{r['wall_s']:.1f}",
                                  f"{r['utt_per_s']:.1f}",
                                  f"{r['speedup_vs_espnet2_best']:.2f}×"] for r in result["rows"]])
    timed = [r for r in result["rows"] if r.get("instants")]
    if timed:
        out += "\n\nA cold flow's instants, seconds since its process started (medians; the forkserver's imports " \
               "run from `planned` on, beside the driver's):\n\n" + common.markdown_table(
                   ["flow", *INSTANTS], [[r["method"].split(", cold, ")[-1],
                                          *(f"{r['instants'][k]:.2f}" if k in r["instants"] else "–" for k in INSTANTS)]
                                         for r in timed])
    return out


if __name__ == "__main__":
    common.script_main(NAME)
