"""Benchmark: orchestration at scale — the collect-stats CLI at 1,000 and 4,000 shards of 30 utterances.

Issue "Orchestration at scale". Every flow run is the product's command line, in its own process:
``python flows/collect_stats.py manifests.train=M output_dir=OUT shard_size=30 parallel.env=local
parallel.n_workers=2`` (fbank frontend, the default), against the Prefect API server that
``python -m benchmarks`` starts once (so no run pays a server start). For each size, side by side:

- **engine cold**: the engine without Prefect in a fresh process (``CollectStatsRunner(cfg,
  "train").run(...)`` on a ``LocalCluster`` of the same 2 workers, see :func:`run_engine`);
- **flow cold** into a fresh output directory (engine cold and flow cold run 3 times each, interleaved,
  ``$ESPNET3_BENCH_SCALE_COLD_REPEATS``; the ratio target compares their medians); **no-op rerun**
  (the same command again, on the last cold run's output);
- **+10 % appended**: 10 % new utterances at the end of the manifest (ids sorting after the others);
- **+1 % inserted**: 1 % new utterances at random positions of the sorted manifest (ids
  ``<existing id>_ins``, which sort right after the existing id; the file stays sorted).

Each run's wall time, peak RSS of the driver and of every Dask worker (``process_tree.measured_run``,
whose module defines the peaks), the workers' peak when the 100th shard's ``done``
record appeared (to compare with their peak at the end), and the shards computed (the run's
``summary.json``; else ``done`` records newer than the run's start). For the insertion run, the
shards receiving a new utterance are read from the plan the run published
(``OUT/train/shards/manifest.json``).

The corpus: the benchmark corpus's first 300 utterances (2–6 s, 16 kHz, ``common.corpus_manifest``)
reused under new ids, one TSV ``utt_id<TAB>path`` sorted by id like a Kaldi data dir (ids
zero-padded, so sort order is numeric order). The fixed cost of a CLI run (interpreter, imports,
config, Prefect flow start, no server start) is the no-op rerun of a 10-utterance manifest.

Sizes: ``$ESPNET3_BENCH_SCALE_SHARDS`` (comma-separated shard counts; default 1000,4000; 60 with
``--quick``). Run ``python -m benchmarks --only scale [--quick]``.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from benchmarks import common
from benchmarks import process_tree
from benchmarks.cpu_time import cpu_per_task_ms, run_cpu_s
from benchmarks.process_tree import run_failed

NAME = "scale"
SHARD = 30
SOURCES = 300
MARK = 100
FIXED_UTTS = 10
ID_WIDTH = 7  # up to 9,999,999 utterances sort numerically
FLOW_RUNS = ("flow cold", "flow no-op rerun", "flow +10 % appended", "flow +1 % inserted")


# ---- the engine, in a child process -------------------------------------------------------
def engine_child(manifest: str, output_dir: str, shard_size: int, overrides: Sequence[str]) -> dict[str, Any]:
    """``CollectStatsRunner(cfg, "train").run(...)`` in this (fresh) process, 2 local workers."""
    from espnet3_flows.config import load_config
    from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner

    base = {"manifests": {"train": manifest}, "output_dir": output_dir, "shard_size": shard_size,
            "parallel": {"env": "local", "n_workers": common.WORKERS}}
    cfg = load_config(CollectStatsConfig, base=base, overrides=list(overrides))
    t0 = time.perf_counter()
    outcome = CollectStatsRunner(cfg, "train").run(parallel=cfg.parallel, progress=False)
    return {"seconds": time.perf_counter() - t0, "computed": outcome.computed, "cached": outcome.cached}


# ---- corpus ---------------------------------------------------------------------------------
def uid(i: int) -> str:
    return f"utt{i:0{ID_WIDTH}d}"


def manifests(n_shards: int) -> dict[str, Any]:
    """The size's manifests (``base``, ``append``: +10 % at the end, ``insert``: +1 % of that inside)
    and the ids inserted; written once under ``$ESPNET3_BENCH_DATA/scale`` (pure functions of the size)."""
    sources = common.manifest_paths(common.corpus_manifest(SOURCES))
    n = n_shards * SHARD
    n_app = n + n // 10
    rng = random.Random(n_shards)
    ids = [uid(i) for i in range(n_app)]
    path_of = {u: sources[i % len(sources)] for i, u in enumerate(ids)}
    inserted = sorted(u + "_ins" for u in rng.sample(ids, max(1, n_app // 100)))
    for u in inserted:
        path_of[u] = sources[rng.randrange(len(sources))]
    final = sorted(ids + inserted)
    assert final == sorted(final) and len(set(final)) == len(final)
    root = common.DATA / "scale" / f"shards{n_shards}"
    out = {"base": root / "base.tsv", "append": root / "append.tsv", "insert": root / "insert.tsv"}
    content = {"base": ids[:n], "append": ids, "insert": final}
    for key, path in out.items():
        if not path.exists():
            common.write_lines(path, (f"{u}\t{path_of[u]}\n" for u in content[key]))
    return {**out, "utterances": {k: len(v) for k, v in content.items()}, "inserted": inserted,
            "insert_ids": final}


def fixed_manifest() -> Path:
    sources = common.manifest_paths(common.corpus_manifest(SOURCES))
    path = common.DATA / "scale" / f"fixed{FIXED_UTTS}.tsv"
    if not path.exists():
        common.write_lines(path, (f"{uid(i)}\t{sources[i]}\n" for i in range(FIXED_UTTS)))
    return path


# ---- runs -----------------------------------------------------------------------------------
def flow_args(manifest: Path, out: Path) -> list[str]:
    return [f"manifests.train={manifest}", f"output_dir={out}", f"shard_size={SHARD}", "parallel.env=local",
            f"parallel.n_workers={common.WORKERS}"]


def receiving_shards(plan_path: Path, ids: list[str], new_ids: Sequence[str]) -> tuple[int | None, int | None, str]:
    """(shards holding at least one new id, shards in the plan, how it was read) from the plan a run
    published; ``(None, ..., why)`` when it cannot be read or does not cover ``ids``."""
    from espnet3_flows.sharding import ShardPlan

    try:
        plan = ShardPlan.from_dict(json.loads(plan_path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, None, f"no readable plan at {plan_path} ({type(exc).__name__})"
    if plan.num_items != len(ids):
        return None, len(plan.shards), f"the plan covers {plan.num_items} items, the manifest has {len(ids)}"
    pos = {u: i for i, u in enumerate(ids)}
    new_pos = sorted(pos[u] for u in new_ids)
    hit = 0
    for s in plan.shards:
        k = bisect.bisect_left(new_pos, s.start)
        hit += k < len(new_pos) and new_pos[k] < s.stop
    return hit, len(plan.shards), "item ranges of the published plan"


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``scale.json`` / ``.png`` and return the result."""
    env_sizes = os.environ.get("ESPNET3_BENCH_SCALE_SHARDS")
    sizes = [int(s) for s in env_sizes.split(",") if s.strip()] if env_sizes else ([60] if quick else [1000, 4000])
    plans = {n: manifests(n) for n in sizes}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def measured(label: str, manifest: Path, out: Path, mark: int | None = None, **row: Any) -> dict[str, Any]:
        engine = [*common.module_command(__spec__.name), "--engine", str(manifest), str(out), str(SHARD)]
        cmd = engine if row["section"] == "engine" else process_tree.flow_cli("collect_stats", *flow_args(manifest, out))
        shown = f"{row['utterances']:,} utterances {label}" + (f" #{row['rep']}" if row.get("rep") else "")
        rows.append({**row, **process_tree.measured_run(NAME, shown, cmd, out, quick, mark), "run": label})
        return rows[-1]

    out = common.scratch("scale-fixed")
    try:
        for label in ("fixed cold", "fixed no-op rerun"):
            measured(label, fixed_manifest(), out, shards=1, utterances=FIXED_UTTS, section="fixed")
    finally:
        common.clean_scratch(out)
    fixed_wall = rows[-1]["wall_s"] if rows[-1]["ok"] else None

    for n_shards in sizes:
        plan = plans[n_shards]
        mark = min(MARK, max(1, n_shards // 6))
        u = plan["utterances"]
        eng_out, out = common.scratch(f"scale-engine-{n_shards}"), common.scratch(f"scale-flow-{n_shards}")
        try:
            repeats = cold_repeats(quick)
            for rep in range(1, repeats + 1):  # engine and flow cold, interleaved: their ratio is taken of medians
                measured("engine cold", plan["base"], eng_out, mark, shards=n_shards, utterances=u["base"],
                         section="engine", rep=rep)
                common.clean_scratch(eng_out)
                if rep < repeats:  # the last flow cold run is the next step's; its output is kept
                    measured("flow cold", plan["base"], out, mark, shards=n_shards, utterances=u["base"],
                             section="flow", rep=rep)
                    common.clean_scratch(out)
            cold = measured("flow cold", plan["base"], out, mark, shards=n_shards, utterances=u["base"], section="flow",
                            rep=repeats)
            for label, key in zip(FLOW_RUNS[1:], ("base", "append", "insert"), strict=True):
                if not cold["ok"]:
                    rows.append({"shards": n_shards, "utterances": u[key], "section": "flow", "run": label,
                                 "ok": False, "rc": None, "killed": None, "skipped": "the cold flow run failed"})
                    continue
                measured(label, plan[key], out, shards=n_shards, utterances=u[key], section="flow")
            if cold["ok"]:  # the last row is the insertion's
                hit, total, how = receiving_shards(out / "train" / "shards" / "manifest.json",
                                                   plan["insert_ids"], plan["inserted"])
                rows[-1].update(inserted_utterances=len(plan["inserted"]), shards_receiving_new=hit,
                                plan_shards=total, receiving_from=how)
                if hit is None:
                    notes.append(f"{n_shards} shards: shards receiving a new item not computable: {how}.")
        finally:
            common.clean_scratch(eng_out)
            common.clean_scratch(out)

    targets = make_targets(rows, sizes, fixed_wall)
    notes = _notes(sizes, quick, fixed_wall, notes)
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path),
                               sizes_shards=sizes, shard_size=SHARD, fixed_cost_s=fixed_wall)


