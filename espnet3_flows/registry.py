"""One registry helper for every extension point: jobs, manifest formats, cluster backends,
feature frontends and x-vector toolkits.

A registry maps names to entries. Built-in entries and a plugin's are declared alike, as an entry
point names its object (``"package.module:attr"``): the registry's ``builtins`` list this
package's own, loaded in that order on first use; a package installed elsewhere adds entries
through the registry's entry-point group, which is read the first time a name is not found or all
names are asked for. No module registers anything when it is imported. A lab's own package
therefore adds a frontend, a format, a toolkit or a cluster without editing this one (lhotse's
``register_extractor`` is the model)::

    # the lab's pyproject.toml
    [project.entry-points."espnet3_flows.frontends"]
    mfcc = "lab_plugins.frontends:MFCC"

The entry point's object is given to the registry's ``accept`` function, which checks it and
returns the entry (a class may be instantiated there). An entry point whose name is already
taken by a built-in, or whose object cannot be loaded, is an error naming the entry point and
its distribution when that name is asked for; listing the names (``--help``, the UI's drop-down)
skips it with one warning.

The groups (:data:`ENTRY_POINT_GROUPS`) are ``espnet3_flows.jobs``, ``espnet3_flows.formats``,
``espnet3_flows.backends``, ``espnet3_flows.frontends`` and ``espnet3_flows.xvector_toolkits``;
``docs/plugins.md`` shows a package using all of them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
import warnings
from typing import Any, Generic, TypeVar
from collections.abc import Callable, Iterable, Mapping, Sequence

from espnet3_flows.config import ConfigError, did_you_mean

T = TypeVar("T")

#: every registry's entry-point group, by what it registers
ENTRY_POINT_GROUPS = {
    "job": "espnet3_flows.jobs",
    "manifest format": "espnet3_flows.formats",
    "cluster backend": "espnet3_flows.backends",
    "frontend": "espnet3_flows.frontends",
    "x-vector toolkit": "espnet3_flows.xvector_toolkits",
}


class RegistryError(ConfigError):
    """A name no entry has, or a plugin entry point that cannot be used."""


class Registry(Generic[T]):
    """Names → entries of one extension point.

    Args:
        what: What an entry is, for messages (``"frontend"``); also picks the entry-point group
            from :data:`ENTRY_POINT_GROUPS` unless ``group`` is given.
        key: The config key that names an entry, for messages (``"frontend.type"``).
        builtins: The built-in entries as ``"package.module:attr"`` references: a table of
            ``{name: reference}`` (as a ``pyproject.toml`` declares entry points: each object's
            ``name`` must be its key), or a sequence of references, each an entry or a mapping of
            names to entries (registered under their ``name``), or a function that returns such a
            sequence (found by a scan). Loaded once, on first use, in this order, each checked by
            ``accept`` as a plugin's is.
        accept: ``(entry point name, loaded object) -> entry``: checks a plugin's object (raise
            ``TypeError`` with the reason) and returns what to register; the object itself by default.
        group: The entry-point group (default: ``ENTRY_POINT_GROUPS[what]``).
        error: The exception class of an unknown name (a :class:`RegistryError` by default).
    """

    def __init__(self, what: str, key: str, *,
                 builtins: Mapping[str, str] | Sequence[str] | Callable[[], Sequence[str]] = (),
                 accept: Callable[[str, Any], T] | None = None, group: str = "",
                 error: Callable[[str], Exception] = RegistryError):
        self.what, self.key = what, key
        self.group = group or ENTRY_POINT_GROUPS[what]
        self._builtins = builtins
        self._accept = accept or (lambda name, obj: obj)
        self._error = error
        self._entries: dict[str, T] = {}
        self._builtin_names: set[str] = set()
        self._broken: dict[str, str] = {}  # entry point name -> why it cannot be used
        self._state = "empty"  # -> "loading" -> "builtins" -> "plugins"
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<registry of {self.what}s ({self.group}): {', '.join(self._entries) or 'not loaded'}>"

    def register(self, name: str, entry: T) -> T:
        """Add (or replace) ``entry`` under ``name``, after the built-in ones; returns it. An entry
        registered before the installed packages' are read counts as built in (a plugin cannot
        replace it)."""
        self._load_builtins()
        return self._add(name, entry)

    def _add(self, name: str, entry: T) -> T:
        with self._lock:
            self._entries[name] = entry
            if self._state != "plugins":
                self._builtin_names.add(name)
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register an entry of their own)."""
        with self._lock:
            self._entries.pop(name, None)
            self._builtin_names.discard(name)

    def get(self, name: str) -> T:
        """The entry called ``name``: a built-in one, else one an installed package adds.

        Raises:
            RegistryError: (or the registry's ``error``) no entry has that name, naming the
                closest and every known one; or the entry point of that name cannot be used.
        """
        self._load_builtins()
        if name not in self._entries:
            self._load_plugins()
        if name in self._entries:
            return self._entries[name]
        if name in self._broken:
            raise RegistryError(self._broken[name])
        raise self._error(f"{self.key}: unknown {self.what} {name!r}{did_you_mean(name, self._entries)}; "
                          f"known: {', '.join(sorted(self._entries))}")

    def find(self, name: str) -> T | None:
        """The entry registered as ``name`` so far, or ``None``: loads nothing."""
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        if name not in self._entries:
            self._load_plugins()
        return name in self._entries

    def names(self, plugins: bool = True) -> tuple[str, ...]:
        """Every name, built-in ones first (in registration order); with ``plugins``, those of
        installed packages too (an unusable one is skipped with a warning)."""
        self._load_builtins()
        if plugins:
            self._load_plugins()
        return tuple(self._entries)

    def items(self) -> dict[str, T]:
        """Every entry by name, the installed packages' included."""
        self.names()
        return dict(self._entries)

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is one of this package's own entries."""
        self._load_builtins()
        return name in self._builtin_names

    def _load_builtins(self) -> None:
        if self._state in ("builtins", "plugins"):
            return
        with self._lock:  # another thread waits here until the built-in entries are in
            if self._state != "empty":  # loaded meanwhile, or being loaded by this thread
                return
            self._state = "loading"
            try:
                refs = self._builtins() if callable(self._builtins) else self._builtins
                for declared, ref in refs.items() if isinstance(refs, Mapping) else ((None, r) for r in refs):
                    module, _, attr = ref.partition(":")
                    found = getattr(importlib.import_module(module), attr)
                    for entry in found.values() if isinstance(found, Mapping) else [found]:
                        name = declared or entry.name  # a declared name is checked by accept
                        self._add(name, self._accept(name, entry))
            except BaseException:
                self._state = "empty"
                raise
            self._state = "builtins"

    def _load_plugins(self) -> None:
        if self._state in ("plugins", "loading"):  # (a built-in entry that asks for a name while loading)
            return
        with self._lock:
            if self._state == "plugins":
                return
            self._load_builtins()
            self._state = "plugins"
            for ep in _entry_points(self.group):
                self._load_entry_point(ep)
            if self._broken:
                warnings.warn("; ".join(self._broken.values()), RuntimeWarning, stacklevel=3)

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        dist = getattr(getattr(ep, "dist", None), "name", "") or "an installed package"
        where = f"entry point {ep.name} = {ep.value} ({self.group}, from {dist})"
        if ep.name in self._builtin_names:
            self._broken[ep.name] = f"{where}: {self.what} {ep.name!r} is built in; a plugin cannot replace it"
            return
        try:
            entry = self._accept(ep.name, ep.load())
        except Exception as exc:  # noqa: BLE001 - an ImportError, or the accept function's TypeError: recorded
            self._broken[ep.name] = f"{where} cannot be used: {type(exc).__name__}: {exc}"
            return
        self._entries[ep.name] = entry


def _entry_points(group: str) -> Iterable[importlib.metadata.EntryPoint]:
    """The group's entry points, each name once (the first distribution on ``sys.path`` wins)."""
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name not in seen:
            seen.add(ep.name)
            yield ep


def instance_of(kind: type) -> Callable[[str, Any], Any]:
    """An ``accept`` function taking an instance of ``kind``, or a subclass of it (instantiated
    with no arguments), whose ``name`` (if it has one) is the entry point's."""

    def accept(name: str, obj: Any) -> Any:
        if isinstance(obj, type) and issubclass(obj, kind):
            obj = obj()
        if not isinstance(obj, kind):
            raise TypeError(f"{obj!r} is not a {kind.__module__}.{kind.__qualname__} (nor a subclass of it)")
        if getattr(obj, "name", name) != name:
            raise TypeError(f"the entry point is named {name!r} but its object {obj.name!r}")
        return obj

    return accept
