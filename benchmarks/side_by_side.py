"""Two checkouts' benchmarks, side by side on one machine: ``python -m benchmarks.side_by_side
--base PATH [--base-env NAME=VALUE ...] [--rounds N] [--quick] --only NAME [NAME ...]``.

A change is judged against the code before it by running the same benchmark from both checkouts,
alternating whole runs (base, this, base, this, ... ``--rounds`` times each), so that drift in the
machine's speed falls on both alike. Each run is ``python -m benchmarks --only NAME --no-readme``
in its checkout (its child processes import that checkout's package: ``benchmarks.common`` puts
it first on ``PYTHONPATH``), with its results in a scratch directory and the benchmark's own
repetitions set to 1 where it has such a setting (``ESPNET3_BENCH_<NAME>_REPEATS``): the rounds are
the repetitions.

Printed per benchmark: every row's median over the rounds for each checkout, and the ratio
this/base as the median of the per-round ratios (each round's two runs ran back to back). The
``--base`` checkout must have the same benchmarks (a ``git worktree add /tmp/base <commit>``);
both use this interpreter. ``--base-env`` sets variables for the base's runs only: with ``--base .``
it compares this checkout with itself under another setting (``ESPNET3_FLOWS_PATCHES=-<patch>``:
what one patch buys).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def row_values(result: dict[str, Any]) -> dict[str, float]:
    """A benchmark result's rows as label → seconds: the row's ``wall_s`` or ``call_s`` (its median
    where it is a spread), labelled by its ``shards`` (if any) and its ``case`` or ``run``, and, for
    a row with CPU figures (``cpu_s`` and ``server_cpu_s``: ``scale``'s), their sum as
    ``<label>, CPU``; rows with the same label (a benchmark's own repetitions) give their median."""
    values: dict[str, list[float]] = {}
    for row in result.get("rows", []):
        name = row.get("case") or row.get("run")
        seconds = row.get("wall_s", row.get("call_s"))
        if name is None or seconds is None:
            continue
        if isinstance(seconds, dict):
            seconds = seconds.get("median")
        if not isinstance(seconds, (int, float)):
            continue
        label = f"{row['shards']} shards, {name}" if isinstance(row.get("shards"), int) else str(name)
        values.setdefault(label, []).append(float(seconds))
        if isinstance(row.get("cpu_s"), (int, float)) and isinstance(row.get("server_cpu_s"), (int, float)):
            values.setdefault(f"{label}, CPU", []).append(float(row["cpu_s"] + row["server_cpu_s"]))
    return {label: statistics.median(v) for label, v in values.items()}


def run_once(checkout: Path, name: str, quick: bool, out: Path,
             extra_env: dict[str, str] | None = None) -> dict[str, float]:
    """One run of benchmark ``name`` from ``checkout`` (``extra_env`` in its environment); its rows
    (:func:`row_values`)."""
    env = {**os.environ, f"ESPNET3_BENCH_{name.upper()}_REPEATS": "1",
           f"ESPNET3_BENCH_{name.upper()}_COLD_REPEATS": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "benchmarks", "--only", name, "--no-readme", "--results-dir", str(out),
           *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} in {checkout}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return row_values(json.loads((out / f"{name}.json").read_text()))


def compare(base: Path, name: str, rounds: int, quick: bool, base_env: dict[str, str] | None = None) -> str:
    """Run ``name`` alternately from ``base`` (with ``base_env``) and this checkout; the table of
    medians and ratios."""
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix=f"side-by-side-{name}-") as tmp:
        for r in range(rounds):
            for arm, checkout in (("base", base), ("this", HERE)):
                runs[arm].append(run_once(checkout, name, quick, Path(tmp) / f"{arm}-{r}",
                                          base_env if arm == "base" else None))
                print(f"  {name} round {r + 1}/{rounds}, {arm}: done", file=sys.stderr)
    labels = [label for label in runs["this"][0] if all(label in v for v in runs["base"] + runs["this"])]
    setting = f" with {' '.join(f'{k}={v}' for k, v in base_env.items())}" if base_env else ""
    lines = [f"### {name}: this ({HERE}) vs base ({base}{setting}), {rounds} alternating round(s)", "",
             "| row | base s | this s | this/base |", "|---|---:|---:|---:|"]
    for label in labels:
        b = statistics.median(v[label] for v in runs["base"])
        t = statistics.median(v[label] for v in runs["this"])
        ratios = [tv[label] / bv[label] for bv, tv in zip(runs["base"], runs["this"], strict=True) if bv[label] > 0]
        ratio = f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}–{max(ratios):.2f}]" if ratios else "–"
        lines.append(f"| {label} | {b:.2f} | {t:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other checkout (e.g. a git worktree of the base commit)")
    parser.add_argument("--only", nargs="+", required=True, help="benchmark names (python -m benchmarks's)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each checkout (default 3)")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' --quick mode")
    parser.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable for the base's runs only (repeatable)")
    args = parser.parse_args(argv)
    if any("=" not in e for e in args.base_env):
        parser.error("--base-env takes NAME=VALUE")
    base_env = dict(e.split("=", 1) for e in args.base_env)
    base = Path(args.base).resolve()
    if not (base / "benchmarks" / "run.py").exists():
        parser.error(f"{base} is not a checkout with benchmarks/")
    for name in args.only:
        print(compare(base, name, args.rounds, args.quick, base_env), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
