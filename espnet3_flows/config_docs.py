"""The configuration tables of ``docs/configuration.md``, made from the config classes' docstrings.

Each config key's meaning is written once, in the ``Attributes:`` section of its config
dataclass; ``--help``, the Prefect UI form and these tables all read it there (defaults
come from the fields, fixed values from their ``choices``). The page holds each table between
``<!-- config-table: NAME -->`` and ``<!-- /config-table -->``; NAME is a job (its config class,
from :mod:`espnet3_flows.job_registry`), ``engine`` (the keys every job has,
:class:`~espnet3_flows.utterance_job.EngineConfig`) or ``parallel``
(:class:`~espnet3_flows.parallel.parallel_config.ParallelConfig`), optionally followed by
``collapse=SECTION[,SECTION]``: sections shown as one row (a section documented in another table);
or ``backends``: the built-in ``parallel.env`` values, from their declarations; or
``env-options``: the ``parallel.options`` the built-in envs read themselves (their own options
dataclasses, :mod:`espnet3_flows.parallel.backends.own_options`).
A job's table lists its own keys; the engine's keys it shares unchanged are one row pointing at
the engine's table. ``tests/test_config_docs.py`` fails when the page differs from this::

    python -m espnet3_flows.config_docs           # rewrite docs/configuration.md's tables
    python -m espnet3_flows.config_docs --check   # exit 1, naming the tables that differ
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

from espnet3_flows.config import describe_keys

#: the command that rewrites the tables (what a failing check tells you to run)
REGENERATE = "python -m espnet3_flows.config_docs"
#: ``<!-- config-table: NAME [collapse=a,b] -->`` ... ``<!-- /config-table -->``
MARKER = re.compile(r"(<!-- config-table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /config-table -->)", re.DOTALL)
#: where the page sends a reader for the keys that tables collapse into one row
ANCHORS = {"engine": "#engine-configuration-keys-of-every-job", "parallel": "#parallel-configuration-parallel"}
#: a Sphinx cross-reference, ``:class:`~pkg.mod.Name``` (``~``: shown by its last part)
_ROLE = re.compile(r":(?:class|func|mod|meth|data|attr):`(~?)([^`]+)`")


class ConfigDocsError(ValueError):
    """A table cannot be made: an unknown table name, or a key without a description."""


def table_schema(name: str) -> type:
    """The config class of the table called ``name``."""
    if name == "engine":
        from espnet3_flows.job_config import EngineConfig

        return EngineConfig
    if name == "parallel":
        from espnet3_flows.parallel.parallel_config import ParallelConfig

        return ParallelConfig
    from espnet3_flows.job_registry import available_jobs

    jobs = available_jobs()
    if name not in jobs:
        raise ConfigDocsError(f"config-table {name!r}: not engine, parallel or a job ({', '.join(jobs)})")
    return jobs[name].config_class


def markdown(text: str) -> str:
    """Docstring text as a markdown table cell: ``code`` in single backticks, Sphinx roles as
    their (short) names, ``|`` escaped."""
    text = _ROLE.sub(lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", text)
    return text.replace("``", "`").replace("|", "\\|")


def _value(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def _defaults(schema: type) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(schema))  # type: ignore[return-value]


def _leaves(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, type | None]]:
    """``(dotted key, field, section class or None)`` of every key, sections before their keys."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        section = kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None
        yield prefix + f.name, f, section
        if section is not None:
            yield from _leaves(section, f"{prefix}{f.name}.")


def _shared_engine_keys(schema: type, docs: dict[str, str], defaults: dict[str, Any]) -> list[str]:
    """The engine's keys that ``schema`` has unchanged (same default, same description)."""
    from espnet3_flows.job_config import EngineConfig

    if schema is EngineConfig or not issubclass(schema, EngineConfig):
        return []
    engine_docs, engine_defaults = describe_keys(EngineConfig), _defaults(EngineConfig)
    return [f.name for f in dataclasses.fields(EngineConfig)
            if docs[f.name] == engine_docs[f.name] and defaults[f.name] == engine_defaults[f.name]]


