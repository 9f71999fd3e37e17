"""Every private name of CPython's ``multiprocessing`` this package reads or sets, in one module;
``tests/test_patch_targets.py`` checks each against the running Python.

- ``process.current_process()._inheriting``: true while a child imports its parent's main module
  (``spawn`` and ``forkserver`` set it there); read to tell that moment (:func:`importing_main`,
  the unguarded-script guard of :mod:`.main_guard`), set around the forkserver's own import of the
  driver's main module (:func:`inheriting`), as a spawned child has it.
- ``spawn._fixup_main_from_path`` and ``_fixup_main_from_name``: how a child imports that module
  (:func:`main_fixup`).
- ``forkserver._forkserver._forkserver_pid`` and ``._stop``: the running forkserver's process and
  its stop (:func:`forkserver_pid`, :func:`stop_forkserver_process`).

The forkserver's names are reached only for workers forked from it (the ``forks_workers`` patch;
off: spawned workers). The guard's read is the ``importing_main`` patch: off, an unguarded
script is left to CPython's own check in a spawned child instead of the one-line error.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
from multiprocessing import process, spawn
from typing import Any
from collections.abc import Callable, Iterator


def importing_main() -> bool:
    """Whether this process is importing its parent's main module now (a spawned worker starting,
    or the forkserver's preload of it); ``False`` with the ``importing_main`` patch off."""
    from espnet3_flows.patches import patches_enabled

    return patches_enabled("importing_main") and bool(getattr(process.current_process(), "_inheriting", False))


@contextlib.contextmanager
def inheriting() -> Iterator[None]:
    """The block in which this process imports its parent's main module, marked as ``spawn`` marks
    it in a child (so that the main module's own guard, and :func:`importing_main`, see it)."""
    current: Any = process.current_process()
    current._inheriting = True
    try:
        yield
    finally:
        del current._inheriting


def main_fixup(kind: str) -> Callable[[str], None] | None:
    """``spawn``'s import of a parent's main module by ``"path"`` or ``"name"`` (``None`` when this
    Python has none)."""
    return getattr(spawn, {"path": "_fixup_main_from_path", "name": "_fixup_main_from_name"}.get(kind, ""), None)


def forkserver_pid() -> int | None:
    """The process id of this process's running ``multiprocessing`` forkserver (``None``: none)."""
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def stop_forkserver_process() -> None:
    """Stop this process's ``multiprocessing`` forkserver, if one runs (the next fork starts anew)."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None and forkserver_pid() is not None:
        stop()
