"""Benchmark: ESPnet2 frontend collect-stats, this flow vs ESPnet2's own, on the same data and cores.

On a Kaldi data directory of the cached benchmark corpus (2,000 utterances of 2–6 s by default,
``ESPNET3_BENCH_ESPNET2_UTTS`` sets another size; 40 with ``--quick``), ESPnet2's ``default``
frontend (``n_fft 512, hop 128, n_mels 80``), each side a fresh process (start-up included):

- **ESPnet2, 1 process**: ``benchmarks/espnet2_reference.py`` (ESPnet2's ``collect_stats`` with
  its ``SoundScpReader`` and ``DefaultFrontend``), torch's default threads;
- **ESPnet2, N jobs + aggregate**: ``wav.scp`` split in N = usable cores, N such processes at once
  with 1 torch thread each, then ESPnet2's ``aggregate_stats_dirs`` (as ``asr.sh`` stage 10 runs
  it with ``--nj``);
- **this flow**: ``python flows/collect_stats.py manifests.train=<data dir> frontend.type=espnet2
  ...`` with ``parallel.n_workers`` = usable cores, cold (a fresh ``output_dir``), with no Prefect
  server configured (its private one) and with ``PREFECT_API_URL`` at a running server; its
  default computes ``DefaultFrontend``'s features with the exact fast path
  (``espnet3_flows/frontends/espnet2_default.py``); once more with ``frontend.espnet2_class=true``
  (ESPnet2's class itself, running server); once more with ``shard_size=100`` (running server:
  what ten times the default's shards cost, each one a Prefect task run); then a no-op rerun.
  The flow runs with the default ``shard_size`` (1000), as a user's command line does: a split
  of fewer than ``2 × workers × shard_size`` utterances (2,000 here) is cut into 2-4 shards per
  worker by the planner itself.

Every row also records its **compute rate per core**: utterances per second that one core spent
computing (reading audio, the frontend, the statistics): the ESPnet2 jobs' and the flow workers'
busy seconds (one torch thread each: ``collect_stats``' wall in each job, the shards' seconds in
``summary.json``), and for the 1-process row its ``collect_stats`` call's CPU seconds over all
its threads (a lower bound: torch's idle threads spin). The rows run
``ESPNET3_BENCH_ESPNET2_REPEATS`` (default 3) times, interleaved in rotating order.

ESPnet2 runs batch size 1 (per utterance, as this flow does by default: features that do not
depend on padding). Targets (issue "Faster than ESPnet2's own stage 10"): from
:data:`LARGE` utterances on, ≥ 2× ESPnet2's best with a running server and ≥ 1.5× with none;
below, ≥ 1.0× with one and ≥ 0.75× with none (issue "Everyday runs start fast"); the fast path's
compute ≥ 2× ESPnet2's per core; the same statistics. The older ≥ 3× end to end stays listed.

A **busy machine**: ``ESPNET3_BENCH_ESPNET2_HOGS=cores`` (or a number) runs that many CPU hogs
(``python -c "while True: pass"``, normal priority) beside every row, ESPnet2's and ours, started
before the first and killed after the last; the large-corpus targets are then :data:`BUSY`.
``ESPNET3_BENCH_ESPNET2_ROWS=jobs,cold,cold_served`` leaves the other rows out (those three are
always measured; ESPnet2's best is then its N jobs: beside hogs, the 1-process row's torch threads
spin against them).

Run ``python -m benchmarks --only espnet2 [--quick]``
(``ESPNET3_BENCH_ESPNET2_UTTS=20000 python -m benchmarks --only espnet2`` for a large corpus;
``ESPNET3_BENCH_ESPNET2_UTTS=20000 ESPNET3_BENCH_ESPNET2_HOGS=cores python -m benchmarks --only
espnet2`` beside a hog per core).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks import process_tree

NAME = "espnet2"
HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "espnet2_reference.py"
FRONTEND = ["frontend.type=espnet2", "frontend.name=default", "frontend.conf.n_fft=512",
            "frontend.conf.hop_length=128", "frontend.conf.n_mels=80", "frontend.conf.fs=16k"]
#: The corpus size of a full run (``--quick``: 120), unless ``ESPNET3_BENCH_ESPNET2_UTTS`` says another
UTTERANCES = 2000
#: From this corpus size on, the end-to-end targets are those of a large corpus (2× / 1.5×)
LARGE = 20000
#: The end-to-end targets of a large corpus beside a CPU hog per core (no server, running server;
#: issue "Prefect's cost per shard and per run")
BUSY = (1.3, 1.6)


def _data_dir(n: int, root: Path) -> Path:
    d = root / f"data_{n}"
    d.mkdir(parents=True, exist_ok=True)
    rows = [line.split("\t")[:2] for line in common.corpus_manifest(n).read_text().splitlines() if line.strip()]
    common.write_lines(d / "wav.scp", (f"{u} {p}\n" for u, p in sorted(rows)))
    return d


#: Runs the commands of its JSON argument at once, in its own session, and fails if one fails:
#: ESPnet2's N jobs as ``run.pl`` starts them from a user's shell (one session: on a kernel that
#: groups CPU time by session, ``sched_autogroup``, they share the session's part, as the flow's
#: workers share their CLI's)
_ONE_SESSION = ("import json, subprocess, sys\n"
                "procs = [subprocess.Popen(c) for c in json.loads(sys.argv[1])]\n"
                "sys.exit(max(p.wait() for p in procs))")


def _timed(cmds: list[list[str]], env: dict[str, str], logs: Path, one_session: bool = False) -> float:
    """Wall seconds of ``cmds`` run at once, each a fresh process logging to ``logs`` (all in one
    session with ``one_session``); raises if one fails."""
    import json

    from tests.support.servers import ManagedProcess

    if one_session and len(cmds) > 1:
        cmds = [[sys.executable, "-c", _ONE_SESSION, json.dumps(cmds)]]

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


def _timing(path: Path) -> dict[str, float]:
    import json

    return json.loads(path.read_text())


def _espnet2_one(data: Path, out: Path, env: dict[str, str], busy: list[float]) -> float:
    """Wall of ESPnet2's collect_stats in one process; appends its CPU seconds (all threads) to ``busy``."""
    timing = out.with_suffix(".timing.json")
    wall = _timed([[sys.executable, str(REFERENCE), str(data / "wav.scp"), str(out), "--timing", str(timing)]], env,
                  out.with_suffix(".logs"))
    busy.append(_timing(timing)["collect_cpu_s"])
    return wall


