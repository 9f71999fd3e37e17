"""The package's errors: one root, and the one type that means "this input item is bad".

:class:`Espnet3FlowsError` is the root of every error this package raises on purpose (config,
manifest, storage, provider, bad item, failed shards). :class:`BadItemError` is the only one
``on_error`` applies to: under ``on_error: skip`` only a :class:`BadItemError` raised by
``forward`` makes an item a skipped one (listed in ``skipped.tsv``); under ``on_error: fail``
it fails the run at once, without retries (the item fails the same way every time). Any other
exception, a ``ValueError`` from numpy or torch inside a model included, is a failure of the
shard: retried (storage, network, a lost worker), then reported, never silently turned into
skipped items. Raise it (or a subclass) from ``forward`` or from what ``forward`` calls for
inputs that cannot be processed: missing or corrupt files, audio too short for the frontend,
features that come out NaN for this input.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

#: The values of ``on_error``: ``fail`` stops at the first bad item, ``skip`` lists it and goes on
#: (checked by :func:`espnet3_flows.config.check_on_error`, wherever a policy is given)
ON_ERROR_POLICIES = ("fail", "skip")


class Espnet3FlowsError(Exception):
    """The root of this package's errors: ``except Espnet3FlowsError`` catches every error the
    package raises on purpose (config, manifest, storage, bad item, failed shards), and nothing
    that is a bug."""


class BadItemError(Espnet3FlowsError, ValueError):
    """An input item that cannot be processed (the message names why); never a code bug."""


class ItemError(Espnet3FlowsError, RuntimeError):
    """``forward`` failed on an item under ``on_error: fail``; the message names the item."""


class ShardFailure(Espnet3FlowsError, RuntimeError):
    """One or more shards failed; the others finished and were published, and a rerun resumes."""


class ItemFailure(ShardFailure, ItemError):
    """A run stopped by a bad item under ``on_error: fail`` (an :class:`ItemError` and a
    :class:`ShardFailure`): the message names the item."""


class UnguardedMainError(Espnet3FlowsError, RuntimeError):
    """The driver's script starts workers or a run when it is imported, and Dask's workers import
    it (its run is not under ``if __name__ == "__main__":``); the message names the script and
    the fix (:mod:`espnet3_flows.parallel.main_guard`)."""


#: ``errno`` values that say something about one file, the same on every try: the item is bad
#: (skipped under ``on_error: skip``). A path that does not exist or cannot exist (missing, a
#: symlink loop, a name too long, a file used as a directory or a directory as a file, an invalid
#: name), or that this account may never read. Permission is per file on every store we read
#: (POSIX modes, S3 object ACLs): an outage that denies everything also fails every shard, and
#: ``skipped.tsv`` names each file with its reason.
ITEM_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "ENOENT", "ENOTDIR", "EISDIR", "ELOOP", "ENAMETOOLONG", "EILSEQ", "ENXIO", "ENODEV", "EACCES",
        "EPERM", "EFBIG", "EOVERFLOW",
    ) if hasattr(errno, name)
)


def causes(exc: BaseException | None, limit: int = 20) -> Iterator[BaseException]:
    """``exc`` and what caused it (``__cause__``, else ``__context__``), nearest first: at most
    ``limit`` of them, each once (a chain that loops back ends there)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < limit:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_item_os_error(exc: BaseException) -> bool:
    """Whether an ``OSError`` is permanent for the one file it names (see :data:`ITEM_ERRNOS`),
    so the item is bad rather than the store failing. Everything else is the store or the machine
    failing (``EIO``, ``ESTALE``, ``ETIMEDOUT``, connection resets, ``EMFILE``, ``ENOMEM``, an
    ``OSError`` without an errno from a network client, ...): the shard fails and is retried."""
    return isinstance(exc, OSError) and exc.errno in ITEM_ERRNOS


def describe_os_error(exc: OSError) -> str:
    """``exc`` as one line without the path (the caller names the item): ``Too many levels of
    symbolic links (ELOOP)``."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


#: The most characters of an input (a manifest field, a record's text) any message quotes
QUOTE_LIMIT = 200


def clip(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``text`` as a message may quote it: at most ``limit`` characters, a cut one ending in
    ``…`` with the number of characters left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``repr`` of an input as a message may quote it (clipped as :func:`clip` does): every message
    that names an id, path or line of an input goes through this or :func:`clip`, so that no input
    makes an error large (the ``error:`` line, a saved traceback, a Prefect state message)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text) - limit} more characters)"


#: Characters of one line of what is printed or saved about an error (the ``error:`` line, a line of
#: a saved traceback): the bound for text a library wrote, which :func:`clip` never saw
LINE_LIMIT = 4000


def clip_lines(text: str, limit: int = LINE_LIMIT) -> str:
    """``text`` with each of its lines clipped to ``limit`` characters."""
    return "\n".join(clip(line, limit) for line in text.split("\n"))
