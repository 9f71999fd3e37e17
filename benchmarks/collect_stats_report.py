"""The collect-stats benchmark's report (:mod:`benchmarks.bench_collect_stats`): rows, targets and notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.bench_collect_stats import (CLUSTER, FLOW, FLOW_LARGE, FLOW_SPAWN, FLOW_WARM, KERNEL2_FAST,
                                            KERNEL_FAST, N_LARGE, TIMELINE, TRIM_OFF)


def rows_of(samples: dict[str, list[dict[str, Any]]], n: int, audio: float) -> list[dict[str, Any]]:
    """A row per method: medians [min–max] of its repetitions; the ideal 2 × kernel row second and
    the Prefect server's start last."""
    kernel_ups = [n / s["wall"] for s in samples["kernel (1 process)"]]
    samples_ideal = [{"ups": 2 * u} for u in kernel_ups]
    rows = []
    for method, runs in samples.items():
        n_all = n
        n = runs[0].get("n", n_all)  # the large-corpus flow runs on N_LARGE
        row: dict[str, Any] = {"method": method, "utterances": n, "audio_seconds": audio * n / n_all,
                               "repetitions": len(runs),
                               "wall_s": common.spread([r["wall"] for r in runs]),
                               "utt_per_s": common.spread([n / r["wall"] for r in runs]),
                               "x_realtime": common.spread([audio * n / n_all / r["wall"] for r in runs])}
        if "cpu" in runs[0]:
            row["cpu_utt_per_s"] = common.spread([n / r["cpu"] for r in runs])
        for part in ("cluster_start", "manifest", "features", "stats", "page_cache_read"):
            if part in runs[0]:
                row[f"{part}_s"] = common.spread([r[part] for r in runs])
        if "span" in runs[0]:
            workers = 1 if method == "engine, serial" else common.WORKERS
            row["shard_phase_s"] = common.spread([r["span"] for r in runs])
            row["compute_only_utt_per_s"] = common.spread([n * workers / r["compute"] for r in runs])
            steady = [n / r["span"] for r in runs]
            row["steady_utt_per_s"] = common.spread(steady)
            row["fixed_s"] = common.spread([r["wall"] - n / u for r, u in zip(runs, steady, strict=True)])
        rows.append(row)
        n = n_all
    rows.insert(1, {"method": "2 × kernel (ideal, 2 cores)", "utterances": n, "audio_seconds": audio,
                    "repetitions": len(samples_ideal),
                    "utt_per_s": common.spread([s["ups"] for s in samples_ideal]),
                    "x_realtime": common.spread([s["ups"] * audio / n for s in samples_ideal])})
    if common.PREFECT["start_seconds"] is not None:
        rows.append({"method": "Prefect API server start (once per session)", "utterances": 0,
                     "repetitions": 1, "wall_s": common.spread([common.PREFECT["start_seconds"]])})

    return rows


