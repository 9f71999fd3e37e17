"""Reading a Kaldi data directory's files (``wav.scp``, ``segments``, ``utt2spk``, ``text``) for
the join of :mod:`.kaldi_dir`: ``key rest`` lines in file order, bad lines reported by the caller,
Kaldi's key order checked (a file out of order is sorted on local disk in chunks), and a lookup
that walks a sorted file beside the joined one, so that memory does not grow with the utterances."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Iterator, Mapping

import fsspec

from espnet3_flows.deadlines import with_deadlines
from espnet3_flows.errors import clip
from espnet3_flows.external_sort import sorted_rows
from espnet3_flows.inputs.manifest import BOM, MAX_LINE_BYTES, OversizeLine, bounded_lines
from espnet3_flows.inputs.records import ManifestError


class Unsorted(Exception):
    """A file's keys are out of order (the join restarts with that file sorted)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


#: A line of a Kaldi file: ``(key, rest, line number)``
Line = tuple[str, str, int]
BadLine = Callable[[str, int, str, str], None]  # (file name, line, key, problem)


def parse_lines(path: str, name: str, split: str, storage_options: Mapping[str, Any] | None,
                 bad: BadLine) -> Iterator[Line]:
    """``(key, rest, line)`` of a Kaldi file's lines in file order; blank lines are ignored,
    undecodable ones reported through ``bad``."""
    try:
        with fsspec.open(path, "rb", **with_deadlines(storage_options, path)) as f:
            for lineno, raw in enumerate(bounded_lines(f), start=1):
                if isinstance(raw, OversizeLine):  # never held whole: its head names it
                    key = raw[:800].split(None, 1)[0].decode("utf-8", "backslashreplace") if raw.strip() else ""
                    bad(name, lineno, clip(key), f"line is longer than {MAX_LINE_BYTES} bytes (1 MiB), the most a "
                                                 "manifest line may have")
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    key = raw.split(None, 1)[0].decode("utf-8", "backslashreplace") if raw.strip() else ""
                    bad(name, lineno, clip(key), f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
                    continue
                if lineno == 1 and text.startswith("\ufeff"):
                    raw = raw[len(BOM):]
                # the key ends at ASCII whitespace, as Kaldi's own readers end it: an id holding other
                # whitespace (U+3000, U+00A0) is then seen whole, and refused by the id check, never cut
                parts = raw.split(None, 1)
                if not parts:
                    continue
                yield (parts[0].decode("utf-8"), parts[1].decode("utf-8").rstrip() if len(parts) > 1 else "", lineno)
    except FileNotFoundError:
        raise ManifestError(f"split {split!r}: {path} disappeared while it was read") from None


def in_order(lines: Iterator[Line], name: str) -> Iterator[Line]:
    """Pass lines through, raising :class:`Unsorted` at the first key below its predecessor."""
    prev = ""
    for ln in lines:
        if ln[0] < prev:
            raise Unsorted(name)
        prev = ln[0]
        yield ln


def sorted_on_disk(lines: Iterator[Line], tmpdir: str) -> Iterator[Line]:
    """The lines sorted by key (then line number), in chunks sorted in memory and merged from disk."""
    return sorted_rows(lines, lambda ln: (ln[0], ln[2]), tmpdir, encode=_encode_line, decode=_decode_line)


def _encode_line(ln: Line) -> str:
    key, rest, lineno = ln
    return f"{key}\t{lineno}\t{rest}"


def _decode_line(row: str) -> Line:
    key, lineno, rest = row.split("\t", 2)
    return (key, rest, int(lineno))


class SortedLookup:
    """A cursor over a key-sorted ``utt2spk`` or ``text``: values for ascending keys in one pass."""

    def __init__(self, lines: Iterator[Line] | None, name: str, bad: BadLine):
        self.lines = lines if lines is not None else iter(())
        self.name, self.bad = name, bad
        self.cur: Line | None = None
        self._next()

    def _next(self) -> None:
        prev = self.cur
        self.cur = next(self.lines, None)
        while self.cur is not None and prev is not None and self.cur[0] == prev[0]:
            self.bad(self.name, self.cur[2], self.cur[0],
                     f"duplicate key {self.cur[0]!r} (first on line {prev[2]}): this line is ignored, the utterance "
                     "is kept with the first line's value")
            self.cur = next(self.lines, None)

    def get(self, key: str) -> str:
        """The value of ``key`` (empty when the file has none); keys must come in ascending order."""
        cur = self.cur
        while cur is not None and cur[0] < key:
            self._next()
            cur = self.cur
        return cur[1] if cur is not None and cur[0] == key else ""

    @property
    def line(self) -> int:
        """The line of the value :meth:`get` found last (0 at the end of the file)."""
        return self.cur[2] if self.cur is not None else 0

    def drain(self) -> None:
        """Read the lines after the last key asked for: a file is known to be in order (and its
        values right) only once all of it was read."""
        while self.cur is not None:
            self._next()


# -- the join -------------------------------------------------------------------------
