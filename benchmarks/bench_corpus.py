"""Benchmark: corpus scale — the collect-stats CLI on 10 k and 1 M utterances, planning 10 M.

Issue "Corpus scale". The corpus is N hard links to 300 short (0.1–0.5 s, 16 kHz) WAVs, 1,000
links per directory, under ``$ESPNET3_BENCH_DATA/corpus-short`` (made once with ``os.link``,
extended as larger sizes need more), with one TSV manifest ``utt_id<TAB>path`` per size, sorted
by id. Every run is the product's command line in its own process, against the Prefect API
server ``python -m benchmarks`` started:
``python flows/collect_stats.py manifests.train=M output_dir=OUT frontend.type=none
shard_size=1000 parallel.env=local parallel.n_workers=2`` (``none``: lengths from the headers).

- 10 k and 1 M: a cold run into a fresh output directory, then a no-op rerun; wall time, peak RSS
  of the driver and of each Dask worker (``process_tree.measured_run``). Driver growth per utterance:
  (driver peak at 1 M − at 10 k) / (1 M − 10 k).
- 1 M ``--dry-run``: the checks a dry run makes (every audio file stat'ed, a sample of headers
  read) into an output directory that does not exist; its wall (target ≤ 60 s) and the paths it
  left under the output directory and beside the manifest (target: none).
- 10 M: planning only, with the CLI's ``--dry-run`` when its ``--help`` lists one (a cold run
  of 10 M is not part of the issue); else recorded as not measured. The 10 M manifest names
  10 M hard links when the file system has room for them (link count per file, inodes for the
  directories, free space, and an estimated link time within ``$ESPNET3_BENCH_LINK_BUDGET_S``,
  default 1200 s); otherwise its lines name the 1 M links repeated under distinct ids, and the
  notes say so (fingerprints then stat each file 10 times).

Sizes: ``$ESPNET3_BENCH_CORPUS_SIZES`` = ``SMALL,LARGE,PLAN`` (default 10000,1000000,10000000;
1000,2000,5000 with ``--quick``). Run ``python -m benchmarks --only corpus [--quick]``.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks import process_tree
from benchmarks.process_tree import run_failed

NAME = "corpus"
SHARD = 1000
SOURCES = 300
PER_DIR = 1000
ID_WIDTH = 8
ROOT = common.DATA / "corpus-short"
LINKS = ROOT / "links"
MB = 1024 ** 2


# ---- corpus ---------------------------------------------------------------------------------
def sources() -> list[str]:
    """300 short WAVs (0.1–0.5 s), generated once."""
    from espnet3_flows.inputs.demo import make_demo_corpus

    manifest = ROOT / "sources.tsv"
    if not manifest.exists():
        with common.locked(ROOT / ".lock"):
            if not manifest.exists():
                made = make_demo_corpus(ROOT / "gen", n_utts=SOURCES, n_speakers=6, min_seconds=0.1, max_seconds=0.5,
                                        seed=1, splits={"train": 1.0})
                common.write_lines(manifest, made["train"].read_text().splitlines(keepends=True)[:SOURCES])
    return common.manifest_paths(manifest)


def link_path(i: int) -> Path:
    return LINKS / f"d{i // PER_DIR:05d}" / f"u{i:0{ID_WIDTH}d}.wav"


def links_made() -> int:
    try:
        return int((LINKS / ".count").read_text())
    except (OSError, ValueError):
        return 0


def ensure_links(n: int) -> dict[str, Any]:
    """At least ``n`` hard links exist (whole directories at a time); returns the seconds it took."""
    src = sources()
    have = links_made()
    if have >= n:
        return {"made": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    with common.locked(ROOT / ".lock"):
        have = links_made()
        start = have - have % PER_DIR
        for d0 in range(start, n, PER_DIR):
            d = link_path(d0).parent
            d.mkdir(parents=True, exist_ok=True)
            for i in range(d0, d0 + PER_DIR):
                with contextlib.suppress(FileExistsError):
                    os.link(src[i % len(src)], link_path(i))
            (LINKS / ".count").write_text(str(d0 + PER_DIR))
            if (d0 // PER_DIR) % 500 == 499:
                print(f"[bench] {NAME}: {d0 + PER_DIR:,} links ({time.perf_counter() - t0:.0f} s)", flush=True)
    made = links_made() - have
    seconds = time.perf_counter() - t0
    if made >= 10_000:  # for later estimates of a larger corpus's link time
        (LINKS / ".rate").write_text(f"{made / seconds:.0f}")
    return {"made": made, "seconds": seconds}


def link_rate() -> float | None:
    """Links per second measured when links were last made (``None``: not known)."""
    try:
        return float((LINKS / ".rate").read_text())
    except (OSError, ValueError):
        return None


def links_feasible(n: int, rate: float | None) -> tuple[bool, str]:
    """Whether ``n`` hard links fit: link count per file, inodes, free space, time budget."""
    have = links_made()
    if have >= n:
        return True, f"{n:,} links exist"
    ROOT.mkdir(parents=True, exist_ok=True)
    try:
        link_max = os.pathconf(str(ROOT), "PC_LINK_MAX")
    except (OSError, ValueError):
        link_max = 65000
    per_file = -(-n // SOURCES) + 1
    st = os.statvfs(ROOT)
    dirs = -(-n // PER_DIR)
    need_bytes = (n - have) * (64 + 100)  # directory entries + manifest line, generously
    free_bytes = st.f_bavail * st.f_frsize
    budget = float(os.environ.get("ESPNET3_BENCH_LINK_BUDGET_S") or 1200)
    eta = (n - have) / rate if rate else None
    checks = [(per_file <= link_max, f"{per_file:,} links per file vs the file system's maximum {link_max:,}"),
              (st.f_favail > 2 * dirs, f"{dirs:,} directories vs {st.f_favail:,} free inodes (links need none)"),
              (free_bytes > 3 * need_bytes, f"~{need_bytes / 1e9:.1f} GB needed vs {free_bytes / 1e9:.0f} GB free"),
              (eta is None or eta <= budget, f"~{eta:.0f} s to link vs ESPNET3_BENCH_LINK_BUDGET_S={budget:g}"
               if eta is not None else "link time unknown (no rate measured yet)")]
    failed = [why for ok, why in checks if not ok]
    return (not failed), ("; ".join(failed) if failed else "; ".join(why for _, why in checks))


def manifest(n: int, distinct: int | None = None) -> Path:
    """TSV of ``n`` utterances; line ``i`` names link ``i % distinct`` (default: link ``i``)."""
    distinct = distinct or n
    path = ROOT / (f"train_{n}.tsv" if distinct == n else f"train_{n}_over_{distinct}.tsv")
    if not path.exists():
        t0 = time.perf_counter()
        prefix = str(LINKS)

        def lines():
            for i in range(n):
                j = i % distinct
                yield f"c{i:0{ID_WIDTH}d}\t{prefix}/d{j // PER_DIR:05d}/u{j:0{ID_WIDTH}d}.wav\n"

        common.write_lines(path, lines())
        print(f"[bench] {NAME}: wrote {path.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


# ---- runs -----------------------------------------------------------------------------------
def flow_args(manifest_path: Path, out: Path) -> list[str]:
    return [f"manifests.train={manifest_path}", f"output_dir={out}", "frontend.type=none", f"shard_size={SHARD}",
            "parallel.env=local", f"parallel.n_workers={common.WORKERS}"]


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``corpus.json`` / ``.png`` and return the result."""
    env_sizes = os.environ.get("ESPNET3_BENCH_CORPUS_SIZES")
    small, large, plan_n = ([int(s) for s in env_sizes.split(",")] if env_sizes
                            else ([1000, 2000, 5000] if quick else [10_000, 1_000_000, 10_000_000]))
    notes: list[str] = []
    rows: list[dict[str, Any]] = []

    made = ensure_links(large)
    if made["made"]:
        notes.append(f"Made {made['made']:,} hard links in {made['seconds']:.0f} s.")
    for n in (small, large):
        m = manifest(n)
        out = common.scratch(f"corpus-{n}")
        try:
            for label in ("cold", "no-op rerun"):
                r = process_tree.measured_run(NAME, f"{n} {label}",
                                              process_tree.flow_cli("collect_stats", *flow_args(m, out)), out, quick)
                rows.append({"utterances": n, "section": "run", **r, "run": label})
        finally:
            common.clean_scratch(out)

    help_text = process_tree.flow_cli_help("collect_stats")
    dry_run = "--dry-run" in help_text
    if dry_run:
        rows.append(checked_dry_run(large, quick))
    plan_row: dict[str, Any] = {"utterances": plan_n, "section": "plan", "run": "planning (--dry-run)"}
    if not dry_run:
        plan_row.update(ok=False, skipped="the CLI has no --dry-run", wall_s=None, driver_peak_mb=None)
        notes.append(f"{plan_n:,}-utterance planning not measured: `python flows/collect_stats.py --help` lists no "
                     "--dry-run, and a no-op rerun would need a cold run of the whole corpus first.")
    else:
        feasible, why = links_feasible(plan_n, link_rate())
        if feasible:
            made = ensure_links(plan_n)
            if made["made"]:
                notes.append(f"Made {made['made']:,} more hard links in {made['seconds']:.0f} s.")
            m = manifest(plan_n)
            plan_row["manifest"] = f"{plan_n:,} distinct hard links"
            notes.append(f"The {plan_n:,}-utterance manifest names {plan_n:,} distinct hard links ({why}).")
        else:
            m = manifest(plan_n, distinct=large)
            plan_row["manifest"] = f"{large:,} links repeated under distinct ids"
            notes.append(f"The {plan_n:,}-utterance manifest names the {large:,} links repeated under distinct ids "
                         f"(no room for {plan_n:,} links: {why}); fingerprints stat each file "
                         f"{plan_n // large} times, which the kernel's dentry cache makes cheaper than distinct files.")
        out = common.scratch(f"corpus-plan-{plan_n}")
        try:
            r = process_tree.measured_run(NAME, f"{plan_n} planning --dry-run",
                                          process_tree.flow_cli("collect_stats", "--dry-run", *flow_args(m, out)), out,
                                          quick)
            plan_row.update(r, run="planning (--dry-run)")
        finally:
            common.clean_scratch(out)
    rows.append(plan_row)

    targets = make_targets(rows, small, large, plan_n)
    notes = [
        f"Sizes {small:,} and {large:,} utterances (cold run, then no-op rerun, each a fresh CLI process), planning "
        f"of {plan_n:,}; shard_size {SHARD}, frontend.type=none (lengths from the WAV headers), {common.WORKERS} local "
        "workers; one repetition.",
        f"Corpus: hard links to {SOURCES} WAVs of 0.1–0.5 s (16 kHz), {PER_DIR:,} per directory; TSV sorted by id. "
        "Every link is one inode of 300, so the audio is in the page cache after the first read; a real corpus of "
        "distinct files reads more from disk.",
        process_tree.cli_runs_note(NAME, quick) + " The flow runs share the Prefect API server `python -m benchmarks` "
        "started.",
        *notes,
    ]
    if quick:
        notes.append("--quick: tiny sizes; the targets are for 10 k / 1 M / 10 M.")
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path),
                               sizes=[small, large, plan_n], shard_size=SHARD, dry_run_supported=dry_run)


