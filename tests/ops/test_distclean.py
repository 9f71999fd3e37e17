"""``make distclean`` removes this checkout's virtual environments and no other clone's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[2]


def _venv(cache: Path, name: str, editable_of: Path | None) -> Path:
    """A venv directory as pip leaves it: with an editable espnet3-flows of ``editable_of``."""
    venv = cache / name
    (venv / "bin").mkdir(parents=True)
    if editable_of is not None:
        info = venv / "lib" / "python3.11" / "site-packages" / "espnet3_flows-0.1.0.dist-info"
        info.mkdir(parents=True)
        (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True},
                                                          "url": "file://" + quote(str(editable_of))}))
    return venv


def test_distclean_keeps_other_clones_venvs(tmp_path):
    checkout, other = tmp_path / "checkout", tmp_path / "other-clone"
    (checkout / "ci").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "ci/checkout_venvs.py"):
        shutil.copy(ROOT / name, checkout / name)
    (checkout / "exp").mkdir()
    home = tmp_path / "home"
    cache = home / ".cache" / "espnet3-flows"
    mine, mine_old = _venv(cache, "venv-aaaa", checkout), _venv(cache, "venv-bbbb", checkout)
    theirs, unknown = _venv(cache, "venv-cccc", other), _venv(cache, "venv-dddd", None)
    (cache / "bench-data").mkdir()

    proc = subprocess.run(["make", "-s", "-C", str(checkout), "distclean", f"HOME={home}", f"PYTHON={sys.executable}"],
                          capture_output=True, text=True, timeout=60)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not mine.exists() and not mine_old.exists()
    assert theirs.is_dir() and unknown.is_dir() and (cache / "bench-data").is_dir()
    assert not (checkout / "exp").exists()
    assert f"removing {mine}" in proc.stdout and str(theirs) not in proc.stdout


def test_a_checkout_path_that_needs_quoting_is_matched(tmp_path):
    """pip writes the path as a file URL (a space as %20): it is compared unquoted."""
    checkout = tmp_path / "my checkout #1"
    checkout.mkdir()
    cache = tmp_path / "cache"
    mine, theirs = _venv(cache, "venv-1", checkout), _venv(cache, "venv-2", tmp_path / "my checkout")
    proc = subprocess.run([sys.executable, str(ROOT / "ci" / "checkout_venvs.py"), str(checkout), str(cache)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(mine)], (proc.stdout, theirs)


def test_the_suite_runs_without_the_variables_of_the_make_that_started_it(tmp_path):
    """``.ci/run`` runs ``make test VENV=<its venv>``; make exports that to pytest. A test running
    ``make distclean`` then removed the suite's own venv (the CI run of stop 65). Run here under a
    real ``make`` with a decoy ``VENV``: the distclean test leaves it alone."""
    decoy = _venv(tmp_path / "ci", "venv", ROOT)
    (decoy / "keep").write_text("the venv the suite runs from")
    makefile = tmp_path / "Makefile"
    test = "tests/ops/test_distclean.py::test_distclean_keeps_other_clones_venvs"
    makefile.write_text(f"run:\n\t{sys.executable} -m pytest -q -p no:cacheprovider -p no:xdist {test}\n")
    proc = subprocess.run(["make", "-s", "-f", str(makefile), "run", f"VENV={decoy}", "PYTEST_ARGS=-q -x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (decoy / "keep").is_file(), proc.stdout


def test_make_variables_are_read_as_make_writes_them(tmp_path):
    from tests.conftest import _forget_the_make_that_started_us

    (tmp_path / "Makefile").write_text("all:\n\t@env -0\n")
    proc = subprocess.run(["make", "-s", "-j2", "-C", str(tmp_path), "all", "VENV=/tmp/a b", "PYTEST_ARGS=-q X=1"],
                          capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "KEEP": "1"})
    environ = dict(item.split("=", 1) for item in proc.stdout.split("\0") if item)
    assert environ["VENV"] == "/tmp/a b" and "MAKEFLAGS" in environ, environ
    removed = _forget_the_make_that_started_us(environ)
    assert {"VENV", "PYTEST_ARGS", "MAKEFLAGS", "MAKELEVEL"} <= set(removed), (removed, environ)
    assert "X" not in removed and environ["KEEP"] == "1" and "VENV" not in environ, environ
