"""Published files' identities: each file's size and SHA-256 (and on S3 the ETag the store gave
the object), recorded when it is published (in a shard's ``done`` record, in a split's
``summary.json``), and the check that a published file still is what its record says before the
record is trusted.

Every file is checked by size and content (a truncated copy, a file edited or replaced by another
run, other content of the same size). A local file is hashed. An S3 object is checked with the
HEAD request that gives its size, downloading nothing where it can: by the SHA-256 checksum S3
keeps of it (this package uploads in one PUT with ``ChecksumAlgorithm=SHA256``), else by its ETag,
equal to the one recorded when it was published (S3 gives an object another ETag whenever it is
written with other content: a multipart upload, a store without checksums); an object with
neither (a record of an earlier version of this package, a rewrite of the same content, another
object store) is read and hashed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from collections.abc import Mapping

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


def publish_recorded(store: Storage, local_path: str | os.PathLike[str], rel: str) -> dict[str, Any]:
    """Publish a local file at ``rel`` (:meth:`~espnet3_flows.storage.Storage.publish_file`); its
    record (:func:`local_digest`, with the ETag the store gave it where it gives one)."""
    return _tagged(local_digest(local_path), store.upload_file(local_path, rel))


def write_recorded(store: Storage, rel: str, data: bytes) -> dict[str, Any]:
    """Publish ``data`` as the file ``rel``; its record (as :func:`publish_recorded`)."""
    return _tagged(bytes_digest(data), store.upload_bytes(rel, data))


def _tagged(digest: dict[str, Any], etag: str | None) -> dict[str, Any]:
    return {**digest, "etag": etag} if etag else digest


def mismatch(store: Storage, rel: str, expected: Mapping[str, Any]) -> str | None:
    """Why the published file ``rel`` is not the one ``expected`` records (missing, another size,
    other content), or ``None`` when it is.

    Raises:
        StorageError: the store cannot be asked (an outage is not a mismatch).
    """
    try:
        found = store.stored(rel)
        if found.size != int(expected["size"]):
            return f"it has {found.size} bytes where its record says {expected['size']}"
        stored = found.sha256
        if store.is_local:
            stored = file_sha256(store.path(rel))
        elif stored is None and found.etag is not None and found.etag == expected.get("etag"):
            return None  # not written again since it was published (another write, another ETag)
        elif stored is None:  # neither a checksum nor the recorded ETag: read the object
            stored = store.read_sha256(rel)
    except FileNotFoundError:
        return "it is missing"
    except Exception as exc:  # fsspec back ends raise many types
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
        return {rel: why for rel, why in zip(rels, found, strict=True) if why is not None}
