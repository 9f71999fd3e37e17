"""What every Dask worker of a flow sets up (:class:`PrefectWorkerSetup`); imported only for a
flow whose shards run on a cluster (it imports ``distributed``)."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from espnet3_flows.orchestration import console
from espnet3_flows.orchestration.local_server import drain_prefect_clients
from espnet3_flows.orchestration.prefect_private.client import share_tls_contexts
from espnet3_flows.orchestration.prefect_private.contexts import cache_settings_hydration
from espnet3_flows.orchestration.prefect_private.events import skip_pending_events
from espnet3_flows.orchestration.prefect_private.gate import enter_run, leave_run
from espnet3_flows.orchestration.task_runner import PREFECT_WORKER_MODULES


class PrefectWorkerSetup(WorkerPlugin):
    """On each Dask worker: Prefect's clients share TLS contexts and its contexts are validated once
    (until the worker closes: then Prefect gets its own back), and Prefect's task engine is
    imported before the first shard task arrives. When the worker closes, the logs and events
    (task-run states) its tasks queued are sent: a forked worker exits without the interpreter
    shutdown that would otherwise send them.

    Args:
        quiet: Quiet each worker's console as a command line's (:func:`.console.quiet_console`):
            for a run whose workers print to its terminal.
    """

    name = "espnet3-prefect-worker-setup"

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def setup(self, worker: Any) -> None:  # Dask hook
        if self.quiet:
            console.quiet_console()
        console.quiet_completed_shards()
        enter_run()  # the patches stay until the worker closes (or leaves an in-process cluster)
        share_tls_contexts()
        cache_settings_hydration()
        skip_pending_events()
        for module in PREFECT_WORKER_MODULES:
            importlib.import_module(module)

    async def teardown(self, worker: Any) -> None:  # Dask hook
        await asyncio.to_thread(drain_prefect_clients)  # off the loop: Prefect's drain blocks
        leave_run()
