"""Fixtures for the batching tests: small shape files and length tables built in tmp_path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from espnet3_flows.batching import LengthTable


@pytest.fixture
def write_file(tmp_path: Path) -> Callable[[str, Sequence[str]], Path]:
    """Write ``lines`` to ``tmp_path/name`` and return the path."""

    def write(name: str, lines: Sequence[str]) -> Path:
        path = tmp_path / name
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    return write


def _make_table(
    lengths: Sequence[float],
    *,
    groups: Sequence[str] | None = None,
    frame_shift: float | None = 0.01,
    prefix: str = "utt",
) -> LengthTable:
    """A one-column table with ids ``utt0000, utt0001, ...``."""
    return LengthTable(
        ids=[f"{prefix}{i:04d}" for i in range(len(lengths))],
        lengths=np.asarray(lengths)[None, :],
        dims=[1],
        column_names=["<test>"],
        frame_shift=frame_shift,
        groups=None if groups is None else list(groups),
    )


def _lognormal_frames(count: int, seed: int = 0) -> np.ndarray:
    """Frame counts of lognormal durations (median 4 s, sigma 0.5, 10 ms frames)."""
    durations = np.clip(np.random.default_rng(seed).lognormal(np.log(4.0), 0.5, count), 0.5, 30.0)
    return np.rint(durations / 0.01).astype(np.int64)


@pytest.fixture
def make_table() -> Callable[..., LengthTable]:
    """Factory for one-column tables (see ``_make_table``)."""
    return _make_table


@pytest.fixture
def lognormal_frames() -> Callable[..., np.ndarray]:
    """Factory for realistic frame counts (see ``_lognormal_frames``)."""
    return _lognormal_frames
