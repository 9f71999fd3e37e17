"""Job configuration: OmegaConf YAML plus ``key=value`` overrides, checked against typed dataclasses."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import importlib
import re
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from espnet3_flows.errors import ON_ERROR_POLICIES, Espnet3FlowsError

T = TypeVar("T")


class ConfigError(Espnet3FlowsError, ValueError):
    """A configuration value, key or file is invalid; raised before any work starts."""


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (f"{key}: {msg}" if key else msg) + _key_suggestion(exc)


def _key_suggestion(exc: OmegaConfBaseException) -> str:
    """`` (did you mean 'n_workers'?)`` for a key its config class does not have, when one is close."""
    schema, key = getattr(exc, "object_type", None), getattr(exc, "key", None)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema) and isinstance(key, str)):
        return ""
    names = [f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")]
    return "" if key in names else did_you_mean(key, names)


def did_you_mean(word: str, options: Iterable[Any]) -> str:
    """`` (did you mean 'local'?)``: the option closest to a misspelt ``word``, or ``""``."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(
    schema: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> T:
    """Build a typed config object from defaults, a YAML file and command-line overrides.

    Later sources win: the dataclass defaults, then ``base``, then the YAML file at ``path``,
    then ``params`` (e.g. a flow's typed parameters), then ``overrides`` such as
    ``["shard_size=64", "parallel.env=slurm"]``. The schema is in struct mode, so an unknown key or a value of
    the wrong type is a :class:`ConfigError` naming the key. A schema's ``CONFIG_ALIASES``
    (dotted alias → dotted key) are renamed in each source before merging, so an alias in a
    later source wins over the key in an earlier one, as the key itself would.

    Args:
        schema: A dataclass type describing the configuration.
        path: Optional YAML file.
        overrides: ``key=value`` strings in OmegaConf dot-list syntax.
        base: Optional mapping merged before the file.
        params: Optional dotted key → value (values as they are: no parsing; a mapping replaces
            the key's whole mapping), set after the file and before ``overrides``.

    Returns:
        An instance of ``schema`` (its ``__post_init__`` validation has run).
    """
    merged = merge_config(schema, path, overrides, base, params)
    with _config_errors():
        obj = OmegaConf.to_object(merged)
    assert isinstance(obj, schema)
    return obj


