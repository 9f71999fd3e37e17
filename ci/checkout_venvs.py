"""Print the virtual environments under a cache directory that belong to one checkout: those
holding an editable install of it (pip's ``direct_url.json`` names the checkout's path), one per
line. ``make distclean`` removes these, never another clone's venv (which may be in use).

Usage: ``python3 ci/checkout_venvs.py CHECKOUT CACHE_DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse


def editable_source(venv: Path) -> Path | None:
    """The directory ``venv``'s editable espnet3-flows install points at, if it has one."""
    for record in venv.glob("lib/python3*/site-packages/espnet3_flows-*.dist-info/direct_url.json"):
        try:
            data = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        url = urlparse(data.get("url", ""))
        if url.scheme == "file" and data.get("dir_info", {}).get("editable"):
            return Path(unquote(url.path))
    return None


def checkout_venvs(checkout: Path, cache: Path) -> list[Path]:
    """The ``venv-*`` directories under ``cache`` whose editable install is ``checkout``."""
    target = checkout.resolve()
    found = []
    for venv in sorted(cache.glob("venv-*")):
        source = editable_source(venv)
        if source is not None and source.resolve() == target:
            found.append(venv)
    return found


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    for path in checkout_venvs(Path(sys.argv[1]), Path(sys.argv[2])):
        print(path)
