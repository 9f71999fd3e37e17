"""Run benchmarks in ``--quick`` mode and check what they wrote (no timing is asserted).

The quick benchmarks are split over a few test modules (``tests/benchmarks/test_quick_*.py``), each
running a group of about 75 CPU-seconds on 2 cores in one ``python -m benchmarks --quick --only
...``: under ``make test``'s ``--dist loadfile`` the groups go to different pytest processes.
One run of all eleven took 445 s there, and over 600 s on CI's machine (stop 67): the suite's
longest single item, and past its own timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.prefect_db import seed_home

REPO = Path(__file__).resolve().parents[2]
#: the quick groups, each run by its module ``tests/benchmarks/test_quick_<group>.py``
GROUPS: dict[str, tuple[str, ...]] = {
    "startup": ("startup", "espnet2", "task_costs"),  # ~74 CPU-s alone on 2 cores (task_costs: ~15)
    "flows": ("collect_stats", "overhead", "memory"),  # ~82
    "models": ("xvector", "spk_embed", "frontend_espnet2", "batching", "runners", "s3"),  # ~70
}
#: what every benchmark's ``<name>.json`` holds
KEYS = {"name", "machine", "command", "quick", "rows", "targets", "notes"}
#: the benchmarks the quick groups leave out: ``gpu`` runs on the lent device
#: (``tests/benchmarks/test_gpu_check.py`` rehearses it); ``scale`` and ``corpus`` run the CLI a
#: dozen times even with ``--quick``, and ``soak`` stands up four services and nine deployment
#: runs, so only their bookkeeping is checked (``tests/benchmarks/test_benchmarks_quick.py``)
NOT_QUICK = frozenset({"gpu", "scale", "corpus", "soak"})
#: the ceiling of a quick group's module: a group took 75-295 s under ``make test`` on 2 cores (runs T1-T3)
TIMEOUT = 600

QuickRun = tuple[Path, subprocess.CompletedProcess]


def run_quick(names: tuple[str, ...], tmp: Path, api_url: str) -> QuickRun:
    """``python -m benchmarks --quick --only NAMES`` into ``tmp/results`` (the repository's results
    stay untouched), its flows reporting to the Prefect API at ``api_url``; the benchmarks that time
    a private server (``startup``, ``espnet2``) start theirs on a migrated copy of the database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(seed_home(tmp / "prefect-home")), PREFECT_API_URL=api_url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", *names, "--results-dir",
                           str(tmp / "results")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT - 30)
    return tmp / "results", proc


def assert_run_succeeded(run: QuickRun, names: tuple[str, ...]) -> None:
    """The run exited 0, ran each of ``names``, and left ``benchmarks/README.md`` alone."""
    _, proc = run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name in names:
        assert f"[bench] === {name} (quick) ===" in proc.stdout
    assert "[bench] updated" not in proc.stdout


def assert_result_json(run: QuickRun, name: str) -> None:
    """``name``'s JSON has every key, a target or more each with its verdict, the machine and notes;
    its chart was drawn."""
    results, _ = run
    data = json.loads((results / f"{name}.json").read_text())
    assert set(data) >= KEYS, KEYS - set(data)
    assert data["name"] == name and data["quick"] is True
    assert f"--only {name}" in data["command"] and "--quick" in data["command"]
    assert data["rows"] and isinstance(data["rows"], list)
    assert data["targets"], "every benchmark states at least one target"
    for t in data["targets"]:
        assert {"name", "target", "measured", "met"} <= set(t) and isinstance(t["met"], bool)
    assert {"cpu", "usable_cores", "versions"} <= set(data["machine"])
    assert isinstance(data["notes"], list) and data["notes"]
    assert (results / f"{name}.png").stat().st_size > 0


class QuickGroup:
    """The tests of one quick group: a test module subclasses it (``Test...``) and names its
    ``group`` of :data:`GROUPS`; ``tests/benchmarks/conftest.py`` runs the group once per class
    (``quick_run``) and gives ``name`` one value per benchmark of the group."""

    group: str

    def test_quick_run_succeeds(self, quick_run: QuickRun) -> None:
        assert_run_succeeded(quick_run, GROUPS[self.group])

    def test_result_json_has_expected_keys(self, quick_run: QuickRun, name: str) -> None:
        assert_result_json(quick_run, name)
