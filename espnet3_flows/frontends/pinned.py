"""Page-locked host memory that batches are assembled in before they go to a GPU, and their copies.

A copy to the GPU from pinned memory runs asynchronously and at full bus speed; allocating pinned
memory costs more than the copy it speeds up, so each frontend keeps two buffers, used in turn, and
grows one only when a batch is larger. The copy runs on a side stream: the GPU's compute stream
waits for it, the host does not, so the host assembles batch k+1 in the other buffer while the GPU
copies and computes batch k (:func:`overlapped` runs a frontend's batches in that order).
"""

from __future__ import annotations

from typing import Any, TypeVar
from collections.abc import Callable, Iterable, Iterator

Batch = TypeVar("Batch")
Staged = TypeVar("Staged")
Result = TypeVar("Result")


class PinnedStaging:
    """Float32 buffers of pinned host memory (two, used in turn) and their copies to a GPU.

    Use :meth:`take`, fill the buffer, then :meth:`to_device`; the next :meth:`take` hands out the
    other buffer, waiting first (on the host) until the copy last made out of it has finished.
    """

    def __init__(self, slots: int = 2) -> None:
        self._buffers: list[Any] = [None] * slots
        self._copied: list[Any] = [None] * slots  # per buffer: an event after its last copy to a GPU
        self._slot = 0
        self._streams: dict[str, Any] = {}

    def take(self, n: int) -> Any:
        """The next buffer's first ``n`` elements (a 1-D float32 tensor; contents left as they were)."""
        import torch

        slot = self._slot
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
            self._copied[slot] = None
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[slot] = torch.empty(max(n, 1 << 20), dtype=torch.float32, pin_memory=True)
        return buffer[:n]

    def to_device(self, host: Any, device: Any) -> Any:
        """``host`` (what :meth:`take` last gave, filled) copied to the CUDA ``device`` on a side
        stream: work queued on the current stream afterwards waits for the copy, the host does not."""
        import torch

        device = torch.device(device)
        stream = self._streams.get(str(device))
        if stream is None:
            stream = self._streams[str(device)] = torch.cuda.Stream(device=device)
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            out = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        current.wait_event(done)
        out.record_stream(current)  # (the allocator reuses its memory only once the compute stream is done)
        self._copied[self._slot] = done
        self._slot = (self._slot + 1) % len(self._buffers)
        return out


def overlapped(batches: Iterable[Batch], stage: Callable[[Batch], Staged],
               launch: Callable[[Batch, Staged], Result]) -> Iterator[Result]:
    """``launch(batch, stage(batch))`` of each batch, in order, with the host's ``stage`` of batch
    k+1 done before batch k's result is handed over: on a GPU, where ``launch`` only queues work
    and the caller waits for batch k's result, the host's work on k+1 runs while the GPU works on k."""
    pending: list[Result] = []
    for batch in batches:
        staged = stage(batch)
        if pending:
            yield pending.pop()
        pending.append(launch(batch, staged))
    if pending:
        yield pending.pop()
