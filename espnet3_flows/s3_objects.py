"""What an S3 store keeps of an uploaded object for a later content check (its SHA-256 checksum,
its ETag), and S3-compatible stores that keep no checksums.

Uploads in one PUT (below :func:`single_put_max`) ask S3 to keep the object's SHA-256
(``ChecksumAlgorithm=SHA256``); every upload's ETag goes into the file's record. Some
S3-compatible stores (older MinIO, Ceph RGW, GCS's XML API, Backblaze) reject checksum headers,
botocore's own default CRC32 included: such an upload is sent once more by a client that sends
none (``request_checksum_calculation="when_required"``), and the endpoint is remembered for the
rest of the process (:func:`keeps_checksums`): its later uploads go without, and their content
checks use the ETag, or read the object.
"""

from __future__ import annotations

import base64
import logging
import mimetypes
import threading
from pathlib import Path
from typing import Any, NamedTuple, Protocol
from collections.abc import Callable, Mapping

from espnet3_flows.deadlines import StorageTimeout
from espnet3_flows.errors import causes

#: ``send(fs, extra)``: one upload through the file system ``fs``, ``extra`` its S3 keyword arguments
Send = Callable[[Any, dict[str, Any]], Any]
_LOG = logging.getLogger("espnet3_flows.storage")

#: s3fs's part size (its default): a file of twice this or more goes in several parts
PART_BYTES = 50 * 2**20
#: S3 error codes (or HTTP statuses) of a store that refuses a header it does not support
_REFUSALS = frozenset({"InvalidArgument", "InvalidRequest", "NotImplemented", "501"})
#: S3 error codes of a checksum that did not match the data (damaged in transit: not a refusal)
_MISMATCHES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"})
#: endpoints (:func:`~espnet3_flows.deadlines.endpoint_of`) found to reject checksum headers
_NO_CHECKSUMS: set[str] = set()
_LOCK = threading.Lock()


class StoredObject(NamedTuple):
    """What a HEAD request gives of a stored file: its size, the SHA-256 (hex) of its content
    that the store keeps (``None``: none kept), its ETag without quotes (``None``: not given)."""

    size: int
    sha256: str | None = None
    etag: str | None = None


def single_put_max() -> int:
    """The largest upload s3fs sends in one PUT (``put_file``, ``pipe_file``): the only ones
    given a checksum, as s3fs gives a multipart upload's parts none."""
    return 2 * PART_BYTES - 1


def keeps_checksums(endpoint: str) -> bool:
    """Whether uploads to ``endpoint`` ask for checksums (no upload there has been refused one)."""
    return endpoint not in _NO_CHECKSUMS


def without_checksum_headers(options: Mapping[str, Any]) -> dict[str, Any]:
    """s3fs ``storage_options`` with botocore asked to send no checksum headers (its default
    CRC32 on every upload included) unless an operation requires one."""
    config = {**(options.get("config_kwargs") or {}), "request_checksum_calculation": "when_required"}
    return {**options, "config_kwargs": config}


def upload_options(endpoint: str, size: int) -> dict[str, Any]:
    """Upload keyword arguments that make S3 keep the object's SHA-256 where it can."""
    return {"ChecksumAlgorithm": "SHA256"} if keeps_checksums(endpoint) and size <= single_put_max() else {}


def refuses_checksums(exc: BaseException) -> bool:
    """Whether ``exc`` may be a store refusing checksum headers (400 InvalidArgument or
    InvalidRequest, 501 NotImplemented, or an error that names the checksum)."""
    code = s3_error_code(exc)
    return code not in _MISMATCHES and (code in _REFUSALS or "checksum" in str(exc).lower())


def without_checksums(endpoint: str) -> None:
    """Remember that ``endpoint`` rejects checksum headers (an upload without them succeeded
    where one with them was refused); said once per endpoint and process."""
    with _LOCK:
        if endpoint in _NO_CHECKSUMS:
            return
        _NO_CHECKSUMS.add(endpoint)
    _LOG.warning("storage endpoint %s refuses upload checksums: uploads go without them, and the content "
                 "check of its objects compares their ETag (or reads them)", endpoint)


