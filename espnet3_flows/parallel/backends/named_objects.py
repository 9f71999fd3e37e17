"""What a backend names by a dotted path: its cluster class or factory (imported when needed,
the error naming the pip extra that installs it) and the keywords a callable takes."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from espnet3_flows.config import ConfigError


def extra_hint(extra: str) -> str:
    """`` (pip install 'espnet3-flows[EXTRA]')`` for an error message, or nothing without an extra."""
    return f" (pip install 'espnet3-flows[{extra}]')" if extra else ""


def module_of(path: str) -> str:
    """The module part of ``path`` (``module.Attr`` or ``module:Attr``)."""
    return path.rpartition(":")[0] if ":" in path else path.rpartition(".")[0]


def import_object(path: str, what: str, extra: str = "") -> Any:
    """The object ``path`` (``module.Attr`` or ``module:Attr``) names."""
    module, sep, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"{what}: {path!r} is not an importable name such as package.module.Class")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(f"{what} needs {module}, which cannot be imported: {exc}{extra_hint(extra)}") from None
    except AttributeError:
        raise ConfigError(f"{what}: module {module} has no {name!r}") from None


def keywords_of(func: Any) -> tuple[set[str], bool]:
    """(names ``func`` takes by keyword, whether it also takes ``**kwargs``)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return set(), True
    return ({p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)},
            any(p.kind == p.VAR_KEYWORD for p in params))
