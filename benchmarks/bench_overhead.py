"""Benchmark: orchestration overhead — no-op reruns, per-shard cost vs shard size, incremental appends.

On the cached benchmark corpus (2,000 utterances of 2–6 s; 200 with ``--quick``):

- **No-op rerun**: a cold run into a fresh ``output_dir``, then the same run again (every shard
  cached), for the engine (``CollectStatsRunner.run`` on a warm 2-worker ``LocalCluster``) and
  for the flow (``run_job`` with ``parallel: {env: local, n_workers: 2}``). Target: rerun ≤ 10 %
  of the cold run.
- **Incremental**: then 10 % more utterances are appended to the manifest and the run repeated
  in the same ``output_dir``: shards and utterances computed, and wall time relative to the cold
  run (target ≤ 12 %). Only the last, partial shard and the new ones should be computed.
- **Per-shard overhead**: cold runs at shard sizes 8 … 256 on the same data, engine and flow.
  ``overhead = (wall − kernel work) / shards`` with kernel work = the 1-process kernel's seconds
  / 2 workers (measured in the same run), as asked; it also holds the workers' own slowness per
  utterance, so two cleaner figures are given: ``(wall − shard compute / 2) / shards`` (what the
  orchestration adds per shard beyond the workers' compute) and the slope of a least-squares fit
  ``wall = fixed + slope × shards`` over the sweep (the marginal wall cost of one more shard).

Run ``python -m benchmarks --only overhead [--quick]``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from benchmarks import bench_collect_stats as cs
from benchmarks import common

NAME = "overhead"


def _lifecycle(kind: str, n: int, n_more: int, shard_size: int, client: Any) -> dict[str, Any]:
    """Cold run, no-op rerun and incremental (+10 %) run in one output directory."""
    small, big = common.corpus_manifest(n), common.corpus_manifest(n_more)
    out = common.scratch(f"life-{kind}")

    def once(manifest: Path, count: int) -> dict[str, Any]:
        if kind == "engine":
            r = cs.engine_run(manifest, count, shard_size, client=client, output_dir=out)
        else:
            r = cs.flow_run(manifest, shard_size, output_dir=out)
        return r

    try:
        cold = once(small, n)
        noop = once(small, n)
        since = time.time() - 0.05
        inc = once(big, n_more)
        done = common.done_results(out, since)
        shards, items = len(done), sum(r.shard.num_items for _, r in done)
    finally:
        common.clean_scratch(out)
    return {"cold": cold["wall"], "noop": noop["wall"], "noop_computed": noop["computed"], "inc": inc["wall"],
            "inc_shards": shards, "inc_items": items, "inc_total_shards": inc["shards"], "cold_shards": cold["shards"]}


def _sweep_point(kind: str, manifest: Path, n: int, shard_size: int, client: Any) -> dict[str, Any]:
    r = cs.engine_run(manifest, n, shard_size, client=client) if kind == "engine" else cs.flow_run(manifest, shard_size)
    return {"wall": r["wall"], "shards": r["shards"], "compute": r["phase"]["compute"]}


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b)."""
    import numpy as np

    b, a = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(a), float(b)


@contextlib.contextmanager
def _engine_client(cluster_start: list[float]) -> Iterator[Any]:
    """A warm 2-worker cluster's client for the engine's runs (its start appended to ``cluster_start``).
    prefect-dask's DaskTaskRunner silently runs on any Dask client alive in the process instead of
    starting the configured cluster, so the engine's client lives only while the engine runs."""
    cluster, client, start = cs.start_cluster(trim=False)  # workers as the product's clusters start them
    cluster_start.append(start)
    try:
        warm = common.corpus_manifest(20)
        cs.engine_run(warm, 20, 10, client=client)  # worker imports and env, not timed
        yield client
    finally:
        client.close()
        cluster.close()


def _alternate(items: list[Any], rep: int) -> list[Any]:
    return items if rep % 2 == 0 else items[::-1]


def _grid(rep: int, sizes: list[int], point: Any, into: dict[tuple[str, int], list[dict[str, Any]]],
          cluster_start: list[float]) -> None:
    """One measurement per (runner kind, shard size), in alternating order; the engine's client lives only
    while the engine runs."""
    for kind in _alternate(["engine", "flow"], rep):
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(_engine_client(cluster_start)) if kind == "engine" else None
            for size in _alternate(sizes, rep):
                with common.preserved_environ():
                    into.setdefault((kind, size), []).append(point(kind, size, client))