DRY_RUN = "--dry-run (checks)"


def _listing(*roots: Path) -> set[str]:
    """Every path under ``roots`` (a root that does not exist lists nothing)."""
    return {str(p) for root in roots if root.exists() for p in [root, *root.rglob("*")]}


def checked_dry_run(n: int, quick: bool) -> dict[str, Any]:
    """``--dry-run`` of the ``n``-utterance manifest into an output directory that does not exist: its
    wall, and whether it left anything behind in the output directory or beside the manifest."""
    m = manifest(n)
    scratch = common.scratch(f"corpus-dry-{n}")
    out = scratch / "out"  # the run must not create it
    try:
        before = _listing(m.parent, scratch)
        row = process_tree.measured_run(NAME, f"{n} --dry-run", process_tree.flow_cli(
            "collect_stats", "--dry-run", *flow_args(m, out)), out, quick)
        left = sorted(_listing(m.parent, scratch) - before)
    finally:
        common.clean_scratch(scratch)
    return {**row, "utterances": n, "section": "dry-run", "run": DRY_RUN, "left_behind": left[:5],
            "left_behind_count": len(left)}


def _row(rows: list[dict[str, Any]], n: int, label: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["utterances"] == n and r["run"] == label), None)


def make_targets(rows: list[dict[str, Any]], small: int, large: int, plan_n: int) -> list[dict[str, Any]]:
    """The issue's targets."""
    t = []
    cold, noop = _row(rows, large, "cold"), _row(rows, large, "no-op rerun")
    bad = run_failed(cold)
    t.append(common.target(f"{large:,} utterances: cold run completes", "exit 0", bad or "exit 0", not bad))
    bad = run_failed(noop) or run_failed(cold)
    t.append(common.target(f"{large:,} utterances: no-op rerun wall (s)", "≤ 20", bad or noop["wall_s"],
                           not bad and noop["wall_s"] <= 20))
    peaks = {n: [r["driver_peak_bytes"] for r in rows if r["utterances"] == n and r["section"] == "run"
                 and r.get("driver_peak_bytes")] for n in (small, large)}
    peak_large = max(peaks[large], default=None)
    complete = not (run_failed(cold) or run_failed(noop))
    t.append(common.target(f"{large:,} utterances: driver peak RSS, cold and no-op (MB)", "≤ 600",
                           round(peak_large / MB, 1) if peak_large else "not measured",
                           complete and peak_large is not None and peak_large <= 600 * MB))
    peak_small = max(peaks[small], default=None)
    if peak_small and peak_large:
        growth = (peak_large - peak_small) / (large - small)
        measured: Any = round(growth, 1) if complete else f"≥ {growth:.1f} (a {large:,} run failed)"
        t.append(common.target("driver peak growth per utterance (B)", "≤ 100", measured, complete and growth <= 100))
    else:
        t.append(common.target("driver peak growth per utterance (B)", "≤ 100", "not measured", False))
    dry = _row(rows, large, DRY_RUN)
    bad = run_failed(dry)
    t.append(common.target(f"{large:,} utterances: --dry-run (every file stat'ed, 100 headers read) wall (s)",
                           "≤ 60", bad or dry["wall_s"], not bad and dry["wall_s"] <= 60))
    left = None if bad else dry.get("left_behind_count")
    t.append(common.target("--dry-run leaves nothing behind (paths new under the output and manifest directories)",
                           "0", bad or (f"{left}: {', '.join(dry['left_behind'])}" if left else 0), left == 0))
    plan = _row(rows, plan_n, "planning (--dry-run)")
    bad = run_failed(plan)
    t.append(common.target(f"{plan_n:,} utterances: planning wall (s)", "≤ 90", bad or plan["wall_s"],
                           not bad and plan["wall_s"] <= 90))
    t.append(common.target(f"{plan_n:,} utterances: planning driver peak RSS (MB)", "≤ 1 GB (1024 MB)",
                           bad or plan["driver_peak_mb"], not bad and plan["driver_peak_mb"] <= 1024))
    w_small, w_large = _row(rows, small, "cold"), cold
    bad = run_failed(w_small) or run_failed(w_large)
    ws, wl = (w_small or {}).get("worker_peak_mb"), (w_large or {}).get("worker_peak_mb")
    ratio = wl / ws if ws and wl else None
    t.append(common.target(f"worker peak RSS, cold, {large:,} / {small:,} utterances", "≤ 1.2",
                           bad or (round(ratio, 3) if ratio else "not measured"),
                           not bad and ratio is not None and ratio <= 1.2))
    return t


