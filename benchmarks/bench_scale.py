"""Benchmark: orchestration at scale — the collect-stats CLI at 1,000 and 4,000 shards of 30 utterances.

Issue "Orchestration at scale". Every flow run is the product's command line, in its own process:
``python flows/collect_stats.py manifests.train=M output_dir=OUT shard_size=30 parallel.env=local
parallel.n_workers=2`` (fbank frontend, the default), against the Prefect API server that
``benchmarks/run.py`` starts once (so no run pays a server start). For each size, side by side:

- **engine cold**: the engine without Prefect in a fresh process (``CollectStatsRunner(cfg,
  "train").run(...)`` on a ``LocalCluster`` of the same 2 workers, see :func:`run_engine`);
- **flow cold** into a fresh output directory (engine cold and flow cold run 3 times each, interleaved,
  ``$ESPNET3_BENCH_SCALE_COLD_REPEATS``; the ratio target compares their medians); **no-op rerun**
  (the same command again, on the last cold run's output);
- **+10 % appended**: 10 % new utterances at the end of the manifest (ids sorting after the others);
- **+1 % inserted**: 1 % new utterances at random positions of the sorted manifest (ids
  ``<existing id>_ins``, which sort right after the existing id; the file stays sorted).

Each run's wall time, peak RSS of the driver and of every Dask worker (``common.run_monitored``:
psutil tree + /proc ``VmHWM`` every 0.2 s), the workers' peak when the 100th shard's ``done``
record appeared (to compare with their peak at the end), and the shards computed (the run's
``summary.json``; else ``done`` records newer than the run's start). For the insertion run, the
shards receiving a new utterance are read from the plan the run published
(``OUT/train/shards/manifest.json``).

The corpus: the benchmark corpus's first 300 utterances (2–6 s, 16 kHz, ``common.corpus_manifest``)
reused under new ids, one TSV ``utt_id<TAB>path`` sorted by id like a Kaldi data dir (ids
zero-padded, so sort order is numeric order). The fixed cost of a CLI run (interpreter, imports,
config, Prefect flow start, no server start) is the no-op rerun of a 10-utterance manifest.

Sizes: ``$ESPNET3_BENCH_SCALE_SHARDS`` (comma-separated shard counts; default 1000,4000; 60 with
``--quick``). Run ``python benchmarks/run.py --only scale [--quick]``.
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
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

NAME = "scale"
SHARD = 30
WORKERS = 2
SOURCES = 300
MARK = 100
FIXED_UTTS = 10
ID_WIDTH = 7  # up to 9,999,999 utterances sort numerically
FLOW_RUNS = ("flow cold", "flow no-op rerun", "flow +10 % appended", "flow +1 % inserted")


# ---- the engine, in a child process -------------------------------------------------------
def run_engine(runner: Any, cfg: Any, n_items: Callable[[], int]) -> Any:
    """Run the engine once over the whole manifest: the only place that knows both ``run`` APIs.

    ``run(parallel=...)`` plans the manifest's items itself (the engine after the orchestration
    refactor); the older engine needs the item indices: ``run(range(n), parallel=...)``.
    """
    try:
        return runner.run(parallel=cfg.parallel, progress=False)
    except TypeError as exc:
        msg = str(exc)
        if "indices" not in msg or "argument" not in msg:
            raise
        return runner.run(range(n_items()), parallel=cfg.parallel, progress=False)


def engine_child(manifest: str, output_dir: str, shard_size: int, overrides: Sequence[str]) -> dict[str, Any]:
    """``CollectStatsRunner(cfg, "train").run(...)`` in this (fresh) process, 2 local workers."""
    from espnet3_flows.config import load_config
    from espnet3_flows.stats.job import CollectStatsConfig, CollectStatsRunner

    base = {"manifests": {"train": manifest}, "output_dir": output_dir, "shard_size": shard_size,
            "parallel": {"env": "local", "n_workers": WORKERS}}
    cfg = load_config(CollectStatsConfig, base=base, overrides=list(overrides))
    t0 = time.perf_counter()
    outcome = run_engine(CollectStatsRunner(cfg, "train"), cfg, lambda: count_items(Path(manifest)))
    return {"seconds": time.perf_counter() - t0, "computed": getattr(outcome, "computed", None),
            "cached": getattr(outcome, "cached", None)}


def count_items(manifest: Path) -> int:
    """Utterance lines of a TSV manifest (blank lines and ``#`` comments are not items)."""
    with open(manifest) as handle:
        return sum(1 for line in handle if line.strip() and not line.startswith("#"))


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
            f"parallel.n_workers={WORKERS}"]


