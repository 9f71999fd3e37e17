"""A Dask nanny that starts every worker process of its life the same way: forked from the
forkserver, a worker it restarts after a crash included.

Dask reads ``distributed.worker.multiprocessing-method`` each time a nanny starts a worker
process. A ``local`` cluster's first workers start inside
:func:`~espnet3_flows.parallel.forkserver.worker_start_method`, but a nanny restarts a dead worker
(SIGKILLed, out of memory, a shard that crashes it) later, outside that block, under Dask's
default: spawned, a fresh interpreter importing Dask, Prefect, torch and the job again (~3 s of
CPU each on 2 cores against ~1 s forked, and an import of the driver's script the forkserver
had already checked). :class:`ForkingNanny` sets the method while its own code runs, and only
then: the setting is global, and other nannies of the process (a spawning cluster beside it)
must not see it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

import dask
from distributed import Nanny

from espnet3_flows.parallel.forkserver import MP_METHOD_KEY

T = TypeVar("T")


class _UnderConfig(Awaitable[T]):
    """Awaits ``coro`` with ``config`` set each time the coroutine runs, unset while it waits: a
    ``with dask.config.set(...)`` across an ``await`` would leak into every coroutine that runs in
    the meantime, and two of them ending out of order would leave it set for good."""

    def __init__(self, coro: Coroutine[Any, Any, T], config: dict[str, Any]):
        self.coro = coro
        self.config = config

    def __await__(self) -> Generator[Any, Any, T]:
        send: Any = None
        throw: BaseException | None = None
        while True:
            with dask.config.set(self.config):
                try:
                    yielded = self.coro.send(send) if throw is None else self.coro.throw(throw)
                except StopIteration as done:
                    return done.value
            try:
                send, throw = (yield yielded), None
            except GeneratorExit:
                self.coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - a cancellation, passed on into the coroutine
                send, throw = None, exc


class ForkingNanny(Nanny):
    """``distributed.Nanny`` whose worker processes, restarts included, are forked from the
    forkserver (the cluster's ``worker_class`` when :mod:`~espnet3_flows.parallel.forkserver`
    forks its workers)."""

    async def instantiate(self):  # Nanny's own signature
        return await _UnderConfig(super().instantiate(), {MP_METHOD_KEY: "forkserver"})
