"""Why a shard's Dask workers died: a memory limit named where the workers' nannies restarted them
for going over it (Dask's own error says only that "4 different workers ... died")."""

from __future__ import annotations

import contextlib

from espnet3_flows.errors import causes

#: The config key that sets a local worker's memory limit (``LocalCluster(memory_limit=...)``)
MEMORY_KEY = "parallel.options.memory_limit"


def killed_worker(exc: BaseException | None) -> BaseException | None:
    """distributed's ``KilledWorker`` in ``exc`` or what caused it (``None`` when there is none)."""
    return next((e for e in causes(exc) if type(e).__name__ == "KilledWorker" and hasattr(e, "last_worker")), None)


def memory_note(exc: BaseException | None) -> str:
    """For a shard whose workers all died while running it: the workers' memory limit, the key that
    sets it, how many were restarted for going over it, and what to do ("" for other errors, or
    workers with no limit)."""
    killed = killed_worker(exc)
    limit = getattr(getattr(killed, "last_worker", None), "memory_limit", None)
    if not limit:
        return ""
    restarts = _memory_restarts()
    if restarts == 0:  # died of something else (a segfault, a kill): the limit is not the cause
        return ""
    fix = f"give each worker more ({MEMORY_KEY}, or fewer parallel.n_workers) or make a shard's items need less"
    if restarts is None:  # (no client to ask) the limit is named, the cause not claimed
        return (f" The workers' memory limit is {limit / 2**20:.0f} MiB ({MEMORY_KEY}): a worker over 95 % of "
                f"it is restarted by its nanny; if that is why they died, {fix}")
    return (f" The workers' memory limit is {limit / 2**20:.0f} MiB ({MEMORY_KEY}): {restarts} worker(s) were "
            f"restarted by their nanny for going over 95 % of it; {fix}")


def _memory_restarts() -> int | None:
    """How many workers the current Dask client's cluster restarted for memory (``None``: unknown)."""
    with contextlib.suppress(Exception):
        from distributed import default_client

        return len(default_client().get_events("worker-restart-memory"))
    return None
