"""Every hash the package computes, in one place: what each one covers and its version.

A rerun skips exactly the work whose hash is unchanged, so a change to any function here changes
what users recompute: bump the version that names it, never its output silently.

- **Shard hash** (:func:`shard_hasher`): the code salt (:func:`code_salt`: :data:`FORMAT_VERSION`,
  never the package's version), the job config's digest (which holds the job's own output
  version, ``"collect_stats/1"``) (:func:`config_digest`) and each item's key
  (:func:`item_key`: its manifest payload and its file's fingerprint) in order. It names the
  shard's directory and is written in its ``done`` record.
- **Boundary hash** (:func:`id_hash64`): an item's identity alone (the utterance id), so that
  shard boundaries do not move when a file changes.
- **Plan digest** (:func:`shards_digest`): the ordered shard hashes of a split: whether a
  published merge is of exactly this plan.
- **File digest** (:func:`file_sha256`, :func:`bytes_sha256`): the SHA-256 of a published file's bytes, recorded with
  its size in the ``done`` record (shard files) or ``summary.json`` (merged files), and checked
  before either is trusted.
- **Tokens** (:func:`token`): short names of objects in a process or on disk, built from a
  ``kind`` and its fields: a provider's environment, a runner's work, a spooled manifest file.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, BinaryIO
from collections.abc import Iterable

#: Bump when the on-disk meaning of a shard's outputs changes, so old shards recompute.
#: 2: content-defined boundaries; per-utterance rows live in shard files, not done records.
FORMAT_VERSION = "2"
#: The salt's first field, frozen at the release that wrote it: the salt once held the package's
#: version, so that a release recomputed every user's shards (a 10-million-utterance cache) although
#: nothing in their outputs changed. What changes outputs moves FORMAT_VERSION or a job's version
#: (its ``hash_config()["job"]``; tests/test_output_versions.py fails when outputs change without
#: it); keeping this text keeps the hashes of the shards already computed.
SALT_ORIGIN = "espnet3_flows=0.1.0"


def canonical_json(obj: Any) -> str:
    """JSON text that is identical for equal values (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)


def digest(obj: Any) -> str:
    """SHA-256 hex digest of the canonical JSON of ``obj`` (what every named hash below builds on)."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def code_salt(extra: str = "") -> str:
    """The code-version salt mixed into every shard hash: :data:`FORMAT_VERSION` (and ``extra``),
    not the package's version."""
    return f"{SALT_ORIGIN};format={FORMAT_VERSION};{extra}"


def config_digest(config: Any) -> str:
    """The digest of the part of a job's config that changes its outputs (``hash_config()``)."""
    return digest(config or {})


def id_hash64(key: str) -> int:
    """A 64-bit hash of an item's identity: decides shard boundaries and finds duplicate ids."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def item_key(payload: bytes, fingerprint: str) -> bytes:
    """An input item's key in its shard hash: its manifest payload (the format's
    ``hash_payload`` of the line) and its file's fingerprint (size and mtime, or ETag)."""
    return payload + b"\t" + fingerprint.encode()


def runner_item_key(item: Any) -> str:
    """An item's key when a runner gets indices rather than manifest lines (``runner(indices)``):
    the index itself, or the JSON of a non-integer item."""
    return str(item) if isinstance(item, int) else json.dumps(item)


def shard_hasher(salt: str, config_hash: str) -> hashlib._Hash:
    """A shard hash before its items: feed each with :func:`add_item`."""
    return hashlib.sha256(salt.encode() + b"\0" + config_hash.encode())


def add_item(hasher: hashlib._Hash, key: str | bytes) -> None:
    """Feed one item's key to a shard's hash."""
    hasher.update(b"\0" + (key if isinstance(key, bytes) else key.encode("utf-8", "surrogatepass")))


def shards_digest(hashes: Iterable[str]) -> str:
    """Digest of an ordered list of shard hashes."""
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def token(kind: str | None, fields: Any, length: int = 24) -> str:
    """A short hex name of an object from what identifies it. ``kind`` names what is hashed
    (with its version, e.g. ``"kaldi-join/1"``) and goes first in the digested list; ``None``
    digests ``fields`` alone (the tokens that existed before kinds were named keep their values)."""
    return digest(fields if kind is None else [kind, *fields])[:length]


def bytes_sha256(data: bytes) -> str:
    """The SHA-256 hex digest of ``data`` (a file about to be published from memory)."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    """The SHA-256 hex digest of a local file's bytes, read ``chunk`` bytes at a time."""
    with open(path, "rb") as f:
        return fileobj_sha256(f, chunk)


def fileobj_sha256(f: BinaryIO, chunk: int = 1 << 20) -> str:
    """The SHA-256 hex digest of what is left to read of the open binary file ``f`` (local or
    an fsspec file), read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    while True:
        buf = f.read(chunk)
        if not buf:
            return h.hexdigest()
        h.update(buf)
