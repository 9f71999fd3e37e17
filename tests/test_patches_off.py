"""The suite's second pass, with every patch of another library off (``ESPNET3_FLOWS_PATCHES=off``):
the runs end to end marked ``unpatched`` must still pass, and each test marked ``patch`` (of what
one patch does) must fail on its assertion (``tests/conftest.py`` makes it a strict xfail).

It runs here as one test of the main pass, a pytest process of its own beside the other tests,
instead of a second ``pytest -n 2`` after them (``make test-unpatched`` still runs it alone): its
~2 minutes overlap the main pass's waits instead of adding to its end, and its xdist start-up is
gone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what the second pass selects (the Makefile's ``test-unpatched`` selects the same)
SELECTION = "patch or unpatched"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def marked_files() -> list[str]:
    """The test files that mark a test ``patch`` or ``unpatched``: the pass collects these alone
    (collecting the whole suite to select from ten files took ~5 CPU-s)."""
    marked = re.compile(r"mark\.(patch|unpatched)\b")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text()))


def test_the_marked_files_are_found():
    files = marked_files()
    assert "tests/orchestration/test_prefect_private.py" in files and "tests/parallel/test_forkserver.py" in files
    assert "tests/test_patches_off.py" not in files and len(files) < 30


def _counts(summary: str) -> dict[str, int]:
    """``{"passed": 5, "xfailed": 18, ...}`` from pytest's last line (``5 passed, 18 xfailed in 9s``)."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}


def test_counts_reads_pytests_summary_line():
    assert _counts("==== 5 passed, 18 xfailed, 1265 deselected in 98.21s (0:01:38) ====") == \
        {"passed": 5, "xfailed": 18, "deselected": 1265}


def test_with_every_patch_off_the_runs_pass_and_each_patch_test_fails_on_its_assertion(tmp_path, suite_environment):
    env = {k: v for k, v in suite_environment.items() if not k.startswith(("PYTEST_", "PREFECT_API_"))}
    env["ESPNET3_FLOWS_PATCHES"] = "off"
    log = tmp_path / "patches-off.log"
    with open(log, "w") as out:  # a file, not a pipe: nothing blocks on a full pipe for minutes
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", SELECTION, "-p", "no:cacheprovider",
             "-q", "-rfE", "--basetemp", str(tmp_path / "basetemp"), *marked_files()],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=850)
    text = log.read_text(errors="replace")
    lines = text.rstrip().splitlines()
    tail = "\n".join(lines[-60:])
    assert proc.returncode == 0, f"ESPNET3_FLOWS_PATCHES=off pytest -m '{SELECTION}' exited {proc.returncode}:\n{tail}"
    counts = _counts(lines[-1])
    # both kinds ran: the runs end to end passed, and every patch test failed on its assertion
    assert counts.get("passed", 0) >= 3 and counts.get("xfailed", 0) >= 10, tail
    assert not {"failed", "error", "errors", "xpassed"} & set(counts), tail
