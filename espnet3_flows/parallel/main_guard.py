"""A script that starts workers or a run when imported: one ``error:`` line instead of a cascade.

Local Dask workers import the driver's main module as ``__mp_main__`` before they run anything
(Python's ``spawn`` rule, which Dask keeps; forked workers get it from their forkserver, which
imports it once: :mod:`.forkserver_main`), so that they have its functions and classes. A script
whose run is not under ``if __name__ == "__main__":`` then starts the run again inside that
process, which fails; the workers die, and the driver used to end, after some 300 lines of
tracebacks, in ``RuntimeError: Nanny failed to start.``

Each entry point that starts workers or a run calls :func:`refuse_while_importing_main` first. In
a process that is importing its parent's main module (multiprocessing's own ``_inheriting`` flag,
the one behind its "bootstrapping phase" error, read in :mod:`.multiprocessing_private`;
:mod:`.forkserver_main` sets it too), that
records the script's name in the file the driver named (:data:`STATUS_VAR`) and raises
:class:`~espnet3_flows.errors.UnguardedMainError`, which such a process never prints. The driver
reads the record when its cluster fails to start, or before a flow once its forkserver has
imported the script (:func:`~.forkserver.check_main_imported`), and raises the same error, which
prints as the one line when nothing catches it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
from typing import Any

from espnet3_flows.errors import UnguardedMainError

#: The environment variable naming the driver's status file to the processes that import its main
#: module (taken out of their environment when read)
STATUS_VAR = "ESPNET3_FLOWS_MAIN_STATUS"
#: What the status file holds: nothing yet, the import done, the import failed otherwise, or
#: ``UNGUARDED`` and a tab before the message
IMPORTED, FAILED, UNGUARDED = "imported", "failed", "unguarded"

_OWN_PATH: str | None = None  # the driver's file, for the processes that import its main module
_PARENT_PATH: str | None = None  # in such a process: the file of the driver it imports


def importing_main() -> bool:
    """Whether this process is importing its parent's main module now (a spawned worker starting,
    or the forkserver's preload of it): :func:`.multiprocessing_private.importing_main`."""
    from espnet3_flows.parallel.multiprocessing_private import importing_main as inheriting_now

    return inheriting_now()


def _main_name() -> str:
    main = sys.modules.get("__mp_main__")
    path = getattr(main, "__file__", None)
    return os.path.basename(path) if path else "the main module"


def message(what: str) -> str:
    """The error for a main module that starts ``what`` when imported (the ``error:`` line)."""
    return (f"{_main_name()} starts {what} when it is imported, and each Dask worker imports it: "
            'put that code under if __name__ == "__main__":')


def refuse_while_importing_main(what: str = "a run") -> None:
    """Raise :class:`UnguardedMainError` (recorded for the driver) when called while this process
    imports its parent's main module: the script starts ``what`` at import. Nothing otherwise."""
    if not importing_main():
        return
    text = message(what)
    record(f"{UNGUARDED}\t{text}")
    _install_hook(quiet=True)  # this process dies of it; the driver prints the line
    raise UnguardedMainError(text)


def adopt_status_path() -> None:
    """In a process that imports its driver's main module: take the status file's path out of the
    environment (its children never see it; forked ones keep it in memory)."""
    global _PARENT_PATH
    _PARENT_PATH = os.environ.pop(STATUS_VAR, None) or _PARENT_PATH


def record(status: str) -> None:
    """Write ``status`` to the driver's status file, unless the main module is known unguarded
    already (nothing where no driver named a file)."""
    adopt_status_path()
    path = _PARENT_PATH
    if not path or read_status(path).startswith(UNGUARDED):  # the first record of it stands
        return
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(status)
        if os.path.exists(path):  # else the driver has exited and removed it: leave nothing behind
            os.replace(tmp, path)
        else:
            os.remove(tmp)
    except OSError:
        pass  # the driver's temporary directory is gone: it reports the failure as it is


def read_status(path: str | None = None) -> str:
    """The status file's content (``""``: nothing recorded yet, or no file)."""
    path = path or _OWN_PATH
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return ""


def status_path() -> str:
    """The driver's status file (created, empty, on first use; removed when this process exits)."""
    global _OWN_PATH
    if _OWN_PATH is None:
        fd, _OWN_PATH = tempfile.mkstemp(prefix="espnet3-flows-main-")
        os.close(fd)
        atexit.register(_remove, _OWN_PATH)
    return _OWN_PATH


def status_variables() -> dict[str, str]:
    """The environment that tells a process importing this driver's main module where to record."""
    return {STATUS_VAR: status_path()}


def reset_status() -> None:
    """Forget what was recorded (a new forkserver imports the main module again)."""
    if _OWN_PATH is not None:
        with open(_OWN_PATH, "w", encoding="utf-8"):
            pass


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def recorded_error() -> UnguardedMainError | None:
    """The error a process importing this driver's main module recorded, ready to raise (printed
    as one ``error:`` line when nothing catches it), or ``None``."""
    kind, _, text = read_status().partition("\t")
    if kind != UNGUARDED:
        return None
    _install_hook(quiet=False)
    return UnguardedMainError(text)


def _install_hook(quiet: bool) -> None:
    """``sys.excepthook`` printing an uncaught :class:`UnguardedMainError` as its one ``error:``
    line (nothing when ``quiet``), any other exception as before."""
    previous = sys.excepthook
    if getattr(previous, "unguarded_main_hook", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if isinstance(exc, UnguardedMainError):
            if not quiet:
                print(f"error: {exc}", file=sys.stderr)
            return
        previous(kind, exc, tb)

    hook.unguarded_main_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook
