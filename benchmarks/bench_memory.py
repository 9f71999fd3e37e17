"""Benchmark: peak memory of the flow's driver and workers at 1× and 4× data, and of planning 300k utterances.

- **Flow at 1× and 4×**: ``run_job("collect_stats", ...)`` on a 2-worker ``LocalCluster`` over
  2,000 and 8,000 cached utterances (50 and 200 with ``--quick``), each in a fresh subprocess
  (the driver), so every number starts clean, its process tree sampled every 50 ms
  (``process_tree.run_monitored``, whose docstring defines the peaks). Target: peak RSS at 4× ≤
  1.1 × peak at 1×, for the driver and for a worker (a worker holds one shard at a time, so its
  memory should not grow with the data).
- **Planning 300,000 utterances**: a generated TSV manifest (the first lines point at real
  corpus files, the rest at files in 1,000 nonexistent directories: planning needs no audio)
  and, in a fresh subprocess, ``CollectStatsRunner(cfg, "train").plan(range(n))``: manifest
  read, file fingerprints (one listing per directory) and shard hashing. Targets: < 10 s and
  peak RSS < 1 GB.
- **Dry run of 1,000,000 manifest lines** (30,000 with ``--quick``): ``python flows/collect_stats.py
  --dry-run`` in a fresh process, every line's file stat'ed and 100 headers read (issue "Nightly
  runs an operator can see and trust"). Target: < 60 s.

Run ``python -m benchmarks --only memory [--quick]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable

from benchmarks import common
from benchmarks import process_tree

NAME = "memory"
MB = 1024 ** 2
INTERVAL = 0.05
#: The sampled figures of a flow row (``process_tree``'s definitions) and their column names
FLOW_PEAKS = {"driver_peak": "driver peak RSS MB", "worker_peak": "largest worker peak RSS MB",
              "forkserver_peak": "forkserver peak RSS MB",
              "workers_and_forkserver_sum_peak": "workers and forkserver together MB (sampled)"}


# ---- children ---------------------------------------------------------------------------------
def child_flow(manifest: str, output_dir: str) -> dict[str, Any]:
    """Run the flow once (in a fresh process); report wall time and its exact peak RSS."""
    from benchmarks import bench_collect_stats as cs

    with common.prefect_session():
        t0 = time.perf_counter()
        r = cs.flow_run(Path(manifest), common.SHARD_SIZE, output_dir=Path(output_dir))
        wall = time.perf_counter() - t0
    return {"wall": wall, "computed": r["computed"], "utterances": r["utterances"]}


def child_plan(manifest: str, output_dir: str) -> dict[str, Any]:
    """Plan a big manifest (in a fresh process): time each part and the RSS.

    Planning is one streaming pass (``plan_manifest``); reading the lines alone and fingerprinting
    the paths alone are timed too, to split the pass into its parts.
    """
    from espnet3_flows.inputs.manifest import iter_manifest_lines
    from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner

    rss0 = process_tree.proc_memory()["VmRSS"]
    t0 = time.perf_counter()
    cfg = CollectStatsConfig(manifests={"train": manifest}, output_dir=output_dir, shard_size=common.SHARD_SIZE)
    runner = CollectStatsRunner(cfg, "train")
    t1 = time.perf_counter()
    paths = [raw.split(b"\t", 2)[1].decode() for _, _, raw in iter_manifest_lines(manifest)]
    t2 = time.perf_counter()
    plan = runner.plan()
    t3 = time.perf_counter()
    peak_plan = process_tree.proc_memory()["VmHWM"]
    common.fingerprint_as_planner(paths)  # alone, to split the plan's time into its parts
    t4 = time.perf_counter()
    runner.write_plan(plan)
    t5 = time.perf_counter()
    return {"utterances": plan.num_items, "shards": len(plan.shards), "init": t1 - t0, "read": t2 - t1,
            "plan": t3 - t2, "fingerprints": t4 - t3, "write_plan": t5 - t4, "total": t3 - t2 + (t1 - t0),
            "rss_after_imports": rss0, "peak_rss_at_plan": peak_plan,
            "peak_rss": process_tree.proc_memory()["VmHWM"]}


# ---- parent -----------------------------------------------------------------------------------
def _spawn(mode: str, source: Path, dest: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run this file as ``--child MODE SOURCE DEST REPORT`` under the sampler; (child's report, sampled run)."""
    report = dest / "bench-memory-report.json"  # written when the child is done, removed with ``dest``
    run = process_tree.run_checked([*common.module_command(__spec__.name), "--child", mode, source, dest, report],
                                   common.DATA / "logs" / NAME / f"{mode}.log", interval=INTERVAL)
    return json.loads(report.read_text()), run


