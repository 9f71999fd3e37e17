"""The one rule for the paths a run changes: every file it writes, replaces or removes stays below
the root it works in (the output location, or a local scratch directory), whatever a record names
(``summary.json``, a ``done`` record) and whatever the output tree holds.

A name whose ``..`` components lead out of the root is refused on every store. On a local file system the path's
directory is resolved (:func:`os.path.realpath`, every symbolic link followed) and refused when it
leaves the resolved root: a directory of the output tree that is a link to elsewhere is never
written into, created in or removed from. The root itself may be a link (``output_dir`` on another
disk): it is resolved too. The last name of the path is not followed: a write replaces a link
there with the new file and a removal unlinks the link, neither touches what it points at (ESPnet
recipes link a pretrained ``feats_stats.npz`` into a stats directory). A tree removal goes into
its directory, so there the whole path is resolved.

The check and the write are separate calls: a link swapped in between by a process racing the run
is not seen (a file system without ``openat`` and ``O_NOFOLLOW`` on every store cannot close it).
"""

from __future__ import annotations

import os
import posixpath

from espnet3_flows.errors import Espnet3FlowsError, clip


class OutsideOutputError(Espnet3FlowsError, RuntimeError):
    """A path a run would write, replace or remove leaves its root: a name with ``..`` that leads
    out (from a record), or a directory of the tree that is a symbolic link to elsewhere. Nothing was changed
    there; the message names the path, where it leads and the link."""


def confine(root: str, path: str, *, action: str = "write", tree: bool = False, local: bool = True) -> str:
    """``path`` when a write or removal there changes nothing outside ``root`` (see the module).

    Args:
        root: The root (a local path, or an object store's path without its protocol).
        path: A path below ``root``, as ``posixpath.join(root, ...)`` made it.
        action: What the caller does there, for the message (``write``, ``remove``).
        tree: The path itself is entered (a tree removal): resolve all of it, not only its directory.
        local: ``root`` is on the local file system (symbolic links resolved); else only ``..``
            and names outside ``root`` are refused (object stores have no links).

    Raises:
        OutsideOutputError: naming the path, where it leads and the link that takes it there.
    """
    below = posixpath.relpath(posixpath.normpath(path), posixpath.normpath(root))
    if below == ".." or below.startswith("../"):
        raise OutsideOutputError(f"will not {action} {clip(path)}: the name leaves {root} ('..' or a path outside it); "
                                 "nothing was changed there")
    if not local:
        return path
    real_root = os.path.realpath(root)
    real = os.path.realpath(path if tree else os.path.dirname(path))
    if real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep):
        return path
    raise OutsideOutputError(f"will not {action} {clip(path)}: it leads to {clip(real)}, outside {root}"
                             f"{_link(root, path)}; nothing was changed there. Remove the link (a directory of the "
                             "output may not be a link to elsewhere; output_dir itself may)")


def _link(root: str, path: str) -> str:
    """`` (LINK is a symbolic link to TARGET)`` for the first link below ``root`` on ``path``."""
    here = root
    for part in posixpath.relpath(path, root).split("/"):
        here = os.path.join(here, part)
        if os.path.islink(here):
            return f" ({here} is a symbolic link to {os.readlink(here)})"
    return ""