def merge_config(
    schema: type,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> DictConfig:
    """The sources :func:`load_config` merges, merged and type-checked key by key, but not yet
    validated: no section's checks have run, so nothing a value names has been imported (what
    :mod:`espnet3_flows.code_keys` inspects). Same arguments and errors as :func:`load_config`."""
    with _config_errors():
        cfg = OmegaConf.structured(schema)
        layers: list[DictConfig] = []
        if base:
            layers.append(OmegaConf.create(dict(base)))
        if path is not None:
            layers.append(_load_file(Path(path)))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
        aliases = getattr(schema, "CONFIG_ALIASES", {})
        merged = OmegaConf.merge(cfg, *(rename_aliases(layer, aliases) for layer in layers))
        for key, value in (params or {}).items():  # a value replaces the key's (a dict too)
            OmegaConf.update(merged, aliases.get(key, key), value, merge=False)
        if overrides:
            merged = OmegaConf.merge(merged, rename_aliases(OmegaConf.from_dotlist(list(overrides)), aliases))
        return merged


def _load_file(p: Path) -> DictConfig:
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        loaded = OmegaConf.load(p)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{p}: the top level of a config file must be a mapping")
    return loaded


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """OmegaConf's and the schemas' own errors as one-line :class:`ConfigError` s."""
    try:
        yield
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {_describe(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None


def check_choices(obj: Any, prefix: str = "", skip: Collection[str] = ()) -> None:
    """Raise :class:`ConfigError` for a field of the config dataclass ``obj`` whose value is not
    one of its ``choices`` (field metadata, the same list the UI form offers as a drop-down),
    naming the key, the choices and the closest one. A field whose metadata names a ``registry``
    (:class:`~espnet3_flows.registry.Registry`: its ``choices`` are the built-in names) is checked
    by ``registry.get``, which knows the installed plugins' names too. Fields named in ``skip``
    are not checked."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if f.name in skip or not choices:
            continue
        if "registry" in f.metadata:
            f.metadata["registry"].get(getattr(obj, f.name))
        else:
            check_choice(f"{prefix}{f.name}", getattr(obj, f.name), choices)


def check_choice(key: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``, naming ``key``, the
    choices and the closest one."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {tuple(choices)}, got {value!r}{did_you_mean(value, choices)}")


def check_on_error(value: Any, key: str = "on_error") -> None:
    """The one check of an ``on_error`` policy (:data:`~espnet3_flows.errors.ON_ERROR_POLICIES`),
    for the config (through its field's ``choices``), runners and planners alike."""
    check_choice(key, value, ON_ERROR_POLICIES)


#: ``cpu``, ``cuda`` or ``cuda:N`` as :class:`torch.device` reads them: N is ASCII digits without
#: a leading zero (``torch.device("cuda:01")`` is an error)
_DEVICE = re.compile(r"cpu|cuda(?::(?:0|[1-9][0-9]*))?")


def check_device(value: Any, key: str = "device") -> str:
    """``value`` if it names a device the jobs run models on: ``cpu``, ``cuda`` or ``cuda:N``,
    spelled as ``torch.device`` accepts them (``cuda:01`` is not); else :class:`ConfigError`
    naming ``key``. Whether that GPU exists is for the worker to find out."""
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise ConfigError(f"{key} must be 'cpu', 'cuda' or 'cuda:N' (N a GPU index such as 0 or 1, as "
                          f"torch.device reads it), got {value!r}")
    return value


def rename_aliases(layer: DictConfig, aliases: Mapping[str, str]) -> DictConfig:
    """``layer`` with each alias key (dotted) moved to the key it names; both given with
    different values is a :class:`ConfigError`."""
    if not aliases:
        return layer
    data = OmegaConf.to_container(layer, resolve=False)
    assert isinstance(data, dict)
    return OmegaConf.create(renamed_keys(data, aliases))


def renamed_keys(data: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """:func:`rename_aliases` on plain nested dicts: a copy of ``data`` with the alias keys moved
    (``data`` is left as it was)."""
    data = copy.deepcopy(dict(data))
    missing = object()
    for alias, key in aliases.items():
        *parents, leaf = alias.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        *kparents, kleaf = key.split(".")
        target: Any = data
        for part in kparents:
            target = target.setdefault(part, {})
        given = target.get(kleaf, missing)
        if given is not missing and given != value:
            raise ConfigError(f"{key} and {alias} are the same key ({alias} is its alias) but were given different "
                              f"values, {given!r} and {value!r}: give one of them")
        target[kleaf] = value
    return data


def to_plain(obj: Any) -> Any:
    """Convert a config dataclass (or OmegaConf node) into plain JSON-able dicts and lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, DictConfig) or OmegaConf.is_config(obj):
        return OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def split_cli_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Split ``[--config FILE] [key=value ...]`` command-line arguments.

    Returns:
        The config file path (or ``None``) and the list of overrides.

    Raises:
        ConfigError: on an argument that is neither ``--config FILE`` nor ``key=value``.
    """
    path: str | None = None
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(args):
                raise ConfigError("--config needs a file argument")
            path = args[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE and key=value overrides")
        i += 1
    return path, overrides


def import_target(target: str, key: str = "_target_") -> Any:
    """The object a ``_target_`` path (``package.module.Name``) names.

    Raises:
        ConfigError: naming ``key`` and the path, when it does not import.
    """
    module, _, name = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot import {target!r}: {exc}") from None


def check_targets(spec: Any, key: str) -> None:
    """Import every ``_target_`` in ``spec`` (in nested mappings and lists too), so that a typo is
    a config error on the driver before any cluster starts, not a failure on every worker."""
    if isinstance(spec, Mapping):
        if "_target_" in spec:
            import_target(spec["_target_"], f"{key}._target_")
        for name, value in spec.items():
            check_targets(value, f"{key}.{name}")
    elif isinstance(spec, (list, tuple)):
        for i, value in enumerate(spec):
            check_targets(value, f"{key}[{i}]")


def instantiate(spec: Mapping[str, Any], key: str = "_target_") -> Any:
    """Build the object ``spec`` describes with Hydra's ``instantiate``, as ESPnet3 does:
    ``_target_`` with keyword arguments, ``_args_``, ``_partial_``, ``_recursive_`` and nested
    targets in mappings and lists; containers reach the object as plain ``dict``/``list``.

    Raises:
        ConfigError: naming ``key`` and Hydra's reason, when building fails.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(dict(spec), _convert_="all")
    except InstantiationException as exc:
        raise ConfigError(f"{key}: {' '.join(str(exc).split())}") from exc


def describe_keys(schema: type) -> dict[str, str]:
    """Every config key of a dataclass schema (dotted for nested dataclasses) → its description,
    taken from the ``Attributes:`` section of each dataclass's docstring ("" if undocumented)."""
    import typing

    own: dict[str, str] = {}
    for klass in reversed(schema.__mro__):  # a base's docs, unless a subclass documents the key again
        own.update(_attribute_docs(klass))
    hints = typing.get_type_hints(schema)
    docs: dict[str, str] = {}
    for f in dataclasses.fields(schema):
        docs[f.name] = own.get(f.name, "")
        kind = hints.get(f.name)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            for key, text in describe_keys(kind).items():
                docs[f"{f.name}.{key}"] = text
    return docs


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name: text`` entries of the Google-style ``Attributes:`` section of ``cls.__doc__``."""
    import inspect

    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    docs: dict[str, str] = {}
    inside, current, indent = False, None, None
    for line in lines:
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line.strip() and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^(\s+)([A-Za-z_][A-Za-z0-9_]*)(?: \([^)]*\))?: (.*)$", line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            current = match.group(2)
            docs[current] = match.group(3).strip()
        elif current and line.strip():
            docs[current] += " " + line.strip()
    return docs