def _espnet2_jobs(data: Path, out: Path, jobs: int, env: dict[str, str], busy: list[float]) -> float:
    """Wall of ``jobs`` ESPnet2 processes and their aggregation; appends the seconds the jobs spent in
    collect_stats, summed (one torch thread each), to ``busy``."""
    lines = (data / "wav.scp").read_text().splitlines()
    parts = []
    for j in range(jobs):
        part = out / f"split{jobs}" / f"wav.{j}.scp"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_text("".join(line + "\n" for line in lines[j::jobs]))
        parts.append(part)
    t0 = time.perf_counter()
    _timed([[sys.executable, str(REFERENCE), str(p), str(out / f"stats.{j}"), "--threads", "1",
             "--timing", str(out / f"timing.{j}.json")] for j, p in enumerate(parts)], env, out / "logs",
           one_session=True)
    busy.append(sum(_timing(out / f"timing.{j}.json")["collect_wall_s"] for j in range(jobs)))
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
          instants: dict[str, list[float]] | None = None, busy: list[float] | None = None,
          extra: tuple[str, ...] = (), shards: list[int] | None = None) -> float:
    """Wall of the CLI flow; appends its shards' compute seconds (``summary.json``) to ``busy`` and
    its number of shards to ``shards``."""
    import json

    cmd = process_tree.flow_cli("collect_stats", f"manifests.train={data}", f"output_dir={out}", *FRONTEND, *extra,
                                "parallel.env=local", f"parallel.n_workers={workers}")
    timeline = out.with_suffix(".timeline.jsonl")
    t0 = time.time()
    wall = _timed([cmd], {**env, "ESPNET3_FLOWS_TIMELINE": str(timeline)}, out.with_suffix(".logs"))
    if instants is not None:
        events = common.timeline_events(timeline, t0, end=t0 + wall)
        for name in INSTANTS:
            if name in events:
                instants.setdefault(name, []).append(events[name])
    summary = json.loads((out / "train" / "summary.json").read_text())
    if busy is not None:
        busy.append(float(summary["compute_seconds"]))
    if shards is not None:
        shards.append(int(summary["shards"]))
    return wall


