"""Config values that are code (a ``_target_``, an import path, a command, a scheduler to unpickle
from), and the rule that keeps them out of input nobody vetted: a deployment's run form is data.

A schema marks such a key with field metadata ``code``: a sentence saying what runs, or a function
of the section's plain data that returns it (``None`` when the value is data in that section, e.g.
a model directory that is code only for a toolkit whose model file builds Python objects). A
mapping key may list the sub-keys that are plain data (``data_keys``: ``parallel.options.queue``);
every other sub-key is code. Any mapping holding ``_target_``, in any key, is code too (Hydra
imports and calls it).

The check works on the merged plain data *before* the config is validated: validation imports
every ``_target_``, and importing a module runs it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any
from collections.abc import Callable, Collection, Mapping

from espnet3_flows.config import ConfigError
from espnet3_flows.errors import clip

#: field metadata naming why a key's value is code (a ``str``, or ``section data -> str | None``)
CODE = "code"
#: field metadata of a mapping key: its sub-keys that are plain data (all others are code)
DATA_KEYS = "data_keys"
#: what ``_target_`` in any mapping means
TARGET_WHY = "Hydra imports its _target_ and calls it"
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class CodeValue:
    """One config value that is code.

    Attributes:
        key: Its dotted key (``frontend.model``, ``parallel.options.preload``).
        value: The value.
        why: What running it does, for the error.
    """

    key: str
    value: Any
    why: str

    def shown(self) -> str:
        """The key and what names the code, short: a ``_target_``, else only the value's kind (a
        value such as a worker's ``env`` may hold a credential under a name that does not say so)."""
        target = _first_target(self.value)
        what = f"_target_ {target!r}" if target is not None else f"a {type(self.value).__name__} value"
        return f"{self.key} ({clip(what, 80)}: {self.why})"


class CodeFromFormError(ConfigError):
    """A run's parameters, which a deployment's form or trigger can set, name code that the
    deployment itself did not set or declare trusted."""


def code_values(schema: type, data: Mapping[str, Any], prefix: str = "") -> list[CodeValue]:
    """Every value in ``data`` (a config's plain data, as merged, not yet validated) that is code
    under ``schema``'s field metadata, and every mapping holding ``_target_``, with dotted keys.
    A code key left at an empty value (``""``, ``{}``, ``False``, ``None``) names nothing."""
    hints = typing.get_type_hints(schema)
    out: list[CodeValue] = []
    for f in dataclasses.fields(schema):
        if f.name not in data:
            continue
        value, key, kind = data[f.name], prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
            out += code_values(kind, value, key + ".")
            continue
        why = f.metadata.get(CODE)
        if callable(why):
            why = why(data)
        data_keys = f.metadata.get(DATA_KEYS)
        if why and value and data_keys is not None and isinstance(value, Mapping):
            for name, sub in value.items():
                out += (_targets(sub, f"{key}.{name}") if name in data_keys
                        else [CodeValue(f"{key}.{name}", sub, why)])
        elif why and value:
            out.append(CodeValue(key, value, why))
        else:
            out += _targets(value, key)
    return out


def _targets(value: Any, key: str) -> list[CodeValue]:
    if isinstance(value, Mapping):
        if "_target_" in value:
            return [CodeValue(key, value, TARGET_WHY)]
        return [v for name, sub in value.items() for v in _targets(sub, f"{key}.{name}")]
    if isinstance(value, (list, tuple)):
        return [v for i, sub in enumerate(value) for v in _targets(sub, f"{key}[{i}]")]
    return []


def _first_target(value: Any) -> Any:
    if isinstance(value, Mapping):
        if "_target_" in value:
            return value["_target_"]
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for sub in value:
            found = _first_target(sub)
            if found is not None:
                return found
    return None


def untrusted_code(schema: type, data: Mapping[str, Any], trusted_data: Mapping[str, Any],
                   trusted_keys: Collection[str] = ()) -> list[CodeValue]:
    """The code in ``data`` that nobody trusted set: not the same value at the same key in
    ``trusted_data`` (what the operator wrote), and not under a key in ``trusted_keys`` (keys the
    operator declared open to the form: ``parallel.options`` opens every option)."""
    trusted = {v.key: v.value for v in code_values(schema, trusted_data)}

    def declared(key: str) -> bool:
        return any(key == k or key.startswith(k + ".") or key.startswith(k + "[") for k in trusted_keys)

    return [v for v in code_values(schema, data) if not declared(v.key) and trusted.get(v.key, _MISSING) != v.value]


def refuse_untrusted_code(schema: type, data: Mapping[str, Any], trusted_data: Mapping[str, Any],
                          trusted_keys: Collection[str] = (), source: str = "this run's parameters",
                          remedy: str = "") -> None:
    """Raise :class:`CodeFromFormError` naming every key of :func:`untrusted_code`, in one line."""
    bad = untrusted_code(schema, data, trusted_data, trusted_keys)
    if bad:
        raise CodeFromFormError(f"{source} name code, refused before anything is imported: "
                                f"{'; '.join(v.shown() for v in bad)}{'; ' + remedy if remedy else ''}")


def when(predicate: Callable[[Mapping[str, Any]], bool], why: str) -> Callable[[Mapping[str, Any]], str | None]:
    """A ``code`` metadata function: ``why`` when ``predicate(section data)`` holds, else ``None``."""
    return lambda section: why if predicate(section) else None
