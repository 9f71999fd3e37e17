"""Benchmark: a user's runner — every worker busy on a small split, and ``runner_flow``'s no-op rerun.

Issue "ESPnet3's own code, unchanged". Each case runs a user's script in a fresh process (a
runner module beside it, as a user writes them), and times the call inside the script:

- **Busy workers**: 100 items whose ``forward`` sleeps 0.5 s (a GPU-heavy model stands in; 4
  processes on 2 cores are fine for sleeping items), ``runner.run(range(100), parallel={"env":
  "local", "n_workers": 4})``, default ``shard_size`` (256). *Now*: the split is cut for 4
  workers (:func:`espnet3_flows.sharding.split_shard_size`). *One shard, as before*: the same
  runner planned as if for one worker (what every run did before the rule): one shard, on one
  worker. Target ≤ 20 s (50 s of sleeping spread over 4 workers, plus the cluster's start).
- **``runner_flow`` no-op rerun**: the same script run again on its finished output, with no
  Prefect server configured; beside it the engine's own rerun (``runner(range(n))``), which
  merges in this process. Target ≤ 1.5 s for the call.

``--quick``: 20 items of 0.1 s, one repetition. Repetitions (``$ESPNET3_BENCH_RUNNERS_REPEATS``,
default 3) interleave the cases. Run ``python -m benchmarks --only runners [--quick]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "runners"
ROOT = Path(__file__).resolve().parents[1]

RUNNERS = '''
import os
import time

from espnet3_flows.parallel import BaseRunner, EnvironmentProvider


class Items(EnvironmentProvider):
    def build_env_local(self):
        return {"seconds": self.config["seconds"]}

    def build_worker_setup_fn(self):
        seconds = self.config["seconds"]
        return lambda: {"seconds": seconds}


class Sleepy(BaseRunner):
    """Each item sleeps (a model's forward) and returns the process it ran in."""

    @staticmethod
    def forward(idx, seconds, **env):
        time.sleep(seconds)
        return os.getpid()


class OneShard(Sleepy):
    """The plan every run made before small splits were cut for their workers."""

    def plan(self, indices, workers=1):
        return super().plan(indices, workers=1)
'''

SCRIPT = '''
import json
import sys
import time

from espnet3_flows.orchestration import runner_flow
from my_runners import Items, OneShard, Sleepy

if __name__ == "__main__":
    case, n, seconds, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    parallel = {"env": "local", "n_workers": 4}
    t0 = time.perf_counter()
    if case in ("now", "one shard"):
        runner = (Sleepy if case == "now" else OneShard)(Items({"seconds": seconds}), output_dir=out)
        result = runner.run(range(n), parallel=parallel, progress=False)
        pids, shards = result.merged, len(result.plan.shards)
    elif case == "engine rerun":  # the plain runner's own rerun, on the same cluster config: nothing due
        pids = Sleepy(Items({"seconds": seconds}), output_dir=out).run(range(n), parallel=parallel).merged
        shards = None
    else:  # runner_flow, cold or rerun
        pids = runner_flow(Sleepy(Items({"seconds": seconds}), output_dir=out), range(n), parallel=parallel)
        shards = None
    wall = time.perf_counter() - t0
    print(json.dumps({"call_s": wall, "workers_used": len(set(pids)), "items": len(pids), "shards": shards}))
'''


def _once(root: Path, case: str, n: int, seconds: float, out: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "script.py", case, str(n), str(seconds), str(out)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{case}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> dict[str, Any]:
    """Measure, write ``runners.json`` and return the result."""
    n, seconds = (20, 0.1) if quick else (100, 0.5)
    repeats = 1 if quick else int(os.environ.get("ESPNET3_BENCH_RUNNERS_REPEATS") or 3)
    root = common.scratch(NAME)
    (root / "my_runners.py").write_text(textwrap.dedent(RUNNERS))
    (root / "script.py").write_text(textwrap.dedent(SCRIPT))
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in
                                                ("now", "one shard", "runner_flow cold", "runner_flow rerun",
                                                 "engine rerun")}
    try:
        for rep in range(repeats):
            for case in ("now", "one shard"):
                samples[case].append(_once(root, case, n, seconds, root / f"out-{case}-{rep}".replace(" ", "-")))
            flow_out = root / f"flow-{rep}"
            samples["runner_flow cold"].append(_once(root, "flow", n, seconds, flow_out))
            samples["runner_flow rerun"].append(_once(root, "flow", n, seconds, flow_out))
            samples["engine rerun"].append(_once(root, "engine rerun", n, seconds, flow_out))
    finally:
        common.clean_scratch(root)
    rows = [{"case": case, "call_s": common.spread([s["call_s"] for s in runs]),
             "workers_used": max(s["workers_used"] for s in runs),
             "shards": runs[0]["shards"]} for case, runs in samples.items()]
    by = {r["case"]: r for r in rows}
    busy, rerun = by["now"]["call_s"]["median"], by["runner_flow rerun"]["call_s"]["median"]
    targets = [
        common.target(f"{n} items of {seconds} s on 4 local workers", "≤ 20 s" if not quick else "≤ 0.4× one shard",
                      f"{busy:.1f} s", busy <= (20 if not quick else 0.4 * by["one shard"]["call_s"]["median"])),
        common.target("every worker computes shards", "4 of 4", f"{by['now']['workers_used']} of 4",
                      by["now"]["workers_used"] == 4),
        common.target("runner_flow no-op rerun (the call)", "≤ 1.5 s", f"{rerun:.2f} s", rerun <= 1.5),
    ]
    notes = [f"{repeats} repetition(s), cases interleaved; cells are median [min–max] seconds of the call inside "
             "a fresh process (imports not counted: the same in every case); no Prefect server configured, so "
             "the cold runner_flow starts a private one (its start overlaps the workers' start).",
             "'one shard' is the same runner planned as for one worker: the cut every run made before small splits "
             "were cut for their workers (2–4 shards per worker; see README, 'Shards')."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    common.bar_chart(path, [r["case"] for r in rows], [r["call_s"]["median"] for r in rows], "call, s (median)",
                     height=2.6)


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    return common.markdown_table(["case", "call s", "workers used", "shards"],
                                 [[r["case"], common.fmt(r["call_s"]), r["workers_used"],
                                   r["shards"] if r["shards"] is not None else "–"] for r in result["rows"]])


if __name__ == "__main__":
    common.script_main(NAME)