class S3Store(Protocol):
    """What :func:`upload` uses of an S3 :class:`~espnet3_flows.storage.Storage`."""

    #: the file system uploads go through (replaced by one without checksum headers when refused)
    fs: Any
    #: whether ``fs`` sends checksum headers
    checksums: bool
    #: the endpoint, as :func:`~espnet3_flows.deadlines.endpoint_of` names it
    endpoint: str

    def connect(self, checksums: bool) -> tuple[Any, str]:
        """A file system of the store's location (with or without checksum headers) and its root."""
        ...

    def stored(self, rel: str) -> StoredObject:
        """What the store keeps of the object ``rel``."""
        ...


def upload(store: S3Store, rel: str, size: int, send: Send) -> str | None:
    """One upload of ``size`` bytes to ``rel`` on the S3 ``store`` (``send(store.fs, extra)``),
    asking for a checksum while its client sends them; the ETag S3 gave the object (the PUT's
    response's, else one HEAD's right after: a multipart upload's response is not given).

    An upload refused with checksum headers (:func:`refuses_checksums`) is sent once more by a
    client that sends none; when that one succeeds, ``store`` keeps it and the endpoint is
    remembered (:func:`without_checksums`). If it fails too, its error is the store's answer.
    """
    if store.checksums and not keeps_checksums(store.endpoint):  # found out by another storage meanwhile
        store.fs, store.checksums = store.connect(checksums=False)[0], False
    checksums = store.checksums
    try:
        response = send(store.fs, upload_options(store.endpoint, size) if checksums else {})
    except Exception as exc:
        if isinstance(exc, StorageTimeout) or not checksums or not refuses_checksums(exc):
            raise
        plain, _ = store.connect(checksums=False)
        response = send(plain, {})
        store.fs, store.checksums = plain, False
        without_checksums(store.endpoint)
    etag = etag_of(response)
    if etag is None:
        found = store.stored(rel)
        etag = found.etag if found.size == size else None  # (another writer's object: none)
    return etag


def file_upload(src: str, dest: str) -> Send:
    """How the local file ``src`` is uploaded to ``dest``: in one PUT up to :func:`single_put_max`
    (read whole, as s3fs's ``put_file`` does; its response gives the ETag; the content type
    guessed as ``put_file`` does), else by ``put_file`` in parts of :data:`PART_BYTES`."""
    if Path(src).stat().st_size > single_put_max():
        parts = max(PART_BYTES, -(-Path(src).stat().st_size // 10_000))  # S3 takes 10,000 parts at most
        return lambda fs, extra: fs.put_file(src, dest, chunksize=parts, **extra)
    data, typed = Path(src).read_bytes(), {"ContentType": mimetypes.guess_type(src)[0]}
    typed = {k: v for k, v in typed.items() if v}
    return lambda fs, extra: fs.pipe_file(dest, data, **typed, **extra)


def etag_of(response: Mapping[str, Any] | None) -> str | None:
    """The ETag of an S3 response (a PUT's, a HEAD's), without its quotes."""
    etag = (response or {}).get("ETag")
    return (str(etag).strip('"') or None) if etag else None


def stored_object(head: Mapping[str, Any]) -> StoredObject:
    """A HEAD response (asked with ``ChecksumMode="ENABLED"``) as a :class:`StoredObject`."""
    stored = head.get("ChecksumSHA256")
    # a multipart object's checksum is of its parts' checksums ("…-N"), not of its content
    sha = base64.b64decode(stored).hex() if stored and "-" not in stored else None
    return StoredObject(int(head["ContentLength"]), sha, etag_of(head))


def s3_error_code(exc: BaseException | None) -> str | None:
    """The S3 error code (or HTTP status) behind ``exc``, found on a botocore error in its causes."""
    for e in causes(exc, limit=10):
        response = getattr(e, "response", None)
        if isinstance(response, Mapping):
            return str((response.get("Error") or {}).get("Code")
                       or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or "") or None
    return None
