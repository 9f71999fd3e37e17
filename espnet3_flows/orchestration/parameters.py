"""A job's config as its flow's typed parameters: the Prefect UI's form for every key.

Each top-level config key is one flow parameter of the key's type; a section (``frontend``,
``parallel``, ``xvector``) is a pydantic model mirroring its dataclass, so the UI renders a nested
form with every key, its default and its description (from the dataclass's ``Attributes:``).
Credentials (``storage_options``) and alias keys are left out: flow parameters are stored and
shown in plain text; a credential in any other key (``parallel.options.env.AWS_SECRET_ACCESS_KEY``)
is refused when the run starts (:mod:`espnet3_flows.credentials`). Values are only type-checked here; the config's own checks run once, after
the file, the parameters and the overrides are merged.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from espnet3_flows.config import describe_keys, renamed_keys

#: Config keys that never become flow parameters (credentials: see ``docs/credentials.md``)
SECRET_KEYS = frozenset({"storage_options"})


@dataclasses.dataclass(frozen=True)
class FormField:
    """One flow parameter: a top-level config key."""

    name: str
    annotation: Any
    default: Any
    doc: str


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _annotation(f: dataclasses.Field, kind: Any) -> Any:
    """The field's type, or a ``Literal`` of its ``choices`` (field metadata): a drop-down in the UI
    (for a field backed by a registry, its names: the installed plugins' included)."""
    choices = list(f.metadata.get("choices") or ())
    registry = f.metadata.get("registry")
    if registry is not None:  # the built-in names in their order, then the installed plugins'
        choices += [name for name in registry.names() if name not in choices]
    return typing.Literal[tuple(choices)] if choices else kind


def _hidden(schema: type) -> frozenset[str]:
    return SECRET_KEYS | frozenset(getattr(schema, "CONFIG_ALIASES", {}))


def _fields(section: type, prefix: str, hidden: frozenset[str]) -> list[FormField]:
    """The form fields of the dataclass ``section`` (its keys below ``prefix``), less ``hidden``:
    a nested dataclass becomes a nested model (its default: that model with its defaults)."""
    docs = describe_keys(section)
    hints = typing.get_type_hints(section)
    out = []
    for f in dataclasses.fields(section):
        if prefix + f.name in hidden:
            continue
        kind, doc = hints[f.name], docs.get(f.name, "")
        if dataclasses.is_dataclass(kind):
            model = section_model(kind, f"{prefix}{f.name}.", hidden)
            if not doc or doc.startswith("See "):  # a pointer to the class: its first paragraph instead
                doc = " ".join((kind.__doc__ or "").split("\n\n")[0].split())
            out.append(FormField(f.name, model, model(), doc))
        else:
            out.append(FormField(f.name, _annotation(f, kind), _default(f), doc))
    return out


@functools.cache
def section_model(section: type, prefix: str = "", hidden: frozenset[str] = frozenset()) -> type[BaseModel]:
    """A pydantic model with the fields of the dataclass ``section`` (types, defaults and
    descriptions; nested dataclasses as nested models), without the dotted keys in ``hidden``. A
    section's ``CONFIG_ALIASES`` (old spellings, e.g. ``parallel.inline_shards``) are read as
    their keys, so a deployment's parameters saved before a key moved still validate."""
    fields = {f.name: (f.annotation, Field(default_factory=f.annotation, description=f.doc or None))
              if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
              else (f.annotation, Field(default=f.default, description=f.doc or None))
              for f in _fields(section, prefix, hidden)}
    aliases = dict(getattr(section, "CONFIG_ALIASES", {}) if prefix else {})  # a root's aliases: its config's
    validators = {"old_spellings": model_validator(mode="before")(functools.partial(_old_spellings, aliases=aliases))
                  } if aliases else {}
    return create_model(f"{section.__name__}Form", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
                        __doc__=(section.__doc__ or "").strip().split("\n\n")[0], __validators__=validators,
                        **fields)


def _old_spellings(cls: type, data: Any, aliases: Mapping[str, str]) -> Any:
    return renamed_keys(data, aliases) if isinstance(data, dict) else data


def form_fields(schema: type) -> list[FormField]:
    """The flow parameters of a job's config ``schema``: its top-level keys, in order, less
    credentials and aliases."""
    return _fields(schema, "", _hidden(schema))


def dotted_values(schema: type, values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flow parameter values as dotted config keys: sections are opened down to their keys
    (``{"parallel": {"env": "slurm"}}`` → ``{"parallel.env": "slurm"}``); any other value, a
    mapping such as ``manifests`` too, is one key's whole value."""
    hints = typing.get_type_hints(schema)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if f.name not in values:
            continue
        value = values[f.name]
        if isinstance(value, BaseModel):
            value = value.model_dump()
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(value, Mapping):  # its old spellings read as their keys
            value = renamed_keys(value, getattr(kind, "CONFIG_ALIASES", {}))
            out.update(dotted_values(kind, value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out