def table(result: dict[str, Any]) -> str:
    """Markdown table of a result."""
    f = common.fmt
    lines = [[f"{r['utterances']:,}", r["run"], f(r.get("wall_s"), 1), f(r.get("shards_computed")),
              f(r.get("shards_cached")), f(r.get("driver_peak_mb"), 0), f(r.get("worker_peak_mb"), 0),
              process_tree.run_status(r)]
             for r in result["rows"]]
    return common.markdown_table(["utterances", "run", "wall s", "shards computed", "cached", "driver peak MB",
                                  "worker peak MB", "status"], lines, "rlrrrrrl")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    shown = [r for r in rows if r.get("wall_s") is not None]
    labels = [f"{r['utterances']:,}\n{r['run']}" for r in shown]
    ax.bar(labels, [r["wall_s"] for r in shown], color=["tab:blue" if r.get("ok") else "tab:red" for r in shown])
    ax.set_ylabel("wall s (whole process)")
    ax.set_title(f"collect-stats CLI, frontend none, shard_size {SHARD}")
    ax.tick_params(axis="x", labelsize=7)
    x = range(len(shown))
    ax2.bar([i - 0.2 for i in x], [r.get("driver_peak_mb") or 0 for r in shown], 0.4, label="driver")
    ax2.bar([i + 0.2 for i in x], [r.get("worker_peak_mb") or 0 for r in shown], 0.4, label="largest worker")
    ax2.set_xticks(list(x), labels, fontsize=7)
    ax2.set_ylabel("peak RSS MB")
    ax2.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.script_main(NAME)
