"""Output storage through fsspec: atomic publishing of files and JSON records, on disk or object stores."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO
from collections.abc import Callable, Iterable, Iterator, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

# the one rule of what is a credential lives in espnet3_flows.credentials; its names stay importable here
from espnet3_flows.credentials import has_secrets, redact  # noqa: F401
from espnet3_flows.credentials import is_secret_key as _is_secret_key  # noqa: F401
from espnet3_flows.config import ConfigError
from espnet3_flows.confinement import OutsideOutputError, confine  # noqa: F401 - (raised through Storage)
from espnet3_flows import s3_objects
from espnet3_flows.deadlines import S3_PROTOCOLS, StorageTimeout, bounded_filesystem, endpoint_of, is_unreachable, with_deadlines
from espnet3_flows.errors import Espnet3FlowsError
from espnet3_flows.hashing import fileobj_sha256


class StorageError(Espnet3FlowsError, RuntimeError):
    """The output location cannot be read or written."""


class OutputNotWritableError(StorageError, ConfigError):
    """The output location cannot be written at all (permissions, a file in its place, a
    read-only file system, a bucket this account may not write): an error in the config, found
    before any work (exit status 2)."""


class Storage:
    """A root location (local path or fsspec URL) where shard and merged outputs are published.

    Every write is atomic for readers: on a local file system a file is written beside its
    destination under a temporary name and renamed; on object stores a single PUT is atomic
    per object. ``repr`` never shows credentials.

    Args:
        url: Local path or URL such as ``s3://bucket/prefix`` or ``memory://run``.
        storage_options: Keyword arguments for the fsspec file system (credentials,
            ``client_kwargs={"endpoint_url": ...}``). Standard AWS environment variables
            apply when they are omitted. On S3, deadlines are added where they are not set
            and every call has a ceiling (:mod:`espnet3_flows.deadlines`).
    """

    def __init__(self, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None):
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.is_s3 = fsspec.utils.get_protocol(self.url) in S3_PROTOCOLS
        self.endpoint = endpoint_of(self.storage_options, self.url)
        #: whether this storage's S3 client sends checksum headers (see :mod:`espnet3_flows.s3_objects`)
        self.checksums = self.is_s3 and s3_objects.keeps_checksums(self.endpoint)
        self.fs, root = self.connect(self.checksums)
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def connect(self, checksums: bool) -> tuple[Any, str]:
        """A file system of ``url`` (every call bounded: none waits forever) and its root path;
        on S3 without ``checksums``, a client that sends no checksum headers."""
        options = with_deadlines(self.storage_options, self.url)
        if self.is_s3 and not checksums:
            options = s3_objects.without_checksum_headers(options)
        fs, root = fsspec.core.url_to_fs(self.url, **options)
        return bounded_filesystem(fs, self.storage_options, self.url), root

    def __repr__(self) -> str:
        return f"Storage({self.url!r}, storage_options={redact(self.storage_options)!r})"

    def __reduce__(self):  # rebuild the file system on the worker instead of pickling sockets
        return (Storage, (self.url, self.storage_options))

    # -- paths -------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The file-system path of ``parts`` below the root (no protocol)."""
        clean = [p.strip("/") for p in parts if p not in ("", None)]
        return posixpath.join(self.root, *clean) if clean else self.root

    def checked_path(self, *parts: str, action: str = "write", tree: bool = False) -> str:
        """:meth:`path` of a file about to be written, replaced or removed (a tree, ``tree``):
        refused when it leaves the root, by a ``..`` in a name or, on a local store, through a
        directory of the tree that is a symbolic link to elsewhere (the root may be one).

        Raises:
            OutsideOutputError: naming the path, where it leads and the link
                (:func:`~espnet3_flows.confinement.confine`).
        """
        return confine(self.root, self.path(*parts), action=action, tree=tree, local=self.is_local)

    def uri(self, *parts: str) -> str:
        """The full URL (with protocol for remote stores) of ``parts`` below the root."""
        p = self.path(*parts)
        if self.is_local:
            return p
        return self.fs.unstrip_protocol(p)

    def child(self, *parts: str) -> Storage:
        """A storage rooted at a sub-directory, sharing the options."""
        return Storage(self.uri(*parts), self.storage_options)

    # -- reads -------------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        """Whether a file exists (a fresh listing, not a cached one)."""
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self.path(*parts)))

    def read_bytes(self, *parts: str) -> bytes:
        """Read a whole file."""
        try:
            return self.fs.cat_file(self.path(*parts))
        except FileNotFoundError:
            raise
        except StorageTimeout:
            raise  # names the endpoint and the file already
        except Exception as exc:  # fsspec back ends raise many types
            raise StorageError(f"cannot read {self.uri(*parts)}: {exc}") from exc

    def read_json(self, *parts: str) -> Any:
        """Read and parse a JSON file; ``None`` when it does not exist."""
        try:
            data = self.read_bytes(*parts)
        except FileNotFoundError:
            return None
        return json.loads(data.decode("utf-8"))

    def get_file(self, rel: str, local_path: str | os.PathLike[str]) -> None:
        """Download one file to a local path."""
        self.fs.get_file(self.path(rel), str(local_path))

    def list_files(self, *parts: str) -> list[str]:
        """Relative names of the files directly below a directory (empty if it is missing)."""
        base = self.path(*parts)
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file"
        )

    # -- writes ------------------------------------------------------------------------
    def write_bytes(self, rel: str, data: bytes) -> str:
        """Atomically write ``data`` to ``rel``; returns its URI."""
        self.upload_bytes(rel, data)
        return self.uri(rel)

    def upload_bytes(self, rel: str, data: bytes) -> str | None:
        """:meth:`write_bytes`, returning the ETag the store gave the object (``None`` where it
        gives none: local disk, stores other than S3)."""
        dest = self.checked_path(rel)
        try:
            if self.is_local:
                replace_atomically(dest, lambda f: f.write(data))
                return None
            return self._upload(rel, len(data), lambda fs, extra: fs.pipe_file(dest, data, **extra))
        except StorageTimeout:
            raise  # names the endpoint and the file already
        except Exception as exc:  # OSError, or any of the fsspec back ends' types
            raise StorageError(f"cannot write {self.uri(rel)}: {exc}") from exc

    def _upload(self, rel: str, size: int, send: Callable[[Any, dict[str, Any]], Any]) -> str | None:
        """``send(fs, extra)``: one upload of ``size`` bytes to ``rel`` on a remote store; the
        ETag the store gave it (on S3: :func:`espnet3_flows.s3_objects.upload`)."""
        if self.is_s3:
            return s3_objects.upload(self, rel, size, send)
        send(self.fs, {})
        return None

    def write_json(self, rel: str, obj: Any) -> str:
        """Atomically write ``obj`` as indented, key-sorted JSON."""
        return self.write_bytes(rel, _json_bytes(obj))

    def create_json(self, rel: str, obj: Any) -> bool:
        """Write ``obj`` as :meth:`write_json` does, only where no file is at ``rel``; whether it
        was written. Exclusive where the store makes it so (two writers never both succeed): a
        hard link on a local store, a conditional PUT (``If-None-Match: *``) on S3; other stores
        check first (fsspec's ``mode="create"``), so a caller reads the record back.

        Raises:
            StorageError: the file cannot be written (an S3 endpoint without conditional writes
                included: the message says so).
        """
        data, dest = _json_bytes(obj), self.checked_path(rel)
        if self.is_local:
            return _link_new(dest, data)
        for attempt in range(3):
            try:
                self._upload(rel, len(data), lambda fs, extra: fs.pipe_file(dest, data, mode="create", **extra))
                return True
            except FileExistsError:
                return False
            except StorageTimeout:
                raise
            except Exception as exc:  # s3fs maps some S3 errors, not all
                code = s3_objects.s3_error_code(exc)
                if code in ("PreconditionFailed", "412"):
                    return False  # there already (an endpoint whose 412 does not name the condition)
                if code in ("ConditionalRequestConflict", "409") and attempt < 2:
                    time.sleep(0.5)  # another writer's conditional PUT of this key is in flight: ask again
                    continue
                hint = (" (does the endpoint support conditional writes, If-None-Match?)"
                        if code in ("NotImplemented", "501") else "")
                raise StorageError(f"cannot create {self.uri(rel)}{hint}: {exc}") from exc
        return False

    def stored(self, rel: str) -> s3_objects.StoredObject:
        """The size of the file ``rel`` and, on S3, the SHA-256 of its content that the store
        keeps (for an object uploaded in one PUT with a checksum, as :meth:`upload_file` and
        :meth:`upload_bytes` ask for) and its ETag: one HEAD request.

        Raises:
            FileNotFoundError: there is no file at ``rel``.
        """
        path = self.path(rel)
        if not self.is_s3:
            return s3_objects.StoredObject(int(self.fs.size(path)))
        bucket, key, _ = self.fs.split_path(path)
        return s3_objects.stored_object(self.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED"))

    def read_sha256(self, rel: str) -> str:
        """The SHA-256 (hex) of the file ``rel``, read through (streamed, not held in memory)."""
        with self.fs.open(self.path(rel), "rb") as f:
            return fileobj_sha256(f)

    def write_text(self, rel: str, text: str) -> str:
        """Atomically write UTF-8 text."""
        return self.write_bytes(rel, text.encode("utf-8"))

    def publish_file(self, local_path: str | os.PathLike[str], rel: str) -> str:
        """Atomically copy a local file to ``rel``; returns its URI."""
        self.upload_file(local_path, rel)
        return self.uri(rel)

    def upload_file(self, local_path: str | os.PathLike[str], rel: str) -> str | None:
        """:meth:`publish_file`, returning the ETag the store gave the object (as :meth:`upload_bytes`)."""
        dest, src = self.checked_path(rel), str(local_path)
        try:
            if self.is_local:
                replace_atomically(dest, lambda f: _copy_into(src, f))
                return None
            send = s3_objects.file_upload(src, dest) if self.is_s3 else lambda fs, _: fs.put_file(src, dest)
            return self._upload(rel, os.path.getsize(src), send)
        except StorageTimeout:
            raise  # names the endpoint and the file already
        except Exception as exc:
            raise StorageError(f"cannot publish {self.uri(rel)}: {exc}") from exc

    @contextlib.contextmanager
    def atomic_writer(self, rel: str) -> Iterator[BinaryIO]:
        """A seekable local file (``w+b``) published at ``rel`` only when the block ends without
        an exception: renamed into place on a local store, uploaded in one step to an object
        store (a local temporary file in between). Nothing is visible at ``rel`` before, and an
        exception leaves ``rel`` as it was.

        Raises:
            StorageError: the file cannot be published (the block's own exceptions pass as they are).
        """
        dest = self.checked_path(rel)
        if self.is_local:
            with atomic_local_file(dest) as f:
                yield f
            return
        with tempfile.NamedTemporaryFile(prefix="espnet3-upload-", suffix=posixpath.splitext(rel)[1]) as f:
            yield f  # type: ignore[misc]
            f.flush()
            self.publish_file(f.name, rel)

    def publish_dir(self, local_dir: str | os.PathLike[str], rel: str) -> list[str]:
        """Publish every file below ``local_dir`` under ``rel``; returns relative file names."""
        names = sorted(_walk_files(Path(local_dir)))
        for name in names:
            self.publish_file(Path(local_dir) / name, posixpath.join(rel, name))
        return names

    def remove(self, *parts: str) -> None:
        """Delete a file if it exists (a symbolic link there is removed, not what it points at)."""
        p = self.checked_path(*parts, action="remove")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(p)

    def remove_tree(self, *parts: str) -> None:
        """Delete a directory tree if it exists."""
        p = self.checked_path(*parts, action="remove", tree=True)
        try:
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass

    def check_writable(self) -> None:
        """Write and delete a probe file, raising :class:`OutputNotWritableError` (a config error:
        exit status 2) with the location and the reason; a store that does not answer in time
        raises :class:`~espnet3_flows.deadlines.StorageTimeout` (an outage, not the config). Local
        directories made for the probe are removed again: a run that stops at its next check
        (a missing manifest) leaves nothing behind."""
        probe = f".write-probe-{uuid.uuid4().hex}"
        made: list[Path] = []
        if self.is_local:
            missing = Path(self.path())
            while not missing.exists() and missing != missing.parent:
                made.append(missing)  # deepest first
                missing = missing.parent
        try:
            self.write_bytes(probe, b"ok")
        except StorageError as exc:
            why = exc.__cause__ or exc
            # an endpoint that cannot be reached may be down, not misconfigured: a failure (exit 1)
            error = StorageError if is_unreachable(exc) else OutputNotWritableError
            raise error(f"output location {self.uri()} is not writable: {why}") from None
        finally:
            with contextlib.suppress(Exception):  # best effort: never hides why the probe failed
                self.remove(probe)
            for directory in made:
                with contextlib.suppress(OSError):
                    directory.rmdir()


#: Bytes a temporary name adds to its file's name (``.tmp-`` and 8 hex digits): utterance ids are
#: bounded so that their files' temporary names fit too (:data:`espnet3_flows.inputs.records.MAX_ID_BYTES`)
TEMP_SUFFIX_BYTES = 13


@contextlib.contextmanager
def atomic_local_file(dest: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A seekable file (``w+b``) that becomes ``dest`` only when the block ends without an
    exception: a uniquely named temporary file beside ``dest`` (concurrent writers never share
    one), fsynced (``fsync=False`` for scratch files), renamed over ``dest``. A reader sees the old
    file or the whole new one, never a part; a symlink at ``dest`` is replaced, never written
    through; on an exception nothing changes and the temporary file is removed."""
    dest = os.fspath(dest)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:TEMP_SUFFIX_BYTES - 5]}"  # short: see TEMP_SUFFIX_BYTES
    try:
        with open(tmp, "w+b") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def replace_atomically(dest: str | os.PathLike[str], write: Callable[[BinaryIO], Any], *, fsync: bool = True) -> None:
    """Write a local file with ``write(f)`` through :func:`atomic_local_file`."""
    with atomic_local_file(dest, fsync=fsync) as f:
        write(f)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def _link_new(dest: str, data: bytes) -> bool:
    """Write ``data`` at the local path ``dest`` unless a file is there; whether it was written
    (a hard link of a complete temporary file: fails when another writer's file is there, never
    replaces it, and no reader sees a part)."""
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, dest)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _copy_into(src: str, out: BinaryIO) -> None:
    with open(src, "rb") as fi:
        while True:
            buf = fi.read(1 << 20)
            if not buf:
                break
            out.write(buf)


def _walk_files(root: Path) -> Iterable[str]:
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            yield os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")