def _notes(sizes: list[int], quick: bool, fixed_wall: float | None, found: list[str]) -> list[str]:
    """The result's notes (what ran, how to read it), then ``found`` (what the runs reported)."""
    notes = [
        f"Sizes {', '.join(f'{n:,} shards ({n * SHARD:,} utterances)' for n in sizes)}; shard_size {SHARD}, "
        f"{common.WORKERS} local workers × 1 thread, fbank frontend; the engine and the flow run cold "
        f"{cold_repeats(quick)} time(s) each, interleaved (the ratio target compares their medians), every other run "
        "once (a 4,000-shard lifecycle takes tens of minutes), so compare rows of the same run, not across runs.",
        f"Corpus: {SOURCES} distinct 2–6 s 16 kHz WAVs reused under new ids; TSV sorted by id. +10 %: new ids after "
        "the others; +1 %: ids '<existing id>_ins' at random positions of the appended manifest (the run after "
        "the +10 % one).",
        "Every run is a fresh process: the flow is `python flows/collect_stats.py manifests.train=M output_dir=OUT "
        f"shard_size={SHARD} parallel.env=local parallel.n_workers={common.WORKERS}`; the engine is "
        "`CollectStatsRunner(cfg, 'train').run(parallel=cfg.parallel)` in `python -m benchmarks.bench_scale --engine`. "
        "Wall time is the whole process (interpreter start, imports, cluster start and stop, merge). The flow "
        "runs share the Prefect API server `python -m benchmarks` started: no run pays a server start"
        + (f" (that server started in {common.PREFECT['start_seconds']:.1f} s)." if common.PREFECT.get("start_seconds")
           else "."),
        f"Fixed cost of a CLI run: the no-op rerun of a {FIXED_UTTS}-utterance manifest"
        + (f", {fixed_wall:.1f} s; the no-op target allows it on top of 5 % of the cold run."
           if fixed_wall is not None else " failed; the no-op target then allows nothing on top of 5 %."),
        process_tree.cli_runs_note(NAME, quick) + " 'Worker at mark' is the largest worker peak when the "
        f"{MARK}th shard's done record appeared (fewer at small sizes: see worker_mark); the target compares the "
        "peak at the end with it.",
        "CPU s: user + system seconds of every process the run started (exact: they are waited for here, orphans "
        "adopted through prctl's subreaper) plus the shared Prefect server's own CPU meanwhile (none with an "
        "inherited PREFECT_API_URL). CPU per Prefect task run: the cold flow's median less the cold engine's, "
        "over the shards the flow computed: what a task run per shard costs the driver, workers and server.",
        "Shards computed: the run's summary.json (shards_computed), else the done records it wrote. Shards "
        "receiving a new item: from the plan the insertion run published (shards/manifest.json).",
        *found,
    ]
    if len(sizes) < 2:
        notes.append("One size only: the 4,000-vs-1,000-shard driver target needs two sizes (full run).")
    return notes


