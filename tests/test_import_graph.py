"""The package's import graph: no cycles (deferred imports inside functions included; imports
for type checkers only are not imports), imports point down the layers (:data:`LAYERS`), Prefect
only in ``orchestration/``, and ``import espnet3_flows.<job package>`` imports no torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "espnet3_flows"


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text())
        for guard in [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]:
            guard.body = []  # imports for type checkers only: no import at run time
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("espnet3_flows"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("espnet3_flows"))
        # a package may name its own submodules (lazy exports); a submodule importing its
        # package's __init__ is the normal direction
        graph[name] = {d for d in deps if d in modules and d != name and not d.startswith(name + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


#: The layers, top down, by the package's first-level names: a module imports its own layer and the
#: ones below it, never one above. Everything not named here is the base (config, errors, hashing,
#: storage, sharding, ...). docs/development.md describes them.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("__main__", "flows", "config_docs")),
    ("orchestration", ("orchestration",)),
    ("jobs", ("stats", "xvector", "features", "batching", "job_registry")),
    ("the jobs' engine", ("frontend_job", "utterance_job", "split_outputs")),
    ("frontends", ("frontends",)),
    ("inputs", ("inputs",)),
    ("parallel", ("parallel",)),
)


def layer(module: str) -> int:
    """The rank of ``module``'s layer (0 the top; ``len(LAYERS)``: the base)."""
    top = _package(module)
    return next((i for i, (_, names) in enumerate(LAYERS) if top in names), len(LAYERS))


def _layer_name(rank: int) -> str:
    return LAYERS[rank][0] if rank < len(LAYERS) else "base"


def test_imports_point_down_the_layers():
    up = [f"{name} ({_layer_name(layer(name))}) imports {dep} ({_layer_name(layer(dep))})"
          for name, deps in sorted(_graph().items()) for dep in sorted(deps) if layer(dep) < layer(name)]
    assert up == [], "imports that point up a layer:\n" + "\n".join(up)


def test_prefect_is_imported_by_the_orchestration_layer_only():
    pattern = re.compile(r"^\s*(?:import|from)\s+prefect(?:_dask)?\b", re.M)
    outside = [str(path.relative_to(ROOT)) for path in sorted(PACKAGE.rglob("*.py"))
               if "orchestration" not in path.relative_to(PACKAGE).parts and pattern.search(path.read_text())]
    assert outside == []


JOBS = ("stats", "xvector", "features", "batching")
#: what the layers below the jobs are (imports only point down: none of them names a job)
SHARED = ("frontends", "parallel", "inputs", "sharding",
          "storage", "config", "errors", "scp", "external_sort", "hashing", "lazy_exports")


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_jobs_import_no_other_job_and_shared_layers_import_no_job():
    """A concept two jobs share lives below them (frontends/, the engine), not inside one job."""
    wrong = []
    for name, deps in _graph().items():
        here = _package(name)
        for dep in deps:
            there = _package(dep)
            if there in JOBS and there != here and (here in JOBS or here in SHARED):
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def test_job_packages_import_no_torch():
    code = ("import sys, espnet3_flows.stats, espnet3_flows.xvector, espnet3_flows.features, "
            "espnet3_flows.xvector.job; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_command_line_and_the_engine_import_no_distributed():
    """A run in this process (``serial``, a ``local`` run of one shard) never imports Dask's
    distributed scheduler (~0.5 s): only :mod:`espnet3_flows.parallel.dask_plugins` and the cluster
    paths do."""
    code = ("import sys, espnet3_flows.orchestration.entry, espnet3_flows.orchestration.flows, espnet3_flows.parallel; "
            "from espnet3_flows.parallel import ParallelConfig; ParallelConfig(env='local'); "
            "print('distributed' in sys.modules, 'prefect_dask' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
