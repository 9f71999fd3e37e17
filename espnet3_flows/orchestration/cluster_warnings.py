"""Warnings before a run's shards go to a cluster: a situation in which they would not run
where ``parallel`` says, or could not report to the Prefect API."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("espnet3_flows")


def warn_if_dask_client_open(parallel: Any) -> bool:
    """Warn when a Dask client is already open in this process: prefect-dask's task runner then
    runs every task on that client's cluster and ignores ``parallel``. Returns whether it warned."""
    if not parallel.backend.uses_workers:
        return False
    from distributed import default_client

    try:
        client = default_client()
    except ValueError:
        return False
    log.warning(
        "a Dask client is open in this process (%s): prefect-dask will run the shard tasks on its cluster, "
        "not on parallel.env=%s; close it (client.close()) or run the flow in its own process",
        getattr(client, "scheduler", None) and client.scheduler.address, parallel.env)
    return True


def warn_if_api_unreachable(parallel: Any) -> bool:
    """Warn when the shards run on a cluster started elsewhere while the Prefect API is on this
    machine's loopback (a private server): workers on other hosts cannot report to it."""
    from prefect.settings import PREFECT_API_URL

    url = str(PREFECT_API_URL.value() or "")
    if not parallel.backend.leaves_running or not any(h in url for h in ("//127.", "//localhost", "//[::1]")):
        return False
    log.warning("parallel.env=%s with the Prefect API at %s: Dask workers on other hosts cannot reach a "
                "loopback address; start a Prefect server they can reach and set PREFECT_API_URL", parallel.env, url)
    return True