def config_table(name: str, collapse: Sequence[str] = ()) -> str:
    """The markdown table of the config keys of table ``name`` (see the module's docs).

    Raises:
        ConfigDocsError: for an unknown name or a key whose ``Attributes:`` entry is missing.
    """
    from espnet3_flows.parallel.parallel_config import ParallelConfig

    if name == "backends":
        return backends_table()
    if name == "env-options":
        return env_options_table()
    schema = table_schema(name)
    docs, defaults = describe_keys(schema), _defaults(schema)
    unknown = [c for c in collapse if c not in defaults or not isinstance(defaults[c], dict)]
    if unknown:
        raise ConfigDocsError(f"config-table {name}: collapse={','.join(unknown)} names no section of {schema.__name__}")
    shared = _shared_engine_keys(schema, docs, defaults)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    skip: tuple[str, ...] = ()  # the keys of sections shown as one row (or not at all)
    for key, f, section in _leaves(schema):
        if key.startswith(skip):
            continue
        if key in shared:
            skip += (key + ".",)
            continue
        doc = docs.get(key, "")
        if not doc:
            raise ConfigDocsError(f"{schema.__name__}: key {key!r} has no description in its class's Attributes: "
                                  "document it there (docs/configuration.md, --help and the UI form read it)")
        if section is not None:  # expanded: its keys follow, the section itself has no row
            if section is ParallelConfig and name != "parallel":
                skip += (key + ".",)
                rows.append(f"| `{key}.*` | | {markdown(doc)} See [Parallel configuration]({ANCHORS['parallel']}). |")
            elif key in collapse:
                skip += (key + ".",)
                rows.append(f"| `{key}.*` | | {markdown(doc)} |")
            continue
        text = markdown(doc)
        choices = f.metadata.get("choices")
        if choices:
            text += f" One of {', '.join(_value(c) for c in choices)}"
            registry = f.metadata.get("registry")
            text += f", or a plugin's (entry points `{registry.group}`)." if registry is not None else "."
        value = defaults
        for part in key.split("."):
            value = value[part]
        rows.append(f"| `{key}` | {_value(value)} | {text} |")
    if shared:
        keys = ", ".join(f"`{k}.*`" if k == "parallel" else f"`{k}`" for k in shared)
        rows.append(f"| {keys} | | the engine's keys, the same for every job: see "
                    f"[Engine configuration]({ANCHORS['engine']}) |")
    return "\n".join(rows) + "\n"


def backends_table() -> str:
    """The table of the built-in ``parallel.env`` values, from their declarations
    (:mod:`espnet3_flows.parallel.backends`; installed plugins' are not listed)."""
    from espnet3_flows.parallel.backends import BACKENDS, backend_rows

    builtin = {n: b for n, b in BACKENDS.items().items() if BACKENDS.is_builtin(n)}
    lines = ["| `parallel.env` | what | cluster | `n_workers` counts | needs | extra |", "| --- | --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(markdown(cell) for cell in row) + " |" for row in backend_rows(builtin)]
    return "\n".join(lines) + "\n"


def env_options_table() -> str:
    """The table of the ``parallel.options`` keys the built-in envs read themselves, each with its
    default, the envs that have it and its meaning (from its options dataclass)."""
    from espnet3_flows.parallel.backends import BACKENDS

    envs: dict[str, list[str]] = {}
    found: dict[str, tuple[dataclasses.Field, str]] = {}
    for name, placement in BACKENDS.items().items():
        if not BACKENDS.is_builtin(name) or placement.own_options is None:
            continue
        docs = describe_keys(placement.own_options)
        for f in dataclasses.fields(placement.own_options):
            envs.setdefault(f.name, []).append(name)
            if not docs.get(f.name):
                raise ConfigDocsError(f"{placement.own_options.__name__}: option {f.name!r} has no description")
            found.setdefault(f.name, (f, docs[f.name]))
    rows = ["| key | default | envs | meaning |", "|---|---|---|---|"]
    for key, (f, doc) in found.items():
        text = markdown(doc)
        if f.metadata.get("choices"):
            text += f" One of {', '.join(_value(c) for c in f.metadata['choices'])}."
        rows.append(f"| `parallel.options.{key}` | {_value(f.default)} | {', '.join(f'`{e}`' for e in envs[key])} | "
                    f"{text} |")
    return "\n".join(rows) + "\n"


def _parse(spec: str) -> tuple[str, list[str]]:
    name, *options = spec.split()
    collapse: list[str] = []
    for option in options:
        key, _, value = option.partition("=")
        if key != "collapse" or not value:
            raise ConfigDocsError(f"config-table {spec!r}: unknown option {option!r} (collapse=SECTION[,SECTION])")
        collapse += value.split(",")
    return name, collapse


def render(text: str) -> str:
    """``text`` (the page) with every config table made anew from the config classes."""
    def table(match: re.Match[str]) -> str:
        name, collapse = _parse(match.group("spec"))
        return f"{match.group(1)}{config_table(name, collapse)}{match.group(4)}"

    return MARKER.sub(table, text)


def table_names(text: str) -> list[str]:
    """The names of the config tables in ``text``, in order."""
    return [_parse(m.group("spec"))[0] for m in MARKER.finditer(text)]


def stale_tables(text: str) -> list[str]:
    """The names of the tables of ``text`` that differ from what :func:`render` makes."""
    pairs = zip(MARKER.finditer(text), MARKER.finditer(render(text)), strict=True)  # render keeps every marker
    return [_parse(old.group("spec"))[0] for old, new in pairs if old.group(0) != new.group(0)]


def main(argv: Sequence[str] | None = None) -> int:
    """``[--check] [PAGE]`` (default ``docs/configuration.md``): rewrite the tables (or, with ``--check``, report stale ones)."""
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    path = Path(paths[0] if paths else Path(__file__).resolve().parents[1] / "docs" / "configuration.md")
    text = path.read_text()
    stale = stale_tables(text)
    if check:
        if stale:
            print(f"{path}: config tables {', '.join(stale)} differ from the config classes' docstrings; "
                  f"run: {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    if stale:
        path.write_text(render(text))
    print(f"{path}: {len(table_names(text))} config tables, {len(stale)} rewritten ({', '.join(stale) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
