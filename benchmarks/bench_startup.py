"""Benchmark: what a small local run pays around its work (issue "Everyday runs start fast").

``python flows/collect_stats.py`` on 4 generated utterances (one shard), each run a fresh process
with a fresh ``output_dir``, side by side with the import floor (a process that only imports
torch, lhotse, prefect, distributed and soundfile), all interleaved in rotating order:

- **local, no server**: the default ``parallel.env=local`` with no Prefect API configured (the
  CLI's private server);
- **serial, no server**: ``parallel.env=serial``;
- **local, 2 shards**: ``shard_size=2``: a ``LocalCluster`` of 2 workers starts;
- **local, running server**: ``PREFECT_API_URL`` at a server this benchmark started;
- **no-op rerun**: the same command on a finished output (no server, no cluster).

Each run writes its timeline (``ESPNET3_FLOWS_TIMELINE``, :mod:`espnet3_flows.timeline`),
from which the wall time is split into: imports (process start to the CLI's ``main``), planning
(and, for a run in the driver, the job's imports), waiting for the server (to the API answering),
the flow run's start, the workers
(cluster start and envs built), the first shard, the other shards and the merges, the flow's end
(reports, cluster teardown, final state), the server's stop and the process exit.

Run ``python -m benchmarks --only startup [--quick]`` (repeats: ``ESPNET3_BENCH_STARTUP_REPEATS``,
default 5).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks import process_tree

NAME = "startup"
FLOOR = "import torch, lhotse, prefect, distributed, soundfile"
#: (column, from event (the first of several that the run passed), to event); ``start`` is the
#: process start, ``end`` its exit
PHASES = (("plan", ("start",), "planned"), ("imports", ("planned",), "main"),
          ("server wait", ("main",), "server_ready"), ("flow start", ("server_ready", "main"), "flow_started"),
          ("workers", ("flow_started",), "workers_ready"), ("first shard", ("workers_ready",), "first_shard"),
          ("shards + merge", ("first_shard",), "shards_merged"), ("flow end", ("shards_merged",), "flow_returned"),
          ("server stop", ("flow_returned",), "server_stopped"), ("exit", ("summary_printed",), "end"))


def _once(cmd: list[str], env: dict[str, str], root: Path, tag: str) -> dict[str, Any]:
    import time

    timeline = root / f"timeline-{tag}.jsonl"
    timeline.unlink(missing_ok=True)
    t0 = time.time()
    res = process_tree.run_checked(cmd, root / f"{tag}.log", env={**env, "ESPNET3_FLOWS_TIMELINE": str(timeline)},
                                   timeout_s=300, interval=0.5)
    events = common.timeline_events(timeline, t0, start=t0, end=t0 + res["wall_s"])
    return {"wall_s": res["wall_s"], "phases": common.phases(events, PHASES)}


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``startup.json`` and return the result."""
    from espnet3_flows.inputs.demo import make_demo_corpus

    repeats = 1 if quick else int(os.environ.get("ESPNET3_BENCH_STARTUP_REPEATS") or 5)
    root = common.scratch(NAME)
    manifest = make_demo_corpus(root / "corpus", n_utts=4, splits={"train": 1.0})["train"]
    served = contextlib.ExitStack()
    api_url = served.enter_context(common.running_server(quick))  # the "running server" row's; no other sees it
    os.environ.pop("PREFECT_API_URL", None)  # "no server" rows (run.py restores the environment)
    env: dict[str, str] = {}
    counter = iter(range(10 ** 6))

    def flow(*args: str) -> list[str]:
        return process_tree.flow_cli("collect_stats", f"manifests.train={manifest}", *args)

    def fresh(*args: str) -> list[str]:
        return flow(f"output_dir={root / f'out-{next(counter)}'}", *args)

    # with --quick (one repetition, in order) the first run's output is the no-op rerun's
    first = (lambda: flow(f"output_dir={root / 'done'}")) if quick else fresh
    cases: dict[str, Any] = {
        "import floor": lambda: ([sys.executable, "-c", FLOOR], env),
        "local, no server": lambda: (first(), env),
        "serial, no server": lambda: (fresh("parallel.env=serial"), env),
        "local, 2 shards (a cluster), no server": lambda: (fresh("shard_size=2", "parallel.n_workers=2"), env),
        "local, running server": lambda: (fresh(), {**env, "PREFECT_API_URL": api_url}),
        "no-op rerun": lambda: (flow(f"output_dir={root / 'done'}"), env),
    }
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    try:
        if not quick:
            _once(flow(f"output_dir={root / 'done'}"), env, root, "prepare")  # the no-op rerun's finished output
        names = list(cases)
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                cmd, case_env = cases[name]()
                samples[name].append(_once(cmd, case_env, root, f"{rep}-{len(samples[name])}"))
    finally:
        served.close()
        common.clean_scratch(root)
    floor = common.spread([s["wall_s"] for s in samples["import floor"]])
    rows = []
    for name, runs in samples.items():
        wall = common.spread([s["wall_s"] for s in runs])
        phases = {p: common.spread([s["phases"][p] for s in runs if p in s["phases"]])
                  for p, _, _ in PHASES if any(p in s["phases"] for s in runs)}
        rows.append({"case": name, "wall_s": wall, "vs_floor": wall["median"] / floor["median"], "phases": phases})
    by = {r["case"]: r for r in rows}
    local, serial = by["local, no server"], by["serial, no server"]
    targets = [
        common.target("4 utterances, no server configured, vs the import floor", "≤ 1.5×",
                      f"{local['vs_floor']:.2f}×", local["vs_floor"] <= 1.5),
        common.target("4 utterances, PREFECT_API_URL at a running server, vs the import floor", "≤ 1.2×",
                      f"{by['local, running server']['vs_floor']:.2f}×", by["local, running server"]["vs_floor"] <= 1.2),
        common.target("serial no slower than local on one shard (medians, 5 % noise)", "≤ 1.05×",
                      f"{serial['wall_s']['median'] / local['wall_s']['median']:.2f}×",
                      serial["wall_s"]["median"] <= 1.05 * local["wall_s"]["median"]),
        common.target("no-op rerun", "≤ 2.5 s", f"{by['no-op rerun']['wall_s']['median']:.2f} s",
                      by["no-op rerun"]["wall_s"]["median"] <= 2.5),
    ]
    notes = [f"{repeats} repetitions, cases interleaved in rotating order; cells are median [min–max] seconds of "
             "wall time; every run a fresh process and (but the no-op rerun) a fresh output_dir; the Prefect "
             "database (PREFECT_HOME under the benchmark data) kept between runs, as a user's is.",
             "Phases come from the driver's timeline (ESPNET3_FLOWS_TIMELINE): imports = process start to the CLI's "
             "main(); server wait = planning done to the API answering (the private server is launched at the "
             "process start, before the imports); flow end = reports, cluster teardown and the flow run's final "
             "state; exit = summary printed to process exit. Phases that a case does not pass are left out."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = [r["case"] for r in rows][::-1]
    left = [0.0] * len(names)
    for p, _, _ in PHASES:
        widths = [r["phases"][p]["median"] if p in r["phases"] else 0.0 for r in rows][::-1]
        ax.barh(names, widths, left=left, label=p)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    walls = [r["wall_s"]["median"] for r in rows][::-1]
    ax.scatter(walls, names, marker="|", s=200, color="black", label="wall (median)")
    ax.set_xlabel("seconds (medians)")
    ax.set_title("a 4-utterance collect-stats run, phase by phase")
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    common.save_figure(fig, path)


def table(result: dict[str, Any]) -> str:
    """Markdown table: wall time, ratio to the import floor and the phases, per case."""
    cols = [p for p, _, _ in PHASES]
    lines = [[r["case"], common.fmt(r["wall_s"]), f"{r['vs_floor']:.2f}×",
              *[f"{r['phases'][c]['median']:.2f}" if c in r["phases"] else "–" for c in cols]]
             for r in result["rows"]]
    return common.markdown_table(["case", "wall (s)", "vs floor", *cols], lines)


if __name__ == "__main__":
    common.script_main(NAME)