def _lifecycle_rows(life: dict[tuple[str, int], list[dict[str, Any]]], n: int,
                    n_more: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and targets of the no-op rerun and the +10 % append, per runner kind and shard size."""
    rows: list[dict[str, Any]] = []
    targets = []
    for (kind, size), runs in life.items():
        cold = common.spread([r["cold"] for r in runs])
        noop = common.spread([r["noop"] for r in runs])
        inc = common.spread([r["inc"] for r in runs])
        noop_ratio = common.spread([r["noop"] / r["cold"] for r in runs])
        inc_ratio = common.spread([r["inc"] / r["cold"] for r in runs])
        r0 = runs[0]
        label = "engine (warm LocalCluster 2×1)" if kind == "engine" else "flow (Prefect + LocalCluster 2×1)"
        rows.append({"section": "rerun", "method": label, "utterances": n, "shard_size": size,
                     "cold_s": cold, "noop_s": noop, "noop_ratio": noop_ratio,
                     "noop_shards_computed": max(r["noop_computed"] for r in runs),
                     "shards": r0["cold_shards"]})
        rows.append({"section": "incremental", "method": label, "utterances": n_more, "appended": n_more - n,
                     "shard_size": size, "cold_s": cold, "incremental_s": inc, "incremental_ratio": inc_ratio,
                     "shards_computed": r0["inc_shards"], "shards_total": r0["inc_total_shards"],
                     "utterances_computed": r0["inc_items"],
                     "work_fraction_utterances": r0["inc_items"] / n})
        at = f"{kind}, shard_size {size}"
        targets.append(common.target(f"{at}: no-op rerun / cold run", "≤ 0.10", round(noop_ratio["median"], 3),
                                     noop_ratio["median"] <= 0.10))
        targets.append(common.target(f"{at}: +10 % appended, wall / cold run", "≤ 0.12",
                                     round(inc_ratio["median"], 3), inc_ratio["median"] <= 0.12))
        targets.append(common.target(f"{at}: +10 % appended, utterances computed / cold run's", "≤ 0.12",
                                     round(r0["inc_items"] / n, 3), r0["inc_items"] / n <= 0.12))
    return rows, targets


def _sweep_rows(sweep: dict[tuple[str, int], list[dict[str, Any]]], sizes: list[int], n: int,
                kernel_work: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of the shard-size sweep and, per runner kind, the fit ``wall = fixed + slope × shards``."""
    rows: list[dict[str, Any]] = []
    fits = {}
    for kind in ("engine", "flow"):
        xs, ys = [], []
        for size in sizes:
            runs = sweep[(kind, size)]
            shards = runs[0]["shards"]
            walls = [r["wall"] for r in runs]
            xs += [shards] * len(runs)
            ys += walls
            rows.append({"section": "per-shard", "method": kind, "utterances": n, "shard_size": size, "shards": shards,
                         "wall_s": common.spread(walls),
                         "overhead_ms_per_shard_vs_kernel": common.spread(
                             [1000 * (w - kernel_work) / shards for w in walls]),
                         "overhead_ms_per_shard_vs_worker_compute": common.spread(
                             [1000 * (r["wall"] - r["compute"] / common.WORKERS) / shards for r in runs]),
                         "worker_compute_s": common.spread([r["compute"] for r in runs])})
        fixed, slope = _fit(xs, ys)
        fits[kind] = {"fixed_s": fixed, "slope_ms_per_shard": 1000 * slope}
        rows.append({"section": "per-shard fit", "method": kind, "fixed_plus_compute_s": fixed,
                     "slope_ms_per_shard": 1000 * slope, "sizes": sizes})
    return rows, fits


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``overhead.json`` / ``.png`` and return the result."""
    n = 200 if quick else 2000
    n_more = n + n // 10
    reps = 1 if quick else 3
    sweep_reps = 1 if quick else 2
    sizes = [25, 100] if quick else [8, 16, 32, 64, 128, 256]
    manifest = common.corpus_manifest(n)
    common.corpus_manifest(n_more)
    paths = common.manifest_paths(manifest)
    kernel: list[float] = []
    life_sizes = [25] if quick else [common.SHARD_SIZE, 64]
    life: dict[tuple[str, int], list[dict[str, Any]]] = {}
    sweep: dict[tuple[str, int], list[dict[str, Any]]] = {}
    cluster_start: list[float] = []
    with common.prefect_session(), common.preserved_environ():
        cs.kernel_loop(paths[:5])
        for rep in range(reps):
            kernel.append(cs.kernel_loop(paths)["wall"])
            _grid(rep, life_sizes, lambda kind, size, client: _lifecycle(kind, n, n_more, size, client), life,
                  cluster_start)
            print(f"[bench] {NAME}: lifecycle repetition {rep + 1}/{reps} done")
        for rep in range(sweep_reps):
            _grid(rep, sizes, lambda kind, size, client: _sweep_point(kind, manifest, n, size, client), sweep,
                  cluster_start)
            kernel.append(cs.kernel_loop(paths)["wall"])
            print(f"[bench] {NAME}: sweep repetition {rep + 1}/{sweep_reps} done")

    kernel_s = common.spread(kernel)["median"]
    kernel_work = kernel_s / common.WORKERS
    rows, targets = _lifecycle_rows(life, n, n_more)
    sweep_rows, fits = _sweep_rows(sweep, sizes, n, kernel_work)
    rows += sweep_rows
    flow_walls = {size: common.spread([r["wall"] for r in sweep[("flow", size)]])["median"] for size in sizes}
    best = min(flow_walls.values())
    recommended = min(size for size, w in flow_walls.items() if w <= 1.05 * best)
    notes = [
        f"{n} utterances (2–6 s, 16 kHz); lifecycle (cold, no-op rerun, +10 %) at shard_size "
        f"{' and '.join(map(str, life_sizes))}, {reps} repetition(s); sweep "
        f"{sweep_reps} repetition(s) per size, sizes in alternating order; cells are median [min–max].",
        f"Kernel work = 1-process kernel {kernel_s:.2f} s (median of {len(kernel)}) / {common.WORKERS} workers = "
        f"{kernel_work:.2f} s.",
        "Engine runs get the client of a warm LocalCluster (started per group of runs, its start — median "
        f"{common.spread(cluster_start)['median']:.1f} s — is not in the engine's times), workers without "
        "MALLOC_TRIM_THRESHOLD_ like the product's clusters. Every flow run starts its own cluster: no Dask "
        "client is alive in the process then (prefect-dask would otherwise run the flow on it).",
        "The no-op rerun of the flow starts no cluster (every shard is done: cache hits on an in-process runner).",
        f"Shard size whose flow wall is within 5 % of the sweep's best: {recommended} (flow walls by size: "
        + ", ".join(f"{s}: {w:.1f} s" for s, w in flow_walls.items()) + ").",
    ]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda p: _plot(rows, p),
                               kernel_seconds=kernel_s, fits=fits, recommended_shard_size=recommended)


def table(result: dict[str, Any]) -> str:
    """Markdown tables of a result: reruns and appends, then the per-shard sweep."""
    f = common.fmt
    life = []
    for r in result["rows"]:
        if r["section"] == "rerun":
            life.append([r["method"], r["shard_size"], "no-op rerun", r["shards"], 0, f(r["cold_s"]), f(r["noop_s"]),
                         f(r["noop_ratio"], 3)])
        elif r["section"] == "incremental":
            life.append([r["method"], r["shard_size"], f"+{r['appended']} utts appended",
                         f"{r['shards_computed']}/{r['shards_total']}",
                         f"{r['utterances_computed']} ({100 * r['work_fraction_utterances']:.1f} %)",
                         f(r["cold_s"]), f(r["incremental_s"]), f(r["incremental_ratio"], 3)])
    sweep = []
    for r in result["rows"]:
        if r["section"] == "per-shard":
            sweep.append([r["method"], r["shard_size"], r["shards"], f(r["wall_s"]),
                          f(r["overhead_ms_per_shard_vs_kernel"], 0), f(r["overhead_ms_per_shard_vs_worker_compute"], 0)])
    fits = [[k, f"{v['fixed_s']:.2f}", f"{v['slope_ms_per_shard']:.0f}"] for k, v in result["fits"].items()]
    return "\n\n".join([
        common.markdown_table(["runner", "shard size", "run", "shards computed", "utterances computed", "cold s",
                               "this run s", "ratio to cold"], life, "lrlrrrrr"),
        common.markdown_table(["runner", "shard size", "shards", "wall s", "overhead ms/shard (vs kernel)",
                               "overhead ms/shard (vs worker compute)"], sweep, "lrrrrr"),
        common.markdown_table(["runner", "fit: fixed + compute s", "fit: slope ms/shard"], fits, "lrr"),
    ])


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, color in (("engine", "tab:blue"), ("flow", "tab:red")):
        pts = sorted((r for r in rows if r["section"] == "per-shard" and r["method"] == kind),
                     key=lambda r: r["shard_size"])
        sizes = [r["shard_size"] for r in pts]
        for ax, key, style in ((axes[0], "overhead_ms_per_shard_vs_kernel", "-"),
                               (axes[0], "overhead_ms_per_shard_vs_worker_compute", "--"),
                               (axes[1], "wall_s", "-")):
            med = [r[key]["median"] for r in pts]
            err = [[m - r[key]["min"] for m, r in zip(med, pts, strict=True)], [r[key]["max"] - m for m, r in zip(med, pts, strict=True)]]
            label = kind if key == "wall_s" else f"{kind}, vs {'kernel' if key.endswith('kernel') else 'worker compute'}"
            ax.errorbar(sizes, med, yerr=err, color=color, ls=style, marker="o", capsize=3, label=label)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shard size (utterances)")
        ax.legend(fontsize=8)
    lows = [r[k]["min"] for r in rows if r["section"] == "per-shard"
            for k in ("overhead_ms_per_shard_vs_kernel", "overhead_ms_per_shard_vs_worker_compute")]
    if lows and min(lows) > 0:
        axes[0].set_yscale("log")
    else:  # noise can push a point below zero
        axes[0].set_yscale("symlog", linthresh=10)
    axes[0].set_ylabel("overhead per shard (ms)")
    axes[0].set_title("(wall − work) / shards")
    axes[1].set_ylabel("wall (s)")
    axes[1].set_title("cold run wall time")
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.script_main(NAME)
