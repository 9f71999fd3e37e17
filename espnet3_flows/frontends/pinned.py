"""Page-locked host memory that batches are assembled in before they go to a GPU, reused.

A copy to the GPU from pinned memory runs asynchronously and at full bus speed; allocating pinned
memory costs more than the copy it speeds up, so each frontend keeps one buffer and grows it only
when a batch is larger. A frontend copies its features back to the host (which waits for the GPU)
before it assembles the next batch: the buffer is free again by then.
"""

from __future__ import annotations

from typing import Any


class PinnedStaging:
    """One growing float32 buffer of pinned host memory."""

    def __init__(self) -> None:
        self._buffer: Any = None

    def take(self, n: int) -> Any:
        """The buffer's first ``n`` elements (a 1-D float32 tensor; contents left as they were)."""
        import torch

        if self._buffer is None or self._buffer.numel() < n:
            self._buffer = torch.empty(max(n, 1 << 20), dtype=torch.float32, pin_memory=True)
        return self._buffer[:n]
