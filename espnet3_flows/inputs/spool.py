"""Files the planner writes beside the outputs for the workers (a joined data directory, a
dataset's rows): written locally, then made visible in one step."""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from typing import IO, Iterator

from espnet3_flows.storage import Storage


@contextlib.contextmanager
def spool_file(store: Storage, name: str) -> Iterator[IO[bytes]]:
    """A binary file to write; on a clean exit it appears at ``store/name`` whole (a rename on
    local storage, one upload otherwise); on an error nothing appears."""
    local = store.path(name) if store.is_local else None
    tmp_dir = posixpath.dirname(local) if local else None
    if tmp_dir:
        os.makedirs(tmp_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix=".spool-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w+b") as out:
            yield out
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from workers running as another user
        if local:
            os.replace(tmp, local)
        else:
            store.publish_file(tmp, name)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
