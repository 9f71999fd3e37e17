"""The package's import graph: no cycles and no relative imports, imports point down the layers
(:data:`LAYERS`), Prefect only in ``orchestration/``, and ``import espnet3_flows.<job package>``
imports no torch. The graph is every import Python runs, type-only and deferred ones included
(:mod:`tests.support.import_graph`); a planted import of each kind shows that the checks see it."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.import_graph import Arrow, cycles, import_arrows, relative_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "espnet3_flows"


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for arrow in import_arrows(root, "espnet3_flows"):
        graph.setdefault(arrow.source, set()).add(arrow.target)
    return graph


def _cycle_report(root: Path = ROOT) -> list[str]:
    return ["\n  ".join(["a cycle:", *map(str, group)]) for group in cycles(import_arrows(root, "espnet3_flows"))]


def test_no_import_cycles():
    assert _cycle_report() == [], "\n".join(_cycle_report())


def test_no_relative_imports():
    assert relative_imports(ROOT, "espnet3_flows") == []


def _plant(root: Path, files: dict[str, str]) -> Path:
    """A package named ``espnet3_flows`` under ``root`` holding ``files`` (``__init__.py`` added)."""
    for rel, text in files.items():
        path = root / "espnet3_flows" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    for folder in [root / "espnet3_flows", *(root / "espnet3_flows").rglob("*/")]:
        (folder / "__init__.py").touch()
    return root


def test_a_planted_upward_import_inside_a_function_fails(tmp_path):
    root = _plant(tmp_path, {"orchestration/top.py": "X = 1\n",
                             "parallel/low.py": "def f():\n    from espnet3_flows.orchestration.top import X\n"})
    assert _upward(root) == [
        "espnet3_flows.parallel.low (parallel) imports espnet3_flows.orchestration (orchestration), line 2",
        "espnet3_flows.parallel.low (parallel) imports espnet3_flows.orchestration.top (orchestration), line 2"]


def test_a_planted_type_only_cycle_fails(tmp_path):
    root = _plant(tmp_path, {
        "storage.py": "from espnet3_flows.s3 import upload\n",
        "s3.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from espnet3_flows.storage import Storage\n"})
    assert _cycle_report(root) == ["a cycle:\n  espnet3_flows.s3 -> espnet3_flows.storage (line 3)\n"
                                   "  espnet3_flows.storage -> espnet3_flows.s3 (line 1)"]


def test_a_planted_relative_import_fails_and_is_an_arrow(tmp_path):
    root = _plant(tmp_path, {"inputs/a.py": "from .b import y\n", "inputs/b.py": "y = 1\n"})
    assert relative_imports(root, "espnet3_flows") == ["espnet3_flows.inputs.a:1"]
    assert Arrow("espnet3_flows.inputs.a", "espnet3_flows.inputs.b", 1) in import_arrows(root, "espnet3_flows")


@pytest.mark.parametrize(("files", "cycle"), [
    pytest.param({"pkg/__init__.py": "from espnet3_flows.pkg.sub import S\nHELP = 1\n",
                  "pkg/sub.py": "from espnet3_flows.pkg import HELP\nS = HELP\n"},
                 ["espnet3_flows.pkg -> espnet3_flows.pkg.sub (line 1)",
                  "espnet3_flows.pkg.sub -> espnet3_flows.pkg (line 1)"], id="a package and its submodule"),
    pytest.param({"pkg/__init__.py": "from espnet3_flows.lazy import lazy_getattr\n"
                                     "__getattr__ = lazy_getattr(__name__, {'S': 'espnet3_flows.pkg.sub'})\n",
                  "lazy.py": "def lazy_getattr(p, e): ...\n",
                  "pkg/sub.py": "import espnet3_flows.pkg\nS = 1\n"},
                 ["espnet3_flows.pkg -> espnet3_flows.pkg.sub (line 2)",
                  "espnet3_flows.pkg.sub -> espnet3_flows.pkg (line 1)"], id="lazy exports"),
    pytest.param({"a.py": "import importlib\nB = 'espnet3_flows.b'\ndef f():\n    return importlib.import_module(B)\n",
                  "b.py": "from espnet3_flows import a\n"},
                 ["espnet3_flows.a -> espnet3_flows.b (line 4)", "espnet3_flows.b -> espnet3_flows.a (line 1)"],
                 id="import_module of a constant"),
])
def test_planted_cycles_through_packages_and_dynamic_imports_fail(tmp_path, files, cycle):
    assert _cycle_report(_plant(tmp_path, files)) == ["\n  ".join(["a cycle:", *cycle])]


def test_a_submodule_reached_through_its_own_package_is_no_cycle(tmp_path):
    """``from pkg import sub`` inside ``pkg`` does not read ``pkg``'s namespace: no arrow to it."""
    root = _plant(tmp_path, {"pkg/__init__.py": "from espnet3_flows.pkg.a import A\n",
                             "pkg/a.py": "from espnet3_flows.pkg import b\nA = b.B\n", "pkg/b.py": "B = 1\n"})
    assert _cycle_report(root) == []


#: The layers, top down, by the package's first-level names: a module imports its own layer and the
#: ones below it, never one above. Everything not named here is the base (config, errors, hashing,
#: storage, sharding, ...). docs/development.md describes them.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("__main__", "flows", "config_docs")),
    ("orchestration", ("orchestration",)),
    ("jobs", ("stats", "xvector", "features", "batching", "job_registry")),
    ("the jobs' engine", ("frontend_job", "utterance_job", "split_outputs", "job_config")),
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


def _upward(root: Path = ROOT) -> list[str]:
    return [f"{a.source} ({_layer_name(layer(a.source))}) imports {a.target} ({_layer_name(layer(a.target))}), "
            f"line {a.line}" for a in import_arrows(root, "espnet3_flows") if layer(a.target) < layer(a.source)]


def test_imports_point_down_the_layers():
    assert _upward() == [], "imports that point up a layer:\n" + "\n".join(_upward())


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
