"""Packages whose public names are imported on first use, so that importing a job package
(to read its config, to plan) imports no numpy or torch."""

from __future__ import annotations

import importlib
from typing import Any
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module path)
    when ``name`` is first read; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