def targets(by: dict[str, dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The speed targets, from the rows by method."""
    ideal = by["2 × kernel (ideal, 2 cores)"]["utt_per_s"]["median"]
    lhotse_rows = [r for m, r in by.items() if m.startswith("lhotse")]
    lhotse_best = max(lhotse_rows, key=lambda r: r["utt_per_s"]["median"])
    flow = by[FLOW]
    flow_e2e, flow_steady = flow["utt_per_s"]["median"], flow["steady_utt_per_s"]["median"]
    engine_steady = by.get(f"{CLUSTER}, warm workers{TRIM_OFF}", {}).get("steady_utt_per_s", {}).get("median")
    targets = [
        common.target(f"flow: end-to-end on {n:,} utterances vs 2 × kernel", "≥ 0.85", round(flow_e2e / ideal, 3),
                      flow_e2e >= 0.85 * ideal),
        common.target(f"flow: steady state on {n:,} utterances vs 2 × kernel", "≥ 0.85", round(flow_steady / ideal, 3),
                      flow_steady >= 0.85 * ideal),
    ]
    engine_warm = by.get(f"{CLUSTER}, warm workers{TRIM_OFF}", {}).get("utt_per_s", {}).get("median")
    if engine_steady:
        targets.append(common.target("engine (warm 2-worker LocalCluster): steady state vs 2 × kernel", "≥ 0.85",
                                     round(engine_steady / ideal, 3), engine_steady >= 0.85 * ideal))
        targets.append(common.target("engine (warm 2-worker LocalCluster): end-to-end (plan, shards, merge) vs "
                                     "2 × kernel", "≥ 0.85", round(engine_warm / ideal, 3), engine_warm >= 0.85 * ideal))
    ideal_fast = 2 * by[KERNEL_FAST]["utt_per_s"]["median"]
    for label, value in [("flow: steady state", flow_steady)] + ([("engine (warm): steady state", engine_steady)]
                                                                  if engine_steady else []):
        targets.append(common.target(f"{label} vs 2 × the FastFbank kernel (parallel efficiency alone)", "≥ 0.85",
                                     round(value / ideal_fast, 3), value >= 0.85 * ideal_fast))
    if FLOW_WARM in by:
        warm = by[FLOW_WARM]["utt_per_s"]["median"]
        targets.append(common.target(f"flow: end-to-end on {n:,} utterances, repeat run in the same process, "
                                     "vs 2 × kernel", "≥ 0.85", round(warm / ideal, 3), warm >= 0.85 * ideal))
    if FLOW_LARGE in by:
        large = by[FLOW_LARGE]["utt_per_s"]["median"]
        targets.append(common.target(f"flow: end-to-end on {N_LARGE:,} utterances vs 2 × kernel", "≥ 0.85",
                                     round(large / ideal, 3), large >= 0.85 * ideal))
        large_steady = by[FLOW_LARGE]["steady_utt_per_s"]["median"]
        targets.append(common.target(f"flow: steady state on {N_LARGE:,} utterances vs 2 × kernel", "≥ 0.85",
                                     round(large_steady / ideal, 3), large_steady >= 0.85 * ideal))
    for r in sorted(lhotse_rows, key=lambda r: r is not lhotse_best):
        ratio = flow_e2e / r["utt_per_s"]["median"]
        targets.append(common.target(f"flow: end-to-end vs {r['method']}", "≥ 1.5", round(ratio, 3), ratio >= 1.5))
    return targets


def notes(by: dict[str, dict[str, Any]], n: int, audio: float, reps: int, shard_size: int,
          means: dict[str, Any]) -> list[str]:
    """The result's notes: what was run and how to read it, and the ratios the targets do not show."""
    import numpy as np

    ideal = by["2 × kernel (ideal, 2 cores)"]["utt_per_s"]["median"]
    ideal_fast = 2 * by[KERNEL_FAST]["utt_per_s"]["median"]
    flow = by[FLOW]
    flow_e2e, flow_steady = flow["utt_per_s"]["median"], flow["steady_utt_per_s"]["median"]
    engine_steady = by.get(f"{CLUSTER}, warm workers{TRIM_OFF}", {}).get("steady_utt_per_s", {}).get("median")
    two_proc = by["kernel, 2 processes (measured)"]["utt_per_s"]["median"]
    vs_two_proc = [("flow steady", flow_steady)] + ([("engine steady", engine_steady)] if engine_steady else []) \
        + ([(f"flow steady on {N_LARGE:,}", by[FLOW_LARGE]["steady_utt_per_s"]["median"])] if FLOW_LARGE in by else [])
    agree = {k: float(np.max(np.abs(np.asarray(v, dtype=np.float64) - means["kernel"])))
             for k, v in means.items() if k != "kernel" and v is not None}
    notes = [
        f"{n} utterances, {audio:.0f} s of audio (2–6 s each, 16 kHz), shard_size {shard_size} (the product's "
        f"default), batch_size 16; the large-corpus flow row runs on the first {N_LARGE:,} utterances of the same "
        f"generated corpus (same length distribution), against the same 2 × kernel; "
        f"{reps} repetition(s) in rotating order; cells are median [min–max].",
        "Steady state: utterances / shard phase (first shard start to last shard end, from the done records), "
        "Prefect's per-shard task work included. (An earlier version took the flow's marginal rate between runs "
        "on n and 2n utterances: run-to-run noise in the ~7 s of fixed cost made it swing from 0.9x to 2.3x.) "
        "Fixed = wall − n / steady: cluster start, worker imports, planning, task submission, merge, artifacts. "
        "Compute-only = utterances / (sum of shard compute seconds / workers).",
        "kernel is the issue's reference: a plain loop with lhotse's Fbank.extract. The job computes the same "
        "features (to float32 rounding) with espnet3_flows.frontends.fbank.FastFbank; the FastFbank kernel row is the "
        "same plain loop with it, so 'vs 2 × the FastFbank kernel' is the parallel efficiency alone.",
        "Every row reads its audio from the page cache, as the kernel does: the large-corpus flow row reads its "
        "files once, untimed, right before its run (this VM reclaims pages left untouched for a while). "
        + (f"That read took {by[FLOW_LARGE]['page_cache_read_s']['median']:.1f} s." if FLOW_LARGE in by else ""),
        "The Prefect API server start is paid once per session (zero with a running server) and is not in the "
        "flow's wall time.",
        "lhotse stores features with NumpyFilesWriter (its default here: lilcom is not installed) and reads them "
        "back for compute_global_feature_stats.",
        f"Largest |mean difference| vs the kernel's float64 mean: {', '.join(f'{k} {v:.2e}' for k, v in agree.items())}.",
        "MALLOC_TRIM_THRESHOLD_: Dask's nannies export MALLOC_TRIM_THRESHOLD_=65536 to every worker by default "
        "(distributed.nanny.pre-spawn-environ). Setting it disables glibc's dynamic mmap threshold, so each array "
        "over 128 KiB (a 2–6 s waveform, its features) is a fresh mmap that is page-faulted and unmapped again. "
        "The product's own clusters now start workers without it (parallel.options.trim_worker_memory=false, the "
        "default); a plain LocalCluster passed as client= keeps Dask's default. Both are shown.",
        "The machine is shared with other engineers' test runs, so 2 × kernel (one process timed alone) is an "
        "optimistic ceiling; the measured 2-process kernel shows what two cores gave during this run.",
        "Against the measured 2-process kernel ("
        + f"{two_proc:.0f} utt/s, {two_proc / ideal:.2f} of 2 × kernel): "
        + ", ".join(f"{label} {value / two_proc:.2f}" for label, value in vs_two_proc) + ".",
    ]
    if KERNEL2_FAST in by:
        two_fast = by[KERNEL2_FAST]["utt_per_s"]["median"]
        notes.append(f"With the job's FastFbank the plain loop is {ideal_fast / ideal:.2f}x the lhotse kernel; two plain "
                     f"processes of it gave {two_fast:.0f} utt/s ({two_fast / ideal_fast:.2f} of 2 × its single "
                     "process; this row swings most between runs on this shared VM). "
                     "Against that measured 2-process FastFbank loop: "
                     + ", ".join(f"{label} {value / two_fast:.2f}" for label, value in vs_two_proc) + ".")
    spawned = by.get(FLOW + FLOW_SPAWN)
    if spawned:
        notes.append(f"Workers forked from the preloaded forkserver (parallel.options.start_method=forkserver, the "
                     f"default) vs spawned (start_method=spawn), cold, same run: fixed cost "
                     f"{flow['fixed_s']['median']:.2f} s vs {spawned['fixed_s']['median']:.2f} s, end-to-end "
                     f"{flow_e2e / spawned['utt_per_s']['median']:.2f}x the spawn throughput.")
    return notes


def timeline_of(timelines: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per flow method, the spread of each phase of its runs' wall time."""
    return {method: {phase: common.spread([t[phase] for t in runs]) for phase in TIMELINE}
            for method, runs in timelines.items()}


def table(result: dict[str, Any]) -> str:
    """The markdown table of a result."""
    lines = []
    for r in result["rows"]:
        lines.append([r["method"], common.fmt(r.get("wall_s")), common.fmt(r.get("utt_per_s"), 0),
                      common.fmt(r.get("x_realtime"), 0), common.fmt(r.get("steady_utt_per_s"), 0),
                      common.fmt(r.get("compute_only_utt_per_s"), 0), common.fmt(r.get("fixed_s")),
                      common.fmt(r.get("cluster_start_s"))])
    main = common.markdown_table(["method", "wall s", "utt/s (end-to-end)", "× realtime", "steady utt/s",
                                  "compute-only utt/s", "fixed s", "cluster start s"], lines)
    timeline = result.get("flow_timeline") or {}
    if not timeline:
        return main
    methods = list(timeline)
    phases = [[phase, *(common.fmt(timeline[m][phase]) for m in methods)] for phase in TIMELINE]
    labels = {FLOW: "cold (product default)", FLOW_WARM: "repeat run in the same process"}
    header = ["flow run: where the wall time went (s)",
              *(labels.get(m) or m.replace(FLOW, "cold").strip() for m in methods)]
    return main + "\n\n" + common.markdown_table(header, phases)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """The throughput chart: end-to-end bars (median, min–max), steady-state dots."""
    plt = common.pyplot()
    shown = [r for r in rows if "utt_per_s" in r]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(shown) + 1.5))
    y = list(range(len(shown)))[::-1]
    med = [r["utt_per_s"]["median"] for r in shown]
    err = [[m - r["utt_per_s"]["min"] for m, r in zip(med, shown, strict=True)], [r["utt_per_s"]["max"] - m for m, r in zip(med, shown, strict=True)]]
    ax.barh(y, med, xerr=err, color="tab:blue", alpha=0.8, label="end-to-end", capsize=3)
    steady = [(yy, r["steady_utt_per_s"]["median"]) for yy, r in zip(y, shown, strict=True) if "steady_utt_per_s" in r]
    if steady:
        ax.scatter([s for _, s in steady], [yy for yy, _ in steady], color="tab:orange", zorder=3, label="steady state")
    ax.set_yticks(y, [r["method"] for r in shown], fontsize=8)
    ax.set_xlabel("utterances / s (median, min–max)")
    ax.set_title(f"collect-stats throughput, {shown[0]['utterances']} utterances of 2–6 s")
    ax.legend()
    common.save_figure(fig, path)