def corpus_size(quick: bool) -> int:
    """``ESPNET3_BENCH_ESPNET2_UTTS`` if set, else 40 with ``--quick`` and :data:`UTTERANCES` without."""
    value = os.environ.get("ESPNET3_BENCH_ESPNET2_UTTS")
    return int(value) if value else (40 if quick else UTTERANCES)


ROWS = {"one": "ESPnet2 collect_stats, 1 process",
        "jobs": "ESPnet2 collect_stats, {cores} jobs + aggregate_stats_dirs",
        "cold": "this flow, {cores} workers, cold, no server configured",
        "cold_served": "this flow, {cores} workers, cold, PREFECT_API_URL at a running server",
        "cold_class": "this flow, {cores} workers, cold, running server, ESPnet2's class (frontend.espnet2_class=true)",
        "cold_small": "this flow, {cores} workers, cold, running server, shard_size=100"}


#: The rows every run measures (the targets compare them); the others can be left out
#: (``ESPNET3_BENCH_ESPNET2_ROWS``)
REQUIRED = ("jobs", "cold", "cold_served")


def chosen_rows() -> list[str]:
    """The rows to measure: ``ESPNET3_BENCH_ESPNET2_ROWS`` (comma-separated keys of :data:`ROWS`, the
    :data:`REQUIRED` ones always added), else all of them."""
    value = os.environ.get("ESPNET3_BENCH_ESPNET2_ROWS", "").strip()
    if not value:
        return list(ROWS)
    wanted = {k.strip() for k in value.split(",") if k.strip()}
    unknown = wanted - set(ROWS)
    if unknown:
        raise ValueError(f"ESPNET3_BENCH_ESPNET2_ROWS: unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}")
    return [k for k in ROWS if k in wanted or k in REQUIRED]


