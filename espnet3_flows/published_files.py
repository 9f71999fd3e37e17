"""Published files' identities: each file's size and SHA-256, recorded when it is published (in a
shard's ``done`` record, in a split's ``summary.json``), and the check that a published file still
is what its record says before the record is trusted.

Every file is checked by size and content, against the SHA-256 its record holds (a truncated
copy, a file edited or replaced by another run, other content of the same size): a local file is
hashed; an S3 object is compared by the SHA-256 checksum S3 keeps of it (asked for with the HEAD
request that gives its size: this package uploads with ``ChecksumAlgorithm=SHA256``, so the check
downloads nothing); an object without one (uploaded by something else, in several parts, or to
another object store) is read and hashed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from espnet3_flows.hashing import bytes_sha256, file_sha256
from espnet3_flows.storage import Storage, StorageError

#: Files checked at once (stats on disk, HEAD requests on an object store)
_CHECK_THREADS = 16


def local_digest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record of a local file about to be published: ``{"size": bytes, "sha256": hex}``."""
    return {"size": os.path.getsize(path), "sha256": file_sha256(os.fspath(path))}


def bytes_digest(data: bytes) -> dict[str, Any]:
    """The record of ``data`` about to be published as a file (as :func:`local_digest`)."""
    return {"size": len(data), "sha256": bytes_sha256(data)}


def mismatch(store: Storage, rel: str, expected: Mapping[str, Any]) -> str | None:
    """Why the published file ``rel`` is not the one ``expected`` records (missing, another size,
    other content), or ``None`` when it is.

    Raises:
        StorageError: the store cannot be asked (an outage is not a mismatch).
    """
    try:
        size, stored = store.size_and_sha256(rel)
        if size != int(expected["size"]):
            return f"it has {size} bytes where its record says {expected['size']}"
        if store.is_local:
            stored = file_sha256(store.path(rel))
        elif stored is None:  # no checksum kept by the store: read the object
            stored = store.read_sha256(rel)
    except FileNotFoundError:
        return "it is missing"
    except Exception as exc:  # noqa: BLE001 - fsspec back ends raise many types
        raise StorageError(f"cannot check {store.uri(rel)}: {exc}") from exc
    if stored != expected["sha256"]:
        return "its content differs from its record (SHA-256)"
    return None


def mismatches(store: Storage, expected: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """:func:`mismatch` for every ``rel`` → record of ``expected``, checked concurrently; only the
    files that differ, with why."""
    if not expected:
        return {}
    store.fs.invalidate_cache()  # another process may have replaced a file since it was listed
    rels = list(expected)
    with ThreadPoolExecutor(min(_CHECK_THREADS, len(rels))) as pool:
        found = pool.map(lambda rel: mismatch(store, rel, expected[rel]), rels)
        return {rel: why for rel, why in zip(rels, found) if why is not None}
