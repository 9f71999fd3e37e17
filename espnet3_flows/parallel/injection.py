"""Injection by parameter name, as ESPnet3 does it: one implementation for ``forward``, the
writer hooks and the state hooks of a runner (and anything else that receives a worker's
resources: the dict an ``EnvironmentProvider`` or a ``setup_fn`` builds, ESPnet3's "env").

A function receives the resources whose names are its parameters; one that takes ``**kwargs``
receives all of them. Positional arguments are passed as far as the function takes them, so a
hook written with fewer parameters than the engine offers (``close_writers(writers)`` of the
older ESPnet3 pages) is called with what it asks for.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Collection, Mapping


@dataclass(frozen=True)
class Parameters:
    """What a function accepts.

    Attributes:
        positional: Parameters that can be passed positionally, in order (``*args`` excluded).
        keywords: Names that can be passed as keywords.
        required: Keyword-passable parameters without a default.
        var_positional: Whether it takes ``*args``.
        var_keyword: Whether it takes ``**kwargs``.
    """

    positional: tuple[str, ...]
    keywords: frozenset[str]
    required: tuple[str, ...]
    var_positional: bool
    var_keyword: bool


@functools.lru_cache(maxsize=4096)
def parameters_of(func: Callable[..., Any]) -> Parameters:
    """The parameters of ``func`` (cached per function; a callable without a signature takes anything)."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return Parameters((), frozenset(), (), True, True)
    params = list(sig.parameters.values())
    return Parameters(
        positional=tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)),
        keywords=frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)),
        required=tuple(p.name for p in params if p.default is p.empty
                       and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)),
        var_positional=any(p.kind == p.VAR_POSITIONAL for p in params),
        var_keyword=any(p.kind == p.VAR_KEYWORD for p in params))


def injected(func: Callable[..., Any], resources: Mapping[str, Any], n_args: int = 0) -> dict[str, Any]:
    """The entries of ``resources`` that ``func`` receives when ``n_args`` arguments are passed
    positionally: all of them when it takes ``**kwargs``, else those named by its parameters
    (never one already bound to a positional argument)."""
    p = parameters_of(func)
    bound = set(p.positional[:n_args])
    if p.var_keyword:
        return {k: v for k, v in resources.items() if k not in bound}
    return {k: v for k, v in resources.items() if k in p.keywords and k not in bound}


def call_with_resources(func: Callable[..., Any], *args: Any, **resources: Any) -> Any:
    """Call ``func`` with as many of ``args`` as it takes positionally and the resources it
    accepts by name (see :func:`injected`)."""
    p = parameters_of(func)
    if not p.var_positional:
        args = args[:len(p.positional)]
    return func(*args, **injected(func, resources, len(args)))


def missing_keys(func: Callable[..., Any], keys: Collection[str], n_args: int = 1) -> list[str]:
    """Required parameters of ``func`` after its first ``n_args`` that none of ``keys`` supplies
    (none when it takes ``**kwargs`` and all of its named ones are supplied)."""
    p = parameters_of(func)
    bound = set(p.positional[:n_args])
    return [name for name in p.required if name not in bound and name not in keys]


def conflicting_keys(func: Callable[..., Any], resource_keys: Collection[str], kwargs: Collection[str]) -> list[str]:
    """Names given both in ``kwargs`` and by the resources that ``func`` would receive from both."""
    p = parameters_of(func)
    considered = set(kwargs) if p.var_keyword else set(kwargs) & p.keywords
    return sorted(considered & set(resource_keys))
