"""The one gate for :mod:`espnet3_flows.orchestration.prefect_private`'s patches: whether one may be
installed, installing it as a marked wrapper, and putting Prefect's own attributes back when the
runs that wanted them end (:func:`patched_run`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from espnet3_flows import patches

#: Prefect versions these patches were verified against (their targets read, tests run)
VERIFIED_PREFECT = ("3.8.8",)
#: prefect-dask versions ``untokenized_task_keys`` was verified against
VERIFIED_PREFECT_DASK = ("0.3.7",)
#: ``off`` in this variable: no patch of Prefect is installed (nor of any library: :mod:`espnet3_flows.patches`)
PATCHES_VAR = patches.VAR
_LOG = logging.getLogger(__name__)
_WARNED: list[str] = []
_MARK = "_espnet3_flows_patch"


def prefect_verified(patch: str | None = None) -> bool:
    """Whether the patches (or the one named ``patch``, of :data:`~espnet3_flows.patches.PATCHES`)
    may be installed: the installed Prefect is one they were verified against (warns once if not)
    and :data:`PATCHES_VAR` does not turn them off."""
    import prefect

    if not patches.patches_enabled(patch):
        return False
    if prefect.__version__ in VERIFIED_PREFECT:
        return True
    if not _WARNED:
        _WARNED.append(prefect.__version__)
        _LOG.warning("Prefect %s is not one of %s, which espnet3_flows' speed-ups of Prefect's internals were "
                     "verified with: they are off (runs are correct, with more overhead per shard task)",
                     prefect.__version__, ", ".join(VERIFIED_PREFECT))
    return False


def unpatched_target(owner: Any, name: str, patch: str, verified: bool = True) -> tuple[bool, Any]:
    """What the patch named ``patch`` replaces: ``(True, original)`` for ``owner``'s own ``name`` (in
    its ``__dict__``); ``(True, None)`` when our replacement is there already; ``(False, None)`` when
    it cannot be installed: it is turned off, Prefect (or ``verified``, a further version check) is
    not a verified version, or ``owner`` has no such attribute."""
    if not verified or not prefect_verified(patch):
        return False, None
    original = vars(owner).get(name)
    if original is None:
        return False, None
    if getattr(original, _MARK, False):
        return True, None
    return True, original


class _Installed:
    """The attributes our patches replaced, with their originals, and how many runs are in progress."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.replaced: dict[tuple[int, str], tuple[Any, str, Any, bool]] = {}
        self.runs = 0


_INSTALLED = _Installed()


def install_wrapper(owner: Any, name: str, wrapper: Any, original: Any, *, outlives_run: bool = False) -> bool:
    """Set ``owner.name = wrapper`` (a replacement of ``original``, marked as ours so that installing
    it again is a no-op) and remember ``original`` for :func:`restore_prefect`; returns ``True``.

    ``outlives_run``: the replacement fixes something Prefect leaves behind after a run (an exit
    hook), so it stays installed when the run ends."""
    for attribute, value in (("__doc__", original.__doc__), ("__wrapped__", original), (_MARK, True)):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(wrapper, attribute, value)
    with _INSTALLED.lock:
        _INSTALLED.replaced.setdefault((id(owner), name), (owner, name, original, outlives_run))
        setattr(owner, name, wrapper)
    return True


def restore_prefect(*, everything: bool = False) -> list[str]:
    """Put back the Prefect attributes our patches replaced (those that outlive a run too, with
    ``everything``); returns their names as ``owner.name``."""
    restored = []
    with _INSTALLED.lock:
        for key, (owner, name, original, outlives_run) in list(_INSTALLED.replaced.items()):
            if outlives_run and not everything:
                continue
            setattr(owner, name, original)
            del _INSTALLED.replaced[key]
            restored.append(_label(owner, name))
    return restored


def installed_patches() -> list[str]:
    """The Prefect attributes replaced now, as ``owner.name``."""
    with _INSTALLED.lock:
        return [_label(owner, name) for owner, name, _, _ in _INSTALLED.replaced.values()]


def _label(owner: Any, name: str) -> str:
    """``owner.name`` as :func:`installed_patches` names a replaced attribute."""
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"


def enter_run() -> None:
    """One more run (or Dask worker of a run) of this process wants the patches it installs kept."""
    with _INSTALLED.lock:
        _INSTALLED.runs += 1


def leave_run() -> None:
    """That run ended: when it was the last, Prefect gets its own attributes back
    (:func:`restore_prefect`)."""
    with _INSTALLED.lock:
        _INSTALLED.runs = max(0, _INSTALLED.runs - 1)
        last = _INSTALLED.runs == 0
    if last:
        restore_prefect()


@contextlib.contextmanager
def patched_run() -> Iterator[None]:
    """The lifetime of one run's patches (:func:`enter_run`, :func:`leave_run`): the patches
    installed inside it stay while any run of this process is in progress, and when the last one
    ends Prefect gets its own attributes back, so that a notebook or a worker process that runs
    other flows after ours runs them on Prefect as installed."""
    enter_run()
    try:
        yield
    finally:
        leave_run()
