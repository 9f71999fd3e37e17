"""Where a command-line run's wall time goes: named instants of the driver, appended as JSON lines
(``{"event": ..., "time": <epoch seconds>}``) to the file ``$ESPNET3_FLOWS_TIMELINE`` names, and
nothing at all when it is unset. ``benchmarks/bench_startup.py`` reads them to break a run into
imports, server, cluster, first shard, merge and teardown.

The events, in the order a run passes them: ``server_launched`` (the private API server, once the
config is read), ``planned`` (before the CLI's heavy imports, and the
shards' libraries being imported where they will run:
:mod:`espnet3_flows.orchestration.early_start`), ``main`` (the CLI's imports done),
``server_ready``, ``flow_started``, ``workers_ready``, ``first_shard``, ``shards_merged``,
``flow_returned`` (the flow's cluster closed and its final state reported), ``server_stopped``,
``summary_printed``; and, written by the local workers' forkserver (another ``pid``),
``forkserver_ready``: its imports done, workers fork from then on in milliseconds.
"""

from __future__ import annotations

import json
import os
import time

#: The environment variable naming the file
VAR = "ESPNET3_FLOWS_TIMELINE"


#: The last event this process reached ("" before the first): what a Ctrl-C interrupts
LAST = [""]


def mark(event: str) -> None:
    """Record that the driver reached ``event`` now (a no-op unless :data:`VAR` is set; the event is
    kept in :data:`LAST` either way)."""
    LAST[0] = event
    path = os.environ.get(VAR)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": event, "time": time.time(), "pid": os.getpid()}) + "\n")