def timeout_s(quick: bool) -> float:
    return float(os.environ.get("ESPNET3_BENCH_RUN_TIMEOUT_S") or (600 if quick else 2400))


def measured_run(label: str, cmd: list[str], out: Path, logs: Path, quick: bool, mark: int | None) -> dict[str, Any]:
    """One monitored run; returns a row (bytes → MB, shards computed)."""
    since = time.time()
    log = logs / f"{label.replace(' ', '_').replace('%', 'pct').replace('+', 'plus')}.log"
    print(f"[bench] {NAME}: {label} ...", flush=True)
    res = common.run_monitored(cmd, log, timeout_s=timeout_s(quick), mark=mark,
                               progress=lambda: common.count_done_since(out, since))
    summary = common.fresh_summary(out, since)
    new_done = common.count_done_since(out, since)
    at_mark = res["at_mark"]
    row = {
        "run": label, "rc": res["rc"], "killed": res["killed"], "ok": res["rc"] == 0 and not res["killed"],
        "wall_s": round(res["wall_s"], 2), "log": res["log"],
        "shards_computed": summary.get("shards_computed", new_done) if summary else new_done,
        "shards_cached": summary.get("shards_cached") if summary else None,
        "done_records_written": new_done,
        "summary_utterances": summary.get("utterances") if summary else None,
        "driver_peak_mb": common.mb(res["driver_peak"]), "worker_peak_mb": common.mb(res["worker_peak"]),
        "worker_peaks_mb": [common.mb(v) for v in res["worker_peaks"]], "workers_seen": res["workers_seen"],
        "forkserver_peak_mb": common.mb(res["forkserver_peak"]),
        "workers_sum_peak_mb": common.mb(res["workers_sum_peak"]),
        "worker_mark": mark, "worker_peak_at_mark_mb": common.mb(at_mark["worker_peak"]) if at_mark else None,
        "worker_rss_at_mark_mb": common.mb(at_mark["worker_rss"]) if at_mark else None,
        "worker_rss_end_mb": common.mb(res["worker_last_rss"]),
        "mark_reached_s": round(at_mark["t"], 2) if at_mark else None,
        "series": res["series"],
    }
    state = "ok" if row["ok"] else f"FAILED rc={res['rc']} killed={res['killed']} (log {log})"
    print(f"[bench] {NAME}: {label}: {row['wall_s']:.1f} s, computed {row['shards_computed']}, "
          f"driver {row['driver_peak_mb']} MB, worker {row['worker_peak_mb']} MB, {state}", flush=True)
    return row