def _cached_manifest(name: str, lines: Callable[[list[str]], Iterable[str]]) -> Path:
    """``DATA/plan/<name>``, written once (atomically) from ``lines(real)``, where ``real`` are
    200 real corpus files."""
    path = common.DATA / "plan" / name
    if path.exists():
        return path
    real = common.manifest_paths(common.corpus_manifest(200))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(lines(real)))
    tmp.replace(path)
    return path


def plan_manifest(n: int) -> Path:
    """A cached ``n``-line TSV: the first lines name real corpus files, the rest nonexistent ones."""
    missing = common.DATA / "plan" / "missing"
    return _cached_manifest(f"train_{n}.tsv", lambda real: (
        f"plan-utt{i:06d}\t{real[i] if i < len(real) else f'{missing}/d{i % 1000:04d}/utt{i:06d}.wav'}\t\tspk{i % 50}\n"
        for i in range(n)))


def dry_run_manifest(n: int) -> Path:
    """A cached ``n``-line TSV naming 200 real corpus files in turn: every line a file that
    ``--dry-run`` stats (and 100 of them a header it reads)."""
    return _cached_manifest(f"dry_{n}.tsv", lambda real: (f"dry-utt{i:07d}\t{real[i % len(real)]}\n"
                                                          for i in range(n)))