def cold_repeats(quick: bool) -> int:
    """How often the engine and the flow run cold, interleaved (``$ESPNET3_BENCH_SCALE_COLD_REPEATS``;
    3, or 1 with ``--quick``): on a shared machine one pair's ratio moved between 1.28 and 1.67."""
    return max(1, int(os.environ.get("ESPNET3_BENCH_SCALE_COLD_REPEATS") or (1 if quick else 3)))


def _find(rows: list[dict[str, Any]], shards: int, run_label: str) -> dict[str, Any] | None:
    """The last row of a run (for ``flow cold``: the one the rerun steps continued)."""
    return next((r for r in reversed(rows) if r.get("shards") == shards and r["run"] == run_label), None)


def _median_wall(rows: list[dict[str, Any]], shards: int, run_label: str) -> float | None:
    """The median wall time of a run's repetitions, ``None`` if any failed."""
    walls = [r["wall_s"] for r in rows if r.get("shards") == shards and r["run"] == run_label]
    if not walls or any(not r.get("ok") for r in rows if r.get("shards") == shards and r["run"] == run_label):
        return None
    return float(statistics.median(walls))


def make_targets(rows: list[dict[str, Any]], sizes: list[int], fixed_wall: float | None) -> list[dict[str, Any]]:
    """The issue's targets, per size where it names none."""
    t: list[dict[str, Any]] = []
    for n in sizes:
        per_task = cpu_per_task_ms(rows, n)
        t.append(common.target(f"{n:,} shards: CPU per Prefect task run, ms (driver + workers + server; cold flow "
                               "less cold engine, medians, over the shards computed)", "≤ 10", per_task,
                               isinstance(per_task, float) and per_task <= 10))
        engine, cold = _find(rows, n, "engine cold"), _find(rows, n, "flow cold")
        noop, app, ins = (_find(rows, n, k) for k in FLOW_RUNS[1:])
        bad = run_failed(cold) or run_failed(engine)
        engine_wall, cold_wall = _median_wall(rows, n, "engine cold"), _median_wall(rows, n, "flow cold")
        bad = bad or (None if engine_wall and cold_wall else "a repetition failed")
        ratio = None if bad else cold_wall / engine_wall
        reps = sum(r["run"] == "engine cold" and r.get("shards") == n for r in rows)
        t.append(common.target(f"{n:,} shards: cold flow wall / engine cold wall (medians of {reps}, interleaved)",
                               "≤ 1.3", bad or round(ratio, 3), not bad and ratio <= 1.3))
        bad = run_failed(noop) or run_failed(cold)
        allowed = None if bad else 0.05 * cold["wall_s"] + (fixed_wall or 0.0)
        t.append(common.target(f"{n:,} shards: no-op rerun wall (s)", "≤ 0.05 × cold + fixed CLI cost",
                               bad or f"{noop['wall_s']:.1f} (allowed {allowed:.1f})",
                               not bad and noop["wall_s"] <= allowed))
        bad = run_failed(app) or run_failed(cold)
        ratio = None if bad else app["wall_s"] / cold["wall_s"]
        t.append(common.target(f"{n:,} shards: +10 % appended, wall / cold", "≤ 0.2", bad or round(ratio, 3),
                               not bad and ratio <= 0.2))
        bad = run_failed(ins)
        hit = None if bad else ins.get("shards_receiving_new")
        if bad or hit is None:
            why = bad or "shards receiving a new item unknown (see notes)"
            t.append(common.target(f"{n:,} shards: +1 % inserted, shards computed", "≤ receiving + 2", why, False))
            t.append(common.target(f"{n:,} shards: +1 % inserted, wall", "≤ (receiving / shards) × cold + 0.05 × cold",
                                   why, False))
        else:
            t.append(common.target(f"{n:,} shards: +1 % inserted, shards computed", "≤ receiving + 2",
                                   f"{ins['shards_computed']} (receiving {hit} of {ins['plan_shards']})",
                                   ins["shards_computed"] is not None and ins["shards_computed"] <= hit + 2))
            bad = run_failed(cold)
            allowed = None if bad else (hit / ins["plan_shards"] + 0.05) * cold["wall_s"]
            t.append(common.target(f"{n:,} shards: +1 % inserted, wall (s)", "≤ (receiving / shards) × cold + 0.05 × cold",
                                   bad or f"{ins['wall_s']:.1f} (allowed {allowed:.1f})",
                                   not bad and ins["wall_s"] <= allowed))
    flow_peaks = {n: [r.get("driver_peak_mb") for r in rows if r.get("shards") == n and r.get("section") == "flow"
                      and r.get("driver_peak_mb") is not None] for n in sizes}
    small, large = sizes[0], sizes[-1]
    peak_small = max(flow_peaks[small], default=None)
    t.append(common.target(f"{small:,} shards: driver peak RSS, largest over the flow runs (MB)", "≤ 1 GB (1024 MB)",
                           peak_small if peak_small is not None else "not measured",
                           peak_small is not None and peak_small <= 1024))
    if len(sizes) > 1:
        peak_large = max(flow_peaks[large], default=None)
        ratio = peak_large / peak_small if peak_large and peak_small else None
        t.append(common.target(f"driver peak RSS, {large:,} / {small:,} shards", "≤ 1.2",
                               round(ratio, 3) if ratio else "not measured", ratio is not None and ratio <= 1.2))
    cold = _find(rows, large, "flow cold")
    bad = run_failed(cold)
    at_mark = None if bad else cold.get("worker_peak_at_mark_mb")
    if bad or not at_mark:
        t.append(common.target(f"{large:,} shards, cold flow: worker peak at the end / after the first shards",
                               "≤ 1.2", bad or "mark not reached", False))
    else:
        ratio = cold["worker_peak_mb"] / at_mark
        t.append(common.target(f"{large:,} shards, cold flow: worker peak at the end / after the first "
                               f"{cold['worker_mark']} shards", "≤ 1.2", round(ratio, 3), ratio <= 1.2))
    return t