def receiving_shards(plan_path: Path, ids: list[str], new_ids: Sequence[str]) -> tuple[int | None, int | None, str]:
    """(shards holding at least one new id, shards in the plan, how it was read) from a published plan.

    Understands shards given as item ranges (``start``/``stop``), item ``indices`` or first/last
    utterance ids; anything else is ``(None, None, why)``.
    """
    try:
        data = json.loads(plan_path.read_text())
    except (OSError, ValueError) as exc:
        return None, None, f"no readable plan at {plan_path} ({type(exc).__name__})"
    shards = data.get("shards") if isinstance(data, dict) else data
    if not isinstance(shards, list) or not shards or not all(isinstance(s, dict) for s in shards):
        return None, None, "the plan lists no shards"
    pos = {u: i for i, u in enumerate(ids)}
    new_pos = sorted(pos[u] for u in new_ids)
    first_keys = [k for k in ("first_id", "first", "start_id", "first_utt", "first_key") if k in shards[0]]
    last_keys = [k for k in ("last_id", "last", "stop_id", "last_utt", "last_key") if k in shards[0]]
    hit = 0
    if all("start" in s and "stop" in s for s in shards):
        covered = sum(int(s["stop"]) - int(s["start"]) for s in shards)
        if covered != len(ids):
            return None, len(shards), f"plan ranges cover {covered} items, the manifest has {len(ids)}"
        for s in shards:
            if "indices" in s:
                members = {int(i) for i in s["indices"]}
                hit += any(p in members for p in new_pos)
            else:
                k = bisect.bisect_left(new_pos, int(s["start"]))
                hit += k < len(new_pos) and new_pos[k] < int(s["stop"])
        return hit, len(shards), "item ranges (start/stop) of the published plan"
    if first_keys and last_keys:
        fk, lk = first_keys[0], last_keys[0]
        new_sorted = sorted(new_ids)
        for s in shards:
            k = bisect.bisect_left(new_sorted, str(s[fk]))
            hit += k < len(new_sorted) and new_sorted[k] <= str(s[lk])
        return hit, len(shards), f"first/last ids ({fk}/{lk}) of the published plan"
    return None, len(shards), f"unknown shard format (keys {sorted(shards[0])})"


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``scale.json`` / ``.png`` and return the result."""
    env_sizes = os.environ.get("ESPNET3_BENCH_SCALE_SHARDS")
    sizes = [int(s) for s in env_sizes.split(",") if s.strip()] if env_sizes else ([60] if quick else [1000, 4000])
    logs = common.DATA / "logs" / NAME
    logs.mkdir(parents=True, exist_ok=True)
    plans = {n: manifests(n) for n in sizes}
    fixed = fixed_manifest()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    out = common.scratch("scale-fixed")
    try:
        for label in ("fixed cold", "fixed no-op rerun"):
            r = measured_run(f"{FIXED_UTTS} utts {label}", common.flow_cli("collect_stats", *flow_args(fixed, out)),
                             out, logs, quick, None)
            rows.append({"shards": 1, "utterances": FIXED_UTTS, "section": "fixed", **r})
    finally:
        common.clean_scratch(out)
    fixed_row = rows[-1]
    fixed_wall = fixed_row["wall_s"] if fixed_row["ok"] else None

    for n_shards in sizes:
        plan = plans[n_shards]
        mark = min(MARK, max(1, n_shards // 6))
        u = plan["utterances"]
        eng_out, out = common.scratch(f"scale-engine-{n_shards}"), common.scratch(f"scale-flow-{n_shards}")
        try:
            repeats = cold_repeats(quick)
            for rep in range(repeats):  # engine and flow cold, interleaved: their ratio is taken of medians
                r = measured_run(f"{n_shards} shards engine cold #{rep + 1}",
                                 [sys.executable, __file__, "--engine", str(plan["base"]), str(eng_out), str(SHARD)],
                                 eng_out, logs, quick, mark)
                rows.append({"shards": n_shards, "utterances": u["base"], "section": "engine", **r, "run": "engine cold",
                             "rep": rep + 1})
                common.clean_scratch(eng_out)
                if rep < repeats - 1:  # the last flow cold run is the next step's; its output is kept
                    r = measured_run(f"{n_shards} shards flow cold #{rep + 1}",
                                     common.flow_cli("collect_stats", *flow_args(plan["base"], out)), out, logs, quick, mark)
                    rows.append({"shards": n_shards, "utterances": u["base"], "section": "flow", **r, "run": "flow cold",
                                 "rep": rep + 1})
                    common.clean_scratch(out)
            steps = [("flow cold", plan["base"], u["base"]), ("flow no-op rerun", plan["base"], u["base"]),
                     ("flow +10 % appended", plan["append"], u["append"]),
                     ("flow +1 % inserted", plan["insert"], u["insert"])]
            cold_ok = True
            for label, manifest, n_utts in steps:
                if not cold_ok:
                    rows.append({"shards": n_shards, "utterances": n_utts, "section": "flow", "run": label,
                                 "ok": False, "rc": None, "killed": None, "skipped": "the cold flow run failed"})
                    continue
                r = measured_run(f"{n_shards} shards {label}", common.flow_cli("collect_stats", *flow_args(manifest, out)),
                                 out, logs, quick, mark if label == "flow cold" else None)
                row = {"shards": n_shards, "utterances": n_utts, "section": "flow", **r, "run": label}
                if label == "flow cold":
                    row["rep"] = repeats
                if label == "flow cold":
                    cold_ok = r["ok"]
                if label == "flow +1 % inserted":
                    hit, total, how = receiving_shards(out / "train" / "shards" / "manifest.json",
                                                       plan["insert_ids"], plan["inserted"])
                    row.update(inserted_utterances=len(plan["inserted"]), shards_receiving_new=hit,
                               plan_shards=total, receiving_from=how)
                    if hit is None:
                        notes.append(f"{n_shards} shards: shards receiving a new item not computable: {how}.")
                rows.append(row)
        finally:
            common.clean_scratch(eng_out)
            common.clean_scratch(out)

    targets = make_targets(rows, sizes, fixed_wall)
    notes = [
        f"Sizes {', '.join(f'{n:,} shards ({n * SHARD:,} utterances)' for n in sizes)}; shard_size {SHARD}, "
        f"{WORKERS} local workers × 1 thread, fbank frontend; the engine and the flow run cold "
        f"{cold_repeats(quick)} time(s) each, interleaved (the ratio target compares their medians), every other run "
        "once (a 4,000-shard lifecycle takes tens of minutes), so compare rows of the same run, not across runs.",
        f"Corpus: {SOURCES} distinct 2–6 s 16 kHz WAVs reused under new ids; TSV sorted by id. +10 %: new ids after "
        "the others; +1 %: ids '<existing id>_ins' at random positions of the appended manifest (the run after "
        "the +10 % one).",
        "Every run is a fresh process: the flow is `python flows/collect_stats.py manifests.train=M output_dir=OUT "
        f"shard_size={SHARD} parallel.env=local parallel.n_workers={WORKERS}`; the engine is "
        "`CollectStatsRunner(cfg, 'train').run(parallel=cfg.parallel)` in `python benchmarks/bench_scale.py --engine`. "
        "Wall time is the whole process (interpreter start, imports, cluster start and stop, merge). The flow "
        "runs share the Prefect API server benchmarks/run.py started: no run pays a server start"
        + (f" (that server started in {common.PREFECT['start_seconds']:.1f} s)." if common.PREFECT.get("start_seconds")
           else "."),
        f"Fixed cost of a CLI run: the no-op rerun of a {FIXED_UTTS}-utterance manifest"
        + (f", {fixed_wall:.1f} s; the no-op target allows it on top of 5 % of the cold run."
           if fixed_wall is not None else " failed; the no-op target then allows nothing on top of 5 %."),
        "Memory: peak RSS (/proc VmHWM, sampled every 0.2 s) of the driver (the CLI process) and of each Dask "
        "worker (a descendant whose command line is a multiprocessing forkserver/spawn child); RSS counts pages "
        "shared with the forkserver (torch, lhotse). 'worker at mark' is the largest worker peak when the "
        f"{MARK}th shard's done record appeared (fewer at small sizes: see worker_mark) — the target compares "
        "the peak at the end with it. A run whose process tree passes "
        f"{common.MEM_LIMIT_BYTES / 1024 ** 3:.1f} GB is killed (ESPNET3_BENCH_MEM_LIMIT_MB) and recorded, as is one "
        f"that runs past {timeout_s(quick):.0f} s (ESPNET3_BENCH_RUN_TIMEOUT_S).",
        "Shards computed: the run's summary.json (shards_computed), else the done records it wrote. Shards "
        "receiving a new item: from the plan the insertion run published (shards/manifest.json).",
        f"Logs of every run: {logs}.",
        *notes,
    ]
    if len(sizes) < 2:
        notes.append("One size only: the 4,000-vs-1,000-shard driver target needs two sizes (full run).")
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path),
                               sizes_shards=sizes, shard_size=SHARD, fixed_cost_s=fixed_wall)


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


def _failed(row: dict[str, Any] | None) -> str | None:
    if row is None:
        return "not run"
    if row.get("skipped"):
        return f"skipped ({row['skipped']})"
    if not row.get("ok"):
        return f"failed (rc {row.get('rc')}{', killed: ' + row['killed'] if row.get('killed') else ''})"
    return None


def make_targets(rows: list[dict[str, Any]], sizes: list[int], fixed_wall: float | None) -> list[dict[str, Any]]:
    """The issue's targets, per size where it names none."""
    t: list[dict[str, Any]] = []
    for n in sizes:
        engine, cold = _find(rows, n, "engine cold"), _find(rows, n, "flow cold")
        noop, app, ins = (_find(rows, n, k) for k in FLOW_RUNS[1:])
        bad = _failed(cold) or _failed(engine)
        engine_wall, cold_wall = _median_wall(rows, n, "engine cold"), _median_wall(rows, n, "flow cold")
        bad = bad or (None if engine_wall and cold_wall else "a repetition failed")
        ratio = None if bad else cold_wall / engine_wall
        reps = sum(r["run"] == "engine cold" and r.get("shards") == n for r in rows)
        t.append(common.target(f"{n:,} shards: cold flow wall / engine cold wall (medians of {reps}, interleaved)",
                               "≤ 1.3", bad or round(ratio, 3), not bad and ratio <= 1.3))
        bad = _failed(noop) or _failed(cold)
        allowed = None if bad else 0.05 * cold["wall_s"] + (fixed_wall or 0.0)
        t.append(common.target(f"{n:,} shards: no-op rerun wall (s)", "≤ 0.05 × cold + fixed CLI cost",
                               bad or f"{noop['wall_s']:.1f} (allowed {allowed:.1f})",
                               not bad and noop["wall_s"] <= allowed))
        bad = _failed(app) or _failed(cold)
        ratio = None if bad else app["wall_s"] / cold["wall_s"]
        t.append(common.target(f"{n:,} shards: +10 % appended, wall / cold", "≤ 0.2", bad or round(ratio, 3),
                               not bad and ratio <= 0.2))
        bad = _failed(ins)
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
            bad = _failed(cold)
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
    bad = _failed(cold)
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
    colds = {r["shards"]: r["wall_s"] for r in result["rows"] if r["run"] == "flow cold" and r.get("ok")}  # the last

    def cell(v: Any, digits: int = 0) -> str:
        return "–" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    lines = []
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append([r["shards"], r["utterances"], r["run"], "–", "–", "–", "–", "–", "–", "–", "skipped"])
            continue
        if r.get("rep"):
            r = {**r, "run": f"{r['run']} #{r['rep']}"}
        cold = colds.get(r["shards"])
        ratio = f"{r['wall_s'] / cold:.3f}" if cold and r["section"] == "flow" else "–"
        computed = cell(r.get("shards_computed"))
        if r.get("shards_receiving_new") is not None:
            computed += f" (receiving {r['shards_receiving_new']})"
        status = "ok" if r.get("ok") else f"rc {r.get('rc')}" + (f", killed: {r['killed']}" if r.get("killed") else "")
        lines.append([r["shards"], r["utterances"], r["run"], f"{r['wall_s']:.1f}", ratio, computed,
                      cell(r.get("shards_cached")), cell(r.get("driver_peak_mb")), cell(r.get("worker_peak_mb")),
                      cell(r.get("worker_peak_at_mark_mb")), status])
    return common.markdown_table(["shards", "utterances", "run", "wall s", "/ cold flow", "shards computed",
                                  "cached", "driver peak MB", "worker peak MB", "worker peak at mark MB", "status"],
                                 lines, "rrlrrrrrrrl")


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
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engine", nargs=3, metavar=("MANIFEST", "OUTPUT_DIR", "SHARD_SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        manifest, output_dir, shard_size = args.engine
        print(json.dumps(engine_child(manifest, output_dir, int(shard_size), args.overrides)))
    else:
        with common.prefect_session():
            print(table(run(args.quick)))