def _dry_runs(n: int, reps: int) -> list[dict[str, Any]]:
    """``python flows/collect_stats.py --dry-run`` over ``n`` manifest lines, ``reps`` fresh processes."""
    manifest = dry_run_manifest(n)
    runs = []
    for _ in range(reps):
        out = common.scratch("memory-dry-run")
        try:
            runs.append(process_tree.run_checked(
                process_tree.flow_cli("collect_stats", "--dry-run", f"manifests.train={manifest}", f"output_dir={out}"),
                common.DATA / "logs" / NAME / "dry-run.log", interval=INTERVAL))
        finally:
            common.clean_scratch(out)
    return runs


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``memory.json`` / ``.png`` and return the result."""
    base = 50 if quick else 2000
    sizes = {"1×": base, "4×": 4 * base}
    reps = 1 if quick else 2
    plan_n = 30_000 if quick else 300_000
    plan_reps = 1 if quick else 3
    manifests = {label: common.corpus_manifest(n) for label, n in sizes.items()}
    big = plan_manifest(plan_n)
    flows: dict[str, list[dict[str, Any]]] = {label: [] for label in sizes}
    plans: list[dict[str, Any]] = []
    with common.prefect_session():
        for rep in range(reps):
            for label in (list(sizes) if rep % 2 == 0 else list(sizes)[::-1]):
                out = common.scratch("memory-flow")
                try:
                    report, sampled = _spawn("flow", manifests[label], out)
                finally:
                    common.clean_scratch(out)
                flows[label].append({**report, **sampled})
            print(f"[bench] {NAME}: flow repetition {rep + 1}/{reps} done")
    for _ in range(plan_reps):
        out = common.scratch("memory-plan")
        try:
            report, sampled = _spawn("plan", big, out)
        finally:
            common.clean_scratch(out)
        plans.append({**report, **sampled})

    rows: list[dict[str, Any]] = []
    for label, runs in flows.items():
        rows.append({"section": "flow", "data": label, "utterances": sizes[label], "repetitions": len(runs),
                     "wall_s": common.spread([r["wall"] for r in runs]),
                     **{f"{key}_mb": common.spread([r[key] / MB for r in runs]) for key in FLOW_PEAKS},
                     "workers_seen": max(r["workers_seen"] for r in runs)})
    p = plans
    rows.append({"section": "plan", "data": f"{plan_n:,} utterances", "utterances": plan_n, "repetitions": len(p),
                 "shards": p[0]["shards"], "total_s": common.spread([r["total"] for r in p]),
                 "init_s": common.spread([r["init"] for r in p]), "read_s": common.spread([r["read"] for r in p]),
                 "plan_s": common.spread([r["plan"] for r in p]),
                 "fingerprints_s": common.spread([r["fingerprints"] for r in p]),
                 "hashing_s": common.spread([r["plan"] - r["fingerprints"] for r in p]),
                 "write_plan_s": common.spread([r["write_plan"] for r in p]),
                 "rss_after_imports_mb": common.spread([r["rss_after_imports"] / MB for r in p]),
                 "peak_rss_mb": common.spread([r["peak_rss_at_plan"] / MB for r in p]),
                 "peak_rss_incl_write_mb": common.spread([r["peak_rss"] / MB for r in p])})
    dry_n = 30_000 if quick else 1_000_000
    dry = _dry_runs(dry_n, plan_reps)
    rows.append({"section": "dry run", "data": f"{dry_n:,} utterances", "utterances": dry_n, "repetitions": len(dry),
                 "wall_s": common.spread([r["wall_s"] for r in dry])})
    one, four = rows[0], rows[1]
    growth_driver = four["driver_peak_mb"]["median"] / one["driver_peak_mb"]["median"]
    growth_worker = four["worker_peak_mb"]["median"] / one["worker_peak_mb"]["median"]
    plan_row = rows[2]
    targets = [
        common.target("driver peak RSS, 4× / 1× data", "≤ 1.1", round(growth_driver, 3), growth_driver <= 1.1),
        common.target("worker peak RSS, 4× / 1× data", "≤ 1.1", round(growth_worker, 3), growth_worker <= 1.1),
        common.target(f"plan {plan_n:,} utterances: time", "< 10 s", round(plan_row["total_s"]["median"], 2),
                      plan_row["total_s"]["median"] < 10),
        common.target(f"plan {plan_n:,} utterances: peak RSS", "< 1 GB (1024 MB)",
                      round(plan_row["peak_rss_mb"]["median"], 1), plan_row["peak_rss_mb"]["median"] < 1024),
        common.target(f"--dry-run over {dry_n:,} manifest lines, every file stat'ed: time", "< 60 s",
                      round(rows[3]["wall_s"]["median"], 2), rows[3]["wall_s"]["median"] < 60),
    ]
    notes = [
        f"Flow: {reps} repetition(s) per size, alternating order, each in a fresh driver process; shard_size "
        f"{common.SHARD_SIZE}, 2 workers × 1 thread. " + process_tree.MEMORY_NOTE.format(interval=INTERVAL)
        + " 'Together' sums sampled RSS and can miss short spikes.",
        f"Plan: {plan_reps} fresh process(es); time = config + runner construction + manifest read + "
        "fingerprints + hashing (the plan target); write_plan (manifest.json) is reported separately. "
        f"The manifest's first 200 lines name real files, the other {plan_n - 200:,} name files in 1,000 "
        "nonexistent directories (fingerprint 'missing').",
    ]
    notes.append(f"Dry run: {plan_reps} fresh process(es) of `python flows/collect_stats.py --dry-run` (config, "
                 "planning, every pending file stat'ed, 100 headers read) on 2 workers' cut; the manifest names 200 "
                 "real corpus files in turn.")
    if plan_n != 300_000:
        notes.append(f"--quick plans {plan_n:,} utterances and dry-runs {dry_n:,}, not 300,000 and 1,000,000: the "
                     "targets are for the full run.")
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def table(result: dict[str, Any]) -> str:
    """Markdown tables of a result."""
    f = common.fmt
    flow = [[r["data"], r["utterances"], f(r["wall_s"], 1), *(f(_peak(r, key), 0) for key in FLOW_PEAKS)]
            for r in result["rows"] if r["section"] == "flow"]
    plan = [[r["data"], r["shards"], f(r["total_s"]), f(r["read_s"]), f(r["fingerprints_s"]), f(r["hashing_s"]),
             f(r["write_plan_s"]), f(r["rss_after_imports_mb"], 0), f(r["peak_rss_mb"], 0)]
            for r in result["rows"] if r["section"] == "plan"]
    return "\n\n".join([
        common.markdown_table(["flow data", "utterances", "wall s", *FLOW_PEAKS.values()], flow),
        common.markdown_table(["plan", "shards", "total s", "manifest read s", "fingerprints s", "hashing s",
                               "write manifest.json s", "RSS after imports MB", "peak RSS MB"], plan),
    ])


def _peak(row: dict[str, Any], key: str) -> dict[str, float] | None:
    # results written before process_tree named it so called the workers-and-forkserver sum "workers_sum_peak_sampled"
    return row.get(f"{key}_mb", row.get("workers_sum_peak_sampled_mb") if key.startswith("workers_and") else None)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    flow = [r for r in rows if r["section"] == "flow"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(flow)
    for k, r in enumerate(flow):
        med = [r[f"{key}_mb"]["median"] for key in FLOW_PEAKS]
        ax.bar([i + k * width for i in range(len(FLOW_PEAKS))], med, width,
               label=f"{r['data']} ({r['utterances']} utts)")
    ax.set_xticks([i + width * (len(flow) - 1) / 2 for i in range(len(FLOW_PEAKS))],
                  [name.removesuffix(" MB").replace(" RSS", "") for name in FLOW_PEAKS.values()], fontsize=7)
    ax.set_ylabel("peak RSS (MB)")
    ax.set_title("collect-stats flow: peak memory vs data size")
    ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # --child MODE INPUT OUTPUT_DIR REPORT
        mode, source, dest, report_path = sys.argv[2:]
        Path(report_path).write_text(json.dumps((child_flow if mode == "flow" else child_plan)(source, dest)))
    else:
        common.script_main(NAME)
