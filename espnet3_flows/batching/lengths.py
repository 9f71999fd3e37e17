"""Utterance lengths for batching, read from ESPnet2 shape files, group files or a lhotse CutSet.

A shape file has one line per utterance, ``uttid 123,80`` (frames, feature dim) or
``uttid 48000`` (samples). Several shape files that *share* ids (``speech_shape`` and
``text_shape``) become the columns of one :class:`LengthTable`; the first column drives
sorting. Several files with *disjoint* ids (shards of one shape file) are concatenated
into one column.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from espnet3_flows.errors import Espnet3FlowsError

PathLike = Union[str, "os.PathLike[str]"]
ColumnSource = PathLike | Sequence[PathLike]


class LengthFileError(Espnet3FlowsError, ValueError):
    """A shape or group file line that cannot be used: names the file, line number and id.

    Attributes:
        path: The file the problem was found in.
        line_no: 1-based line number in ``path`` (``None`` when not tied to a line).
        utt_id: The utterance id concerned (``None`` when the line has no readable id).
    """

    def __init__(self, path: PathLike, line_no: int | None, utt_id: str | None, reason: str):
        self.path = str(path)
        self.line_no = line_no
        self.utt_id = utt_id
        where = self.path if line_no is None else f"{self.path}:{line_no}"
        who = "" if utt_id is None else f" (utterance {utt_id!r})"
        super().__init__(f"{where}{who}: {reason}")


@dataclass(frozen=True)
class ShapeColumn:
    """One shape file (or the concatenation of disjoint ones) read into arrays.

    Attributes:
        name: The source path(s), for messages and reports.
        ids: Utterance ids in file order.
        lengths: First shape dimension of every utterance (frames, samples, tokens).
        dim: Product of the remaining dimensions (80 for ``123,80``; 1 when absent);
            the largest over the column, since a padded tensor takes the largest.
        line_nos: 1-based line number of every id, for error messages.
        paths: The file each id came from, for error messages.
    """

    name: str
    ids: list[str]
    lengths: np.ndarray
    dim: int
    line_nos: list[int]
    paths: list[str]


def _parse_shape(path: PathLike, line_no: int, utt_id: str, text: str) -> tuple[int, int]:
    try:
        dims = [int(part) for part in text.split(",")]
    except ValueError:
        raise LengthFileError(
            path, line_no, utt_id, f"shape {text!r} is not comma-separated integers"
        ) from None
    if any(d <= 0 for d in dims):
        raise LengthFileError(path, line_no, utt_id, f"shape {text!r} has a zero or negative size")
    return dims[0], math.prod(dims[1:])


def _key_value_lines(path: PathLike, layout: str) -> Iterator[tuple[int, str, str]]:
    """Yield ``(line_no, key, value)`` of a two-column text file, skipping blank lines."""
    with open(path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            fields = raw.split()
            if not fields:
                continue
            if len(fields) != 2:
                raise LengthFileError(
                    path, line_no, fields[0], f"expected '{layout}', got {raw.rstrip()!r}"
                )
            yield line_no, fields[0], fields[1]


def read_shape_file(path: PathLike) -> ShapeColumn:
    """Read one ESPnet2 shape file (``uttid 123,80`` or ``uttid 48000`` per line).

    Blank lines are skipped. Every other line must hold an id and a shape of positive
    integers separated by commas.

    Args:
        path: The shape file.

    Returns:
        The file as a :class:`ShapeColumn`.

    Raises:
        LengthFileError: A malformed line, a duplicate id, or a zero/negative size.
    """
    return read_shape_files([path])


def read_shape_files(paths: Sequence[PathLike]) -> ShapeColumn:
    """Concatenate shape files with disjoint ids into one column, in the given order.

    Args:
        paths: Shape files whose ids do not overlap (e.g. the shards of one shape file).

    Returns:
        The concatenated :class:`ShapeColumn`.

    Raises:
        LengthFileError: A malformed line, a zero/negative size, or an id that appears
            twice (within a file or across files; the message names both places).
    """
    if not paths:
        raise ValueError("read_shape_files needs at least one path")
    ids: list[str] = []
    lengths: list[int] = []
    line_nos: list[int] = []
    sources: list[str] = []
    dim = 1
    seen: dict[str, tuple[str, int]] = {}
    for path in paths:
        for line_no, utt, shape in _key_value_lines(path, "uttid shape"):
            if utt in seen:
                first_path, first_line = seen[utt]
                raise LengthFileError(
                    path, line_no, utt, f"duplicate id, first seen at {first_path}:{first_line}"
                )
            length, utt_dim = _parse_shape(path, line_no, utt, shape)
            seen[utt] = (str(path), line_no)
            ids.append(utt)
            lengths.append(length)
            line_nos.append(line_no)
            sources.append(str(path))
            dim = max(dim, utt_dim)
    if not ids:
        raise LengthFileError(paths[0], None, None, "no utterances found")
    return ShapeColumn(
        name="+".join(str(p) for p in paths),
        ids=ids,
        lengths=np.asarray(lengths, dtype=np.int64),
        dim=dim,
        line_nos=line_nos,
        paths=sources,
    )


def read_group_file(path: PathLike) -> dict[str, str]:
    """Read a group-info file (``uttid group`` per line, e.g. utt2spk or utt2category).

    Args:
        path: The group file.

    Returns:
        A mapping from utterance id to group name.

    Raises:
        LengthFileError: A malformed line or a duplicate id.
    """
    groups: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for line_no, utt, group in _key_value_lines(path, "uttid group"):
        if utt in groups:
            raise LengthFileError(
                path, line_no, utt, f"duplicate id, first seen at line {first_line[utt]}"
            )
        groups[utt] = group
        first_line[utt] = line_no
    return groups


@dataclass
class LengthTable:
    """Per-utterance lengths that batch plans are built from.

    Row ``i`` is utterance ``ids[i]``; batch plans refer to rows by index, so a dataset
    indexed in the same order can consume index batches directly.

    Attributes:
        ids: Utterance ids (row order).
        lengths: Shape ``(num_columns, num_utts)``; row 0 drives sorting and the
            ``length`` budget, every row counts towards the ``numel`` budget.
        dims: Feature dimension of each column (multiplies its length in ``numel``).
        column_names: Where each column came from.
        frame_shift: Seconds per length unit (0.01 for 10 ms frames, 1/16000 for samples,
            1.0 for durations), or ``None`` when unknown; needed by ``max_duration``.
        groups: Group name per row, or ``None``.
    """

    ids: list[str]
    lengths: np.ndarray
    dims: list[int]
    column_names: list[str]
    frame_shift: float | None = None
    groups: list[str] | None = None

    def __post_init__(self) -> None:
        self.lengths = np.atleast_2d(np.asarray(self.lengths))
        if self.lengths.shape != (len(self.dims), len(self.ids)):
            expected = (len(self.dims), len(self.ids))
            raise ValueError(f"lengths has shape {self.lengths.shape}, expected {expected}")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("LengthTable ids must be unique")
        if self.groups is not None and len(self.groups) != len(self.ids):
            raise ValueError("groups must have one entry per id")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def primary(self) -> np.ndarray:
        """Lengths of the first column: the sort key."""
        return self.lengths[0]

    @classmethod
    def from_shape_files(
        cls,
        shape_files: Sequence[ColumnSource],
        *,
        frame_shift: float | None = None,
        group_file: PathLike | None = None,
    ) -> LengthTable:
        """Build a table from shape files that share ids (ESPnet2 ``shape_file`` list).

        Args:
            shape_files: One entry per column. An entry is a path, or a list of paths with
                disjoint ids that are concatenated into that column. The first column
                fixes the row order and drives sorting; every id must appear in every column.
            frame_shift: Seconds per unit of the first column, if known.
            group_file: Optional ``uttid group`` file; every id must have a group.

        Returns:
            The table.

        Raises:
            LengthFileError: Any bad line, or an id present in one column but not another.
        """
        if not shape_files:
            raise ValueError("at least one shape file is needed")
        columns = [
            read_shape_files([src] if isinstance(src, (str, os.PathLike)) else list(src))
            for src in shape_files
        ]
        first = columns[0]
        index = {utt: i for i, utt in enumerate(first.ids)}
        rows = [first.lengths]
        for column in columns[1:]:
            position = {utt: i for i, utt in enumerate(column.ids)}
            for utt, line_no, path in zip(first.ids, first.line_nos, first.paths, strict=True):
                if utt not in position:
                    raise LengthFileError(
                        path, line_no, utt, f"id missing from shape file {column.name}"
                    )
            for utt, line_no, path in zip(column.ids, column.line_nos, column.paths, strict=True):
                if utt not in index:
                    raise LengthFileError(
                        path, line_no, utt, f"id missing from shape file {first.name}"
                    )
            rows.append(column.lengths[[position[utt] for utt in first.ids]])
        table = cls(
            ids=list(first.ids),
            lengths=np.stack(rows),
            dims=[c.dim for c in columns],
            column_names=[c.name for c in columns],
            frame_shift=frame_shift,
        )
        if group_file is not None:
            table = table.with_groups(read_group_file(group_file), source=group_file)
        return table

    @classmethod
    def from_cuts(
        cls,
        cuts: Iterable[Any],
        *,
        frame_shift: float | None = None,
        group_of: Any = None,
    ) -> LengthTable:
        """Build a one-column table from a lhotse ``CutSet`` (any cuts with ``id``, ``duration``).

        Args:
            cuts: The cuts, in the order rows should have.
            frame_shift: When given, durations become whole frames of this many seconds
                (at least one frame); otherwise lengths are durations in seconds.
            group_of: Optional callable ``cut -> group name`` (e.g. ``lambda c:
                c.supervisions[0].speaker``).

        Returns:
            The table.

        Raises:
            LengthFileError: A duplicate id or a zero/negative duration.
        """
        ids: list[str] = []
        durations: list[float] = []
        groups: list[str] = []
        seen: set[str] = set()
        for position, cut in enumerate(cuts, start=1):
            if cut.id in seen:
                raise LengthFileError("<cuts>", position, cut.id, "duplicate id")
            if not cut.duration > 0:
                raise LengthFileError(
                    "<cuts>", position, cut.id, f"duration {cut.duration} is not positive"
                )
            seen.add(cut.id)
            ids.append(cut.id)
            durations.append(float(cut.duration))
            if group_of is not None:
                groups.append(str(group_of(cut)))
        if not ids:
            raise LengthFileError("<cuts>", None, None, "no cuts found")
        values = np.asarray(durations, dtype=np.float64)
        if frame_shift is not None:
            values = np.maximum(np.rint(values / frame_shift), 1).astype(np.int64)
        return cls(
            ids=ids,
            lengths=values[None, :],
            dims=[1],
            column_names=["<cuts>"],
            frame_shift=1.0 if frame_shift is None else frame_shift,
            groups=groups if group_of is not None else None,
        )

    def with_groups(self, groups: dict[str, str], source: PathLike = "<groups>") -> LengthTable:
        """Return a copy whose rows carry a group name each.

        Args:
            groups: Mapping ``uttid -> group``; ids the table lacks are ignored.
            source: Where the mapping came from, for the error message.

        Raises:
            LengthFileError: An id of the table has no group.
        """
        missing = [utt for utt in self.ids if utt not in groups]
        if missing:
            raise LengthFileError(source, None, missing[0], f"{len(missing)} id(s) have no group")
        return LengthTable(
            ids=self.ids,
            lengths=self.lengths,
            dims=self.dims,
            column_names=self.column_names,
            frame_shift=self.frame_shift,
            groups=[groups[utt] for utt in self.ids],
        )

    @classmethod
    def concat(cls, tables: Sequence[LengthTable]) -> LengthTable:
        """Stack tables with disjoint ids and the same columns into one.

        Args:
            tables: Tables whose ids do not overlap, with equal column counts.

        Raises:
            ValueError: Mismatched columns, or an id present in two tables.
        """
        if not tables:
            raise ValueError("concat needs at least one table")
        if len({t.lengths.shape[0] for t in tables}) != 1:
            raise ValueError("tables to concatenate must have the same number of columns")
        ids = [utt for t in tables for utt in t.ids]
        repeated = [utt for utt, count in Counter(ids).items() if count > 1]
        if repeated:
            raise ValueError(f"id {repeated[0]!r} appears in more than one table")
        groups = [t.groups for t in tables]
        return cls(
            ids=ids,
            lengths=np.concatenate([t.lengths for t in tables], axis=1),
            dims=[max(d) for d in zip(*(t.dims for t in tables), strict=True)],
            column_names=["+".join(names) for names in zip(*(t.column_names for t in tables), strict=True)],
            frame_shift=tables[0].frame_shift,
            groups=None if None in groups else [g for part in groups for g in part or []],
        )


def read_path_list(path: PathLike) -> list[Path]:
    """Read a list of files, one path a line; relative paths are taken from the list's folder.

    Args:
        path: The list file.
    """
    base = Path(path).parent
    entries = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    return [p if p.is_absolute() else base / p for p in (Path(e) for e in entries if e)]
