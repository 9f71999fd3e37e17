"""Which config keys hold credentials, and copies of a config with them masked: the one rule that
every place showing or storing a config uses (flow parameters, ``--print-config``, logs, the
cluster's description) and that refuses credentials in a deployment's parameters.

A key holds a credential when its name says so (:func:`is_secret_key`), in any section:
``storage_options.secret``, ``parallel.options.connect_options.password`` (ssh),
``parallel.options.env.AWS_SECRET_ACCESS_KEY`` (a worker's environment), a ``NAME=value`` line of
a batch job's prologue (``export AWS_SECRET_ACCESS_KEY=...``). A typed config field may declare
itself either way with ``field(metadata={"secret": ...})`` (``tokens.token_list`` is no token);
a section (a nested config dataclass) is judged key by key, never by its own name.

Masking changes copies only: the driver keeps the real values, and the workers receive them over
Dask, inside the job's runner.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import PurePath
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from omegaconf import OmegaConf

from espnet3_flows.config import ConfigError, to_plain

#: What a masked value reads
MASK = "***"
#: A key whose name (any case) contains one of these holds a credential. ``key`` makes identifiers
#: such as ``AWS_ACCESS_KEY_ID`` and s3fs's ``key`` secret too: masking an identifier costs nothing,
#: while a rule that tried to tell identifiers from keys would let ``*_KEY`` variants through.
SECRET_WORDS = ("secret", "password", "passwd", "passphrase", "token", "key", "credential", "session", "auth")
#: Whole names that hold a credential without a secret word (asyncssh's smart-card PIN)
SECRET_NAMES = frozenset({"pin", "pkcs11_pin"})
#: A name that contains one of these is not secret despite a secret word (``endpoint_url``; an
#: endpoint is an address, and runs are debugged by it)
NOT_SECRET_WORDS = ("endpoint",)

#: ``NAME=value`` or ``export NAME=value``: a line of a batch job's prologue or a worker's env list
_ASSIGNMENT = re.compile(r"(\s*(?:export\s+)?)([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
#: A value that names a variable of the environment it is resolved in, not a credential
_ENV_REFERENCE = re.compile(r"\$\{oc\.env:[A-Za-z_][A-Za-z0-9_]*\}")


def is_secret_key(name: str) -> bool:
    """Whether a key (of any section, or an environment variable) named ``name`` holds a credential."""
    k = str(name).lower()
    if any(w in k for w in NOT_SECRET_WORDS):
        return False
    return k in SECRET_NAMES or any(w in k for w in SECRET_WORDS)


def holds_value(value: Any) -> bool:
    """Whether ``value`` carries anything a credential could be: not ``None``, a boolean, an empty
    string or container, a masked value (``***``), or an ``${oc.env:NAME}`` reference."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, str):
        return value not in ("", MASK) and not _ENV_REFERENCE.fullmatch(value.strip())
    if isinstance(value, Mapping):
        return any(holds_value(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(holds_value(v) for v in value)
    return True


def find_secrets(config: Any, schema: type | None = None) -> list[str]:
    """The key paths (``parallel.options.env.AWS_SECRET_ACCESS_KEY``, ``a.b[2]``) in ``config`` that
    hold a credential.

    Args:
        config: A config: a dataclass instance, an OmegaConf node, a pydantic model, or nested
            mappings and lists.
        schema: The config dataclass ``config`` follows when it is plain data (a deployment's
            parameters), so that its fields' declarations apply.
    """
    found: list[str] = []
    _walk(config, schema, "", found)
    return found


def mask_secrets(config: Any, schema: type | None = None) -> Any:
    """A plain copy of ``config`` (dicts and lists; arguments as for :func:`find_secrets`) with
    every value that holds a credential replaced by ``***``."""
    return _walk(config, schema, "", [])


def has_secrets(options: Mapping[str, Any] | None) -> bool:
    """Whether ``options`` (e.g. fsspec storage options, possibly nested) hold a credential."""
    return bool(find_secrets(options or {}))


def redact(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` (e.g. fsspec storage options) with credentials replaced by ``***``."""
    return mask_secrets(dict(options or {}))


def secrets_in_overrides(overrides: Iterable[str], schema: type | None = None) -> list[str]:
    """The key paths of ``key=value`` overrides (OmegaConf dot-list) that set a credential."""
    found: list[str] = []
    for item in overrides:
        key, _, value = str(item).partition("=")
        key = key.strip()
        try:
            nested: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]), resolve=False)
        except Exception:  # noqa: BLE001 - not valid dot-list syntax: the key path, as written
            nested = value
            for part in reversed(key.split(".")):
                nested = {part: nested}
        found += find_secrets(nested, schema)
    return found


def refuse_secrets(paths: Sequence[str]) -> None:
    """Raise a :class:`ConfigError` (one line, naming each key path) when ``paths``, credentials
    found in flow parameters (which Prefect stores and shows in plain text), is not empty."""
    if paths:
        raise ConfigError(
            f"flow parameters hold a credential ({', '.join(paths)}): Prefect stores and shows them in plain text, "
            "so the run is refused; give credentials to the worker's environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, an AWS profile; a value ${oc.env:NAME} names one of its variables) or a config "
            "file on the worker")


def _walk(node: Any, schema: type | None, path: str, found: list[str]) -> Any:
    """``node`` as plain data with credentials masked; their key paths appended to ``found``."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        schema = type(node)
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    else:
        node = _as_plain(node)
    if isinstance(node, Mapping):
        fields = _fields(schema)
        out: dict[Any, Any] = {}
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            declared, section = fields.get(str(key), (None, None))
            if section is not None:  # a section: its keys are judged, not its name
                out[key] = _walk(value, section, sub, found)
            elif (is_secret_key(key) if declared is None else declared) and holds_value(value):
                found.append(sub)
                out[key] = MASK
            elif declared is False:  # declared no credential, whatever it holds
                out[key] = to_plain(value)
            else:
                out[key] = _walk(value, None, sub, found)
        return out
    if isinstance(node, (list, tuple)):
        return [_walk_item(value, f"{path}[{i}]", found) for i, value in enumerate(node)]
    return str(node) if isinstance(node, PurePath) else node


def _walk_item(value: Any, path: str, found: list[str]) -> Any:
    """A list item: a ``NAME=value`` line is judged by ``NAME``; anything else is walked."""
    match = _ASSIGNMENT.fullmatch(value) if isinstance(value, str) else None
    if match and is_secret_key(match.group(2)) and holds_value(match.group(3)):
        found.append(f"{path} ({match.group(2)})")
        return f"{match.group(1)}{match.group(2)}={MASK}"
    return _walk(value, None, path, found)


def _as_plain(node: Any) -> Any:
    """A pydantic model (a flow's parameters) or an OmegaConf node as plain data; else ``node``."""
    if hasattr(node, "model_dump") and not isinstance(node, type):
        return node.model_dump()
    if OmegaConf.is_config(node):  # unresolved: an ${oc.env:NAME} shows as itself
        return OmegaConf.to_container(node, resolve=False)
    return node


@functools.cache
def _fields(schema: type | None) -> dict[str, tuple[bool | None, type | None]]:
    """A config dataclass's fields: name → (declared ``secret`` metadata or ``None``, the field's
    own config dataclass when it is a section)."""
    if schema is None or not dataclasses.is_dataclass(schema):
        return {}
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        kind = hints.get(f.name)
        section = kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None
        out[f.name] = (f.metadata.get("secret"), section)
    return out
