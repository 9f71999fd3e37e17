"""Page-locked host memory that batches are assembled in before they go to a GPU, and their copies.

A copy to the GPU from pinned memory runs asynchronously and at full bus speed; allocating pinned
memory costs more than the copy it speeds up, so each frontend keeps two buffers, used in turn, and
grows one only when a batch is larger. The copy runs on a side stream: the GPU's compute stream
waits for it, the host does not, so the host assembles batch k+1 in the other buffer while the GPU
copies and computes batch k (:func:`overlapped` runs a frontend's batches in that order).

Results come back the same way (:meth:`PinnedStaging.to_host`): each batch's features in one copy
into pinned memory on a side stream, queued behind its compute, so that the copy of batch k runs
while the GPU computes batch k+1, and the host waits only when it takes batch k. That pinned memory
comes from torch's caching host allocator: reused once its copy is done and its arrays are dropped.
"""

from __future__ import annotations

from typing import Any, TypeVar
from collections.abc import Callable, Iterable, Iterator

Batch = TypeVar("Batch")
Staged = TypeVar("Staged")
Result = TypeVar("Result")


class HostCopy:
    """A tensor on its way to page-locked host memory (:meth:`PinnedStaging.to_host`); :meth:`wait`
    gives it, :meth:`array` a NumPy copy of it in ordinary memory."""

    def __init__(self, host: Any, done: Any = None):
        self._host, self._done = host, done
        #: whether the tensor is in page-locked memory (it came from a GPU)
        self.pinned = done is not None

    def wait(self) -> Any:
        """The host tensor, once its copy has finished (the host sleeps until then, on that copy
        alone)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host

    def array(self) -> Any:
        """The tensor as a NumPy array that holds no page-locked memory: copied out of it (one
        ``memcpy``, while the GPU computes on) when it came from a GPU, so that torch's caching
        allocator takes the pinned block back at once; a host tensor's own memory otherwise."""
        host = self.wait().numpy()
        return host.copy() if self.pinned else host


class PinnedStaging:
    """Float32 buffers of pinned host memory (two, used in turn) and their copies to a GPU; and
    results copied back (:meth:`to_host`).

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
        stream = self._stream(str(device), device)
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

    def to_host(self, tensor: Any) -> HostCopy:
        """Start copying ``tensor`` to the host: from a CUDA GPU into pinned memory on a side stream
        (not the one of :meth:`to_device`) that first waits for the work queued so far on the
        current stream, so that work queued on the current stream afterwards runs beside the copy;
        a host tensor as it is."""
        import torch

        if tensor.device.type != "cuda":
            return HostCopy(tensor)
        stream = self._stream(f"to host {tensor.device}", tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # (its wait sleeps: a waiting worker spins no core)
            done.record(stream)
        tensor.record_stream(stream)  # (its memory is not reused before the copy has read it)
        return HostCopy(host, done)

    def _stream(self, key: str, device: Any) -> Any:
        import torch

        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device)
        return stream


def overlapped(batches: Iterable[Batch], stage: Callable[[Batch], Staged],
               launch: Callable[[Batch, Staged], Result]) -> Iterator[Result]:
    """``launch(batch, stage(batch))`` of each batch, in order, with batch k+1 staged and launched
    before batch k's result is handed over: on a GPU, where ``launch`` only queues work and the
    caller waits for batch k's result, the GPU has batch k+1 queued while the host assembles the
    next batch and takes batch k's results. So two batches' results are alive at once (size
    batches for it), and a launch that fails fails before the batch before it is handed over."""
    pending: list[Result] = []
    for batch in batches:
        pending.append(launch(batch, stage(batch)))
        if len(pending) > 1:
            yield pending.pop(0)
    if pending:
        yield pending.pop()
