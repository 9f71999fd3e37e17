"""Sorting more rows than memory should hold: sorted runs spilled to local disk, merged lazily.

Used wherever an output must be in key order at any size: a Kaldi data directory's files that are
out of order (``kaldi_dir``), and the shape files, which ESPnet2 sorts by utterance id
(``espnet2/bin/aggregate_stats_dirs.py``). Memory is one chunk of rows while spilling, then one
buffered row per run while merging; runs are merged at most :data:`FAN_IN` at a time, so a
million rows never hold more than a few hundred files open.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

#: Rows sorted in memory at a time (tests lower it to force runs on disk).
CHUNK_ROWS = 200_000
#: Runs merged at once; more are merged in rounds (each run is an open file while merging).
FAN_IN = 128


def sorted_rows(rows: Iterable[T], key: Callable[[T], Any], tmpdir: str, *,
                encode: Callable[[T], str], decode: Callable[[str], T],
                chunk_rows: int | None = None) -> Iterator[T]:
    """``rows`` sorted by ``key`` (stable: equal keys keep their input order).

    Rows that fit one chunk are sorted in memory and never touch the disk; more are sorted a
    chunk at a time into run files under ``tmpdir`` (which the caller removes) and merged.

    Args:
        rows: Any iterable, consumed once.
        key: The sort key of a row.
        tmpdir: A local directory for the runs.
        encode: A row as one line of text without ``\\n``; ``decode`` reverses it.
        decode: ``encode``'s inverse.
        chunk_rows: Rows per in-memory chunk (default :data:`CHUNK_ROWS`).
    """
    size = chunk_rows or CHUNK_ROWS
    runs: list[str] = []
    chunk: list[T] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            chunk.sort(key=key)
            runs.append(_spill(map(encode, chunk), tmpdir))
            chunk = []
    chunk.sort(key=key)
    if not runs:
        yield from chunk
        return
    if chunk:
        runs.append(_spill(map(encode, chunk), tmpdir))
    del chunk
    # runs are numbered in input order and merged in order: heapq.merge takes equal keys from
    # the earlier run first, so the sort stays stable across rounds
    while len(runs) > FAN_IN:
        runs = [_spill(map(encode, _merge(runs[i:i + FAN_IN], key, decode)), tmpdir)
                for i in range(0, len(runs), FAN_IN)]
    yield from _merge(runs, key, decode)


def sorted_lines(lines: Iterable[str], tmpdir: str, *, chunk_rows: int | None = None) -> Iterator[str]:
    """Text lines (without ``\\n``) sorted by their first whitespace-separated field, as ESPnet2
    sorts shape files and ``LC_ALL=C sort -k1,1 -s`` sorts UTF-8 (code point order is byte order)."""
    return sorted_rows(lines, _first_field, tmpdir, encode=str, decode=str, chunk_rows=chunk_rows)


def _first_field(line: str) -> str:
    return line.split(None, 1)[0] if line.strip() else ""


def _spill(lines: Iterable[str], tmpdir: str) -> str:
    fd, run = tempfile.mkstemp(dir=tmpdir, suffix=".run")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:  # no newline translation: a \r stays a \r
        for line in lines:
            f.write(line)
            f.write("\n")
    return run


def _merge(runs: list[str], key: Callable[[T], Any], decode: Callable[[str], T]) -> Iterator[T]:
    def read(run: str) -> Iterator[T]:
        try:
            with open(run, encoding="utf-8", newline="\n") as f:  # split on \n only, as written
                for line in f:
                    yield decode(line[:-1])
        finally:
            os.unlink(run)

    yield from heapq.merge(*(read(r) for r in runs), key=key)
