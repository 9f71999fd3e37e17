"""Audio files the tests build: large ones without disk or time."""

from __future__ import annotations

import struct
from pathlib import Path


def sparse_wav(path: Path, seconds: int, sr: int = 16000) -> int:
    """A valid PCM16 mono WAV of ``seconds`` of silence, written as a sparse file (no disk, no
    time); returns its data size in bytes."""
    n_bytes = seconds * sr * 2
    header = (b"RIFF" + struct.pack("<I", 36 + n_bytes) + b"WAVE" + b"fmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, sr, sr * 2, 2, 16) + b"data" + struct.pack("<I", n_bytes))
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + n_bytes)
    return n_bytes
