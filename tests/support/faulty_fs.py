"""``faulty://``: an in-memory fsspec file system whose writes fail on demand (storage outages)."""

from __future__ import annotations

import threading

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class StoreOutage(ConnectionError):
    """The injected failure: looks like a store that stopped answering."""


class FaultyFileSystem(MemoryFileSystem):
    """Memory file system; while ``outage`` is set, every write raises :class:`StoreOutage`.

    ``fail_after_writes`` starts the outage after that many successful writes, so a run
    fails midway (some shards published, others not).
    """

    protocol = "faulty"
    store: dict = {}  # separate from memory://
    pseudo_dirs = [""]
    outage = False
    fail_after_writes: int | None = None
    writes = 0
    attempts_during_outage = 0
    _lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.outage, cls.fail_after_writes, cls.writes, cls.attempts_during_outage = False, None, 0, 0

    def _check(self, path: str) -> None:
        cls = type(self)
        with cls._lock:
            if cls.fail_after_writes is not None and cls.writes >= cls.fail_after_writes:
                cls.outage = True
            if cls.outage:
                cls.attempts_during_outage += 1
                raise StoreOutage(f"injected outage writing {path}")
            cls.writes += 1

    def pipe_file(self, path, value, **kwargs):
        self._check(path)
        return super().pipe_file(path, value, **kwargs)

    def put_file(self, lpath, rpath, **kwargs):
        self._check(rpath)
        return super().put_file(lpath, rpath, **kwargs)

    def rm_file(self, path):
        self._check(path)
        return super().rm_file(path)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
