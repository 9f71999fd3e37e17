"""The house's size rules, outside the tests: no module over 400 lines and no function over 80
(a longer one is a second concern waiting for its own name)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("espnet3_flows", "benchmarks", "flows", "deployments")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(p for top in CHECKED for p in (ROOT / top).rglob("*.py"))


def test_no_module_over_400_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == [], "split these by concern:\n" + "\n".join(long)


def test_no_function_over_80_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], "split these:\n" + "\n".join(long)


def test_the_checked_trees_exist():
    assert all((ROOT / top).is_dir() for top in CHECKED) and len(_sources()) > 100
