"""Every read of another library's private names sits in that library's one gated module (the
modules :mod:`espnet3_flows.patches` names): an import of a private module or name (``prefect._internal``,
``from lhotse... import _get_strided_batch``) or an attribute read through an imported module
(``multiprocessing.forkserver._forkserver``) anywhere else fails here. A planted read shows that
the scan sees each kind."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "espnet3_flows"

#: library -> where its private names may be read (a module, or a package's folder)
GATED = {
    "prefect": "espnet3_flows/orchestration/prefect_private/",
    "prefect_dask": "espnet3_flows/orchestration/prefect_private/",
    "distributed": "espnet3_flows/parallel/dask_private.py",
    "dask": "espnet3_flows/parallel/dask_private.py",
    "multiprocessing": "espnet3_flows/parallel/multiprocessing_private.py",
    "lhotse": "espnet3_flows/frontends/lhotse_private.py",
    "datasets": "espnet3_flows/inputs/formats/hf_fingerprint.py",
}
#: libraries whose private names no module may read
UNGATED = ("torch", "torchaudio", "numpy", "speechbrain", "kaldiio", "s3fs", "fsspec", "omegaconf", "dask_jobqueue",
           "pydantic", "asyncssh", "botocore", "aiobotocore", "soundfile", "transformers")


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def private_reads(source: str) -> list[tuple[int, str, str]]:
    """``(line, library, what)`` for each read of a private name of :data:`GATED` or :data:`UNGATED`
    libraries in ``source``."""
    libraries = set(GATED) | set(UNGATED)
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> the library module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in libraries:
                    modules[alias.asname or top] = alias.name if alias.asname else top
                    if _private(alias.name):
                        found.append((node.lineno, top, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0]
            if top in libraries:
                for alias in node.names:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    if _private(node.module) or _private(alias.name):
                        found.append((node.lineno, top, f"from {node.module} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append((node.lineno, modules[base.id].split(".")[0], f"{ast.unparse(node)}"))
    return sorted(found)


def test_private_names_are_read_only_in_their_librarys_gated_module():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for line, library, what in private_reads(path.read_text()):
            allowed = GATED.get(library)
            if allowed is None or not (where == allowed or (allowed.endswith("/") and where.startswith(allowed))):
                wrong.append(f"{where}:{line}: {what} (a private name of {library}: "
                             f"{'read it in ' + allowed if allowed else 'not to be read'})")
    assert wrong == [], "\n".join(wrong)


def test_the_gated_modules_exist_and_each_reads_what_it_is_for():
    for library, allowed in GATED.items():
        paths = sorted((ROOT / allowed).glob("*.py")) if allowed.endswith("/") else [ROOT / allowed]
        assert paths and all(p.exists() for p in paths), allowed
        if library not in ("prefect_dask", "dask", "datasets"):  # read by attribute on objects, or through a sibling
            assert any(lib == library for p in paths for _, lib, _ in private_reads(p.read_text())), (library, allowed)


def test_a_planted_read_of_each_kind_is_seen():
    planted = ("import prefect._internal.concurrency\n"
               "from lhotse.features.kaldi.layers import _get_strided_batch\n"
               "import multiprocessing.forkserver as fs\n"
               "x = fs._forkserver\n"
               "import torch\n"
               "y = torch._dynamo.config\n"
               "from prefect import flow\n"
               "z = flow.__name__\n")
    assert [(line, library) for line, library, _ in private_reads(planted)] == [
        (1, "prefect"), (2, "lhotse"), (4, "multiprocessing"), (6, "torch")]
