"""The lint CI runs with the tests: ruff (its rules in ``pyproject.toml``: unused and undefined
names and imports, pycodestyle's errors) over everything this repository ships and tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check . (fix with: ruff check --fix .):\n{proc.stdout}{proc.stderr}"
    assert "All checks passed" in proc.stdout
