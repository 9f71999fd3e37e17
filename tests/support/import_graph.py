"""The import graph of a package as Python runs it, read from the source: what
``tests/test_import_graph.py`` checks (no cycles, imports pointing down the layers).

Every import counts, wherever it is written: at the top of a module, inside a function (it runs
when the function does), under ``if TYPE_CHECKING:`` (a type the module cannot be read without),
relative (``from .x import y``, resolved), and ``importlib.import_module`` / ``import_module``
called with a string literal or a module-level string constant. So do the modules a package's
lazy exports name (``lazy_getattr(__name__, {"Name": "pkg.module"})``: the module paths in its
map). A registry's built-in modules, imported on its first use by the names it is given (like an
installed package's entry points), are found, not imported: they are no arrows, and each may
import the registry's module (:mod:`espnet3_flows.registry`).

An import also runs the ``__init__`` of every package above its target (``import a.b.c`` runs
``a`` and ``a.b`` first), so it is an arrow to each of them too, except to the packages the
importing module is itself inside: those have run before it. ``from pkg import name`` is an
arrow to ``pkg.name`` where that is a module, and to ``pkg`` where ``name`` is not a module or
the importer is outside ``pkg``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` at ``line`` of ``source``'s file."""

    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """The module-level names bound to a literal (a string, a dict), by name."""
    out = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, (ast.Constant, ast.Dict)):
            out.update((t.id, value) for t in targets if isinstance(t, ast.Name))
    return out


def _named_targets(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """``(target, line, names_from_it)`` of every import in one module; ``names_from_it``: the
    target's own namespace is read (not only a submodule reached through it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    consts = _constants(tree)
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, True) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, node.lineno, False) if sub in modules else (source, node.lineno, True))
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            args = [consts.get(a.id, a) if isinstance(a, ast.Name) else a for a in node.args[:2]]
            if func.rpartition(".")[2] == "import_module":
                args = args[:1]
            elif func.rpartition(".")[2] == "lazy_getattr" and len(args) > 1:  # the module paths in its map
                args = [c for c in ast.walk(args[1]) if isinstance(c, ast.Constant) and c.value in modules]
            else:
                args = []
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((arg.value, node.lineno, True))
    return found


def import_arrows(root: Path, package: str) -> list[Arrow]:
    """Every arrow between the modules of ``package`` (see the module's docstring)."""
    modules = package_modules(root, package)
    arrows: dict[tuple[str, str], Arrow] = {}
    for name, path in modules.items():
        for target, line, names in _named_targets(name, path, modules):
            parts = target.split(".")
            for i in range(len(parts), 0, -1):
                dest = ".".join(parts[:i])
                inside = name.startswith(dest + ".")  # a package this module is inside: already run
                if dest not in modules or dest == name or (inside and not (names and dest == target)):
                    continue
                arrows.setdefault((name, dest), Arrow(name, dest, line))
    return sorted(arrows.values(), key=lambda a: (a.source, a.target))


def relative_imports(root: Path, package: str) -> list[str]:
    """``module:line`` of every relative import (the package imports by absolute names only)."""
    return [f"{name}:{node.lineno}" for name, path in package_modules(root, package).items()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) and node.level]


def cycles(arrows: list[Arrow]) -> list[list[Arrow]]:
    """The arrows inside each import cycle (a strongly connected set of two or more modules)."""
    graph: dict[str, list[str]] = {}
    for a in arrows:
        graph.setdefault(a.source, []).append(a.target)
        graph.setdefault(a.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []
    for start in sorted(graph):  # Tarjan's strongly connected components, without recursion
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(graph[nxt])))
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
    return [[a for a in arrows if a.source in g and a.target in g] for g in groups]