def table(result: dict[str, Any]) -> str:
    """Markdown table of a result."""
    fmt = common.fmt
    colds = {r["shards"]: r["wall_s"] for r in result["rows"] if r["run"] == "flow cold" and r.get("ok")}  # the last

    lines = []
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append([r["shards"], r["utterances"], r["run"], *["–"] * 8, process_tree.run_status(r)])
            continue
        if r.get("rep"):
            r = {**r, "run": f"{r['run']} #{r['rep']}"}
        cold = colds.get(r["shards"])
        ratio = f"{r['wall_s'] / cold:.3f}" if cold and r["section"] == "flow" else "–"
        computed = fmt(r.get("shards_computed"))
        if r.get("shards_receiving_new") is not None:
            computed += f" (receiving {r['shards_receiving_new']})"
        cpu = run_cpu_s(r)
        lines.append([r["shards"], r["utterances"], r["run"], f"{r['wall_s']:.1f}", fmt(cpu, 1), ratio, computed,
                      *(fmt(r.get(k), 0) for k in ("shards_cached", "driver_peak_mb", "worker_peak_mb",
                                                   "worker_peak_at_mark_mb")), process_tree.run_status(r)])
    return common.markdown_table(["shards", "utterances", "run", "wall s", "CPU s", "/ cold flow", "shards computed",
                                  "cached", "driver peak MB", "worker peak MB", "worker peak at mark MB", "status"],
                                 lines, "rrlrrrrrrrrl")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    sizes = sorted({r["shards"] for r in rows if r["section"] != "fixed"})
    labels = ["engine cold", *FLOW_RUNS]
    width = 0.8 / max(1, len(sizes))
    for k, n in enumerate(sizes):
        walls = [(_find(rows, n, lab) or {}).get("wall_s") or 0.0 for lab in labels]
        ax.bar([i + k * width for i in range(len(labels))], walls, width, label=f"{n:,} shards")
    ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(labels))],
                  [lab.replace("flow ", "") for lab in labels], rotation=20)
    ax.set_ylabel("wall s (whole process)")
    ax.set_title(f"collect-stats CLI at scale, shard_size {SHARD}")
    ax.legend()
    cold = _find(rows, sizes[-1], "flow cold") if sizes else None
    series = (cold or {}).get("series") or []
    if series:
        t = [s[0] for s in series]
        ax2.plot(t, [s[1] / 1024 ** 2 for s in series], label="driver RSS")
        ax2.plot(t, [s[2] / 1024 ** 2 for s in series], label="largest worker RSS")
        ax2.set_xlabel("s since start")
        ax2.set_ylabel("MB")
        ax2.set_title(f"cold flow, {sizes[-1]:,} shards: memory over time")
        ax2.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:  # --engine MANIFEST OUTPUT_DIR SHARD_SIZE [OVERRIDES]
        manifest, output_dir, shard_size, *overrides = sys.argv[2:]
        print(json.dumps(engine_child(manifest, output_dir, int(shard_size), overrides)))
    else:
        common.script_main(NAME)
