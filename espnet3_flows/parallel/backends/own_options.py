"""A placement's own options: the keys of ``parallel.options`` that it reads itself (typed, in a
dataclass of its own) instead of passing them to its cluster class.

``parallel.options`` holds what the cluster class is called with (``queue``, ``memory``, ...)
and, beside it, the few settings only one kind of placement has: ``start_method`` and
``inline_shards`` of ``local``, ``trim_worker_memory`` of the clusters whose workers the run
starts, ``address`` or ``scheduler_file`` of ``address``. Each placement names its dataclass
(:attr:`~espnet3_flows.parallel.backends.base.Placement.own_options`); its fields are read from
``parallel.options`` with their types checked here, and left out of the cluster's keyword
arguments. The keys were top-level ``parallel`` keys before; those spellings are still read
(:data:`~espnet3_flows.parallel.parallel_config.ParallelConfig.CONFIG_ALIASES`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar
from collections.abc import Mapping

from espnet3_flows.config import ConfigError, check_choices

T = TypeVar("T")
_TYPES: dict[Any, tuple[type, ...]] = {bool: (bool,), int: (int,), str: (str,), float: (float, int)}
_SAID = {bool: "true or false", int: "an integer", str: "a string", float: "a number"}


def own_option_names(schema: type | None) -> frozenset[str]:
    """The field names of a placement's options dataclass (none without one)."""
    return frozenset(f.name for f in dataclasses.fields(schema)) if schema is not None else frozenset()


def read_own_options(schema: type[T], options: Mapping[str, Any], placement: str) -> T:
    """``schema``'s instance from the entries of ``options`` that are its fields (the others are
    the cluster's), each of its field's type; its ``choices`` (field metadata) and its own
    ``__post_init__`` checks run.

    Raises:
        ConfigError: naming ``parallel.options.<key>``, the type it needs and the ``placement``
            (its ``parallel.env``).
    """
    hints = typing.get_type_hints(schema)
    given = {}
    for f in dataclasses.fields(schema):  # type: ignore[arg-type]
        if f.name not in options:
            continue
        value, kind = options[f.name], hints[f.name]
        allowed = _TYPES.get(kind, (object,))
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ConfigError(f"parallel.options.{f.name} must be {_SAID.get(kind, kind)} for "
                              f"parallel.env={placement}, got {value!r}")
        given[f.name] = value
    obj = schema(**given)
    check_choices(obj, "parallel.options.")
    return obj