def hog_count(cores: int) -> int:
    """``ESPNET3_BENCH_ESPNET2_HOGS``: CPU hogs to run beside every measured row (``cores``: one per
    usable core); 0 (quiet) when unset."""
    value = os.environ.get("ESPNET3_BENCH_ESPNET2_HOGS", "").strip()
    return cores if value == "cores" else int(value or 0)


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``espnet2.json`` and return the result."""
    import numpy as np

    from benchmarks.machine import cpu_hogs

    n = corpus_size(quick)
    repeats = 1 if quick else int(os.environ.get("ESPNET3_BENCH_ESPNET2_REPEATS") or 3)
    cores = max(1, len(os.sched_getaffinity(0)))
    keys, hogs = chosen_rows(), hog_count(cores)
    root = common.scratch("espnet2")
    server = contextlib.ExitStack()
    api_url = server.enter_context(common.running_server(quick))  # for the "running server" rows
    os.environ.pop("PREFECT_API_URL", None)  # "no server" rows (run.py restores the environment)
    env = process_tree.child_env()
    served = {**env, "PREFECT_API_URL": api_url}
    walls: dict[str, list[float]] = {k: [] for k in keys}
    busy: dict[str, list[float]] = {k: [] for k in keys}
    shards: dict[str, list[int]] = {"default": [], "small": []}
    try:
        data = _data_dir(n, root)
        common.read_into_page_cache([line.split()[1] for line in (data / "wav.scp").read_text().splitlines()])
        seconds = common.audio_seconds([line.split()[1] for line in (data / "wav.scp").read_text().splitlines()])
        instants: dict[str, dict[str, list[float]]] = {"cold": {}, "cold_served": {}}
        methods = {"one": lambda r: _espnet2_one(data, root / f"espnet2_one{r}", env, busy["one"]),
                   "jobs": lambda r: _espnet2_jobs(data, root / f"espnet2_jobs{r}", cores, env, busy["jobs"]),
                   "cold": lambda r: _flow(data, root / f"flow{r}", cores, env, instants["cold"], busy["cold"]),
                   "cold_served": lambda r: _flow(data, root / f"flow_served{r}", cores, served,
                                                  instants["cold_served"], busy["cold_served"],
                                                  shards=shards["default"]),
                   "cold_class": lambda r: _flow(data, root / f"flow_class{r}", cores, served, None,
                                                 busy["cold_class"], ("frontend.espnet2_class=true",)),
                   "cold_small": lambda r: _flow(data, root / f"flow_small{r}", cores, served, None,
                                                 busy["cold_small"], ("shard_size=100",), shards["small"])}
        names = [k for k in methods if k in keys]
        with cpu_hogs(hogs) as hog_cpu:
            t0 = time.perf_counter()
            for rep in range(repeats):  # interleaved, in rotating order
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    walls[name].append(methods[name](rep))
            noop = _flow(data, root / "flow0", cores, env)
            hog_share = hog_cpu() / max(time.perf_counter() - t0, 1e-9) / cores if hogs else 0.0
        ref = np.load(root / "espnet2_one0" / "train" / "feats_stats.npz" if "one" in keys
                      else root / "espnet2_jobs0" / "stats" / "train" / "feats_stats.npz")
        ours = np.load(root / "flow0" / "train" / "feats_stats.npz")
        count_equal = int(ref["count"]) == int(ours["count"])
        mean_err = float(np.max(np.abs(ours["sum"] / ours["count"] - ref["sum"] / ref["count"])
                                / np.abs(ref["sum"] / ref["count"])))
    finally:
        server.close()
        common.clean_scratch(root)
    med = {k: common.spread(v) for k, v in walls.items()}
    rate = {k: common.spread([n / b for b in v]) for k, v in busy.items()}
    cold, cold_served = med["cold"]["median"], med["cold_served"]["median"]
    best = min(med[k]["median"] for k in ("one", "jobs") if k in med)
    rows = [{"method": ROWS[k].format(cores=cores), "wall": med[k], "compute_utt_per_core_s": rate[k],
             **({"instants": {name: float(np.median(v)) for name, v in instants[k].items()}} if k in instants else {})}
            for k in keys]
    rows.append({"method": f"this flow, {cores} workers, no-op rerun", "wall": common.spread([noop])})
    for r in rows:
        r["wall_s"] = r["wall"]["median"]
        r["utt_per_s"] = n / r["wall_s"]
        r["speedup_vs_espnet2_best"] = best / r["wall_s"]
    per_core = rate["cold_served"]["median"] / rate["jobs"]["median"]  # (not the 1-process row: its threads spin)
    targets = _targets(n, cores, best, cold, cold_served, per_core, count_equal, mean_err, hogs)
    notes = [f"{n} utterances ({seconds:.0f} s of 16 kHz audio), {cores} usable cores, audio in the page cache; each "
             f"row a fresh process (start-up included), {repeats} repetitions interleaved in rotating order (cells: "
             "median [min–max]), all rows of one run side by side; the no-op rerun once.",
             *([f"A busy machine: {hogs} CPU hog(s) (`python -c \"while True: pass\"` at normal priority, "
                "ESPNET3_BENCH_ESPNET2_HOGS) ran beside every row, ESPnet2's as ours, started before the first row "
                f"and killed after the no-op rerun; they took {hog_share:.0%} of the {cores} cores' time meanwhile."]
               if hogs else []),
             _per_core_note(rate),
             f"Of the flow's cold {cold:.1f} s, its workers computed for {np.median(busy['cold']):.1f} s in all; the "
             "rest are fixed costs (interpreter and imports, the Prefect API server's start when none is configured, "
             "the flow run's bookkeeping, starting the workers, the merge): `startup` breaks them down. With the fast "
             "path the workers import torch but neither ESPnet2 nor librosa; with the class, both.",
             *([_small_shards_note(shards, med["cold_small"]["median"], cold_served, cores)]
               if "cold_small" in med else [])]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path), hogs=hogs)


def _per_core_note(rate: dict[str, dict[str, float]]) -> str:
    """What the compute per core is, and the flow's fast path against ESPnet2's class and its jobs."""
    fast_rate = rate["cold_served"]["median"]
    versus_class = (f"{fast_rate / rate['cold_class']['median']:.2f}x what ESPnet2's class does in the same flow per "
                    "core, " if "cold_class" in rate else "")
    return ("Compute per core: utterances per second of one core's compute (reading, the frontend, the sums): the "
            "ESPnet2 jobs' collect_stats wall summed (1 torch thread each), the flow's shard seconds summed "
            "(summary.json, 1 thread per worker), the 1-process row's collect_stats CPU seconds over its threads "
            f"(torch's idle threads spin: a lower bound). The flow's fast path computes {versus_class}"
            f"{fast_rate / rate['jobs']['median']:.2f}x ESPnet2's own collect_stats; "
            "`benchmarks/bench_frontend_espnet2.py` measures the frontends alone.")


def _targets(n: int, cores: int, best: float, cold: float, cold_served: float, per_core: float,
             count_equal: bool, mean_err: float, hogs: int = 0) -> list[dict[str, Any]]:
    """The targets: end to end against ESPnet2's best (stricter from :data:`LARGE` utterances; on a
    busy machine, :data:`BUSY`), compute per core, and equal statistics."""
    large = n >= LARGE
    need_none, need_served = (BUSY if hogs else (1.5, 2.0)) if large else (0.75, 1.0)
    size = f"{'≥' if large else '<'} {LARGE:,} utterances" + (f", beside {hogs} CPU hog(s)" if hogs else "")
    targets = [common.target(f"cold flow, no server configured, vs ESPnet2's best, end to end ({size})",
                             f"≥ {need_none}×", f"{best / cold:.2f}×", best / cold >= need_none),
               common.target(f"cold flow, PREFECT_API_URL at a running server, vs ESPnet2's best ({size})",
                             f"≥ {need_served}×", f"{best / cold_served:.2f}×", best / cold_served >= need_served),
               common.target(f"compute per core, this flow (fast path) vs ESPnet2's collect_stats ({cores} jobs)",
                             "≥ 2×", f"{per_core:.2f}×", per_core >= 2),
               common.target("cold flow vs ESPnet2's best, end to end (issue \"ESPnet-native inputs\")", "≥ 3×",
                             f"{best / cold:.2f}×", best / cold >= 3),
               common.target("same statistics (count equal, mean rel. error)", "count equal, < 1e-5",
                             f"{'equal' if count_equal else 'DIFFERENT'}, {mean_err:.1e}",
                             count_equal and mean_err < 1e-5)]
    return targets


def _small_shards_note(shards: dict[str, list[int]], small: float, default: float, cores: int) -> str:
    """What ``shard_size=100`` cost against the default, per extra shard (cores × wall difference)."""
    n_small, n_default = shards["small"][0], shards["default"][0]
    text = (f"shard_size=100 (running server): {n_small} shards, {small:.1f} s, against {n_default} shards and "
            f"{default:.1f} s with the default 1000")
    if n_small <= n_default:
        return text + " (a corpus this small is cut into the same shards either way)."
    per_shard = 1e3 * cores * (small - default) / (n_small - n_default)
    if per_shard <= 0:
        return text + f": no cost of the {n_small - n_default} extra shards measurable above this run's noise."
    return text + (f": each shard is a Prefect task run (its API calls and states, the driver's bookkeeping), "
                   f"~{per_shard:.0f} ms of the {cores} cores' time per extra shard here.")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    common.bar_chart(path, [r["method"] for r in rows], [r["wall_s"] for r in rows], "wall seconds (lower is better)",
                     "collect-stats with ESPnet2's default frontend", height=2.8)


def table(result: dict[str, Any]) -> str:
    """Markdown table of the rows, then where the cold flows' time went (median instants)."""
    out = common.markdown_table(["method", "wall (s)", "utt/s", "speedup vs ESPnet2's best", "compute utt/s per core"],
                                [[r["method"], common.fmt(r["wall"], 1) if "wall" in r else f"{r['wall_s']:.1f}",
                                  f"{r['utt_per_s']:.1f}", f"{r['speedup_vs_espnet2_best']:.2f}×",
                                  common.fmt(r.get("compute_utt_per_core_s"), 0)] for r in result["rows"]])
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
