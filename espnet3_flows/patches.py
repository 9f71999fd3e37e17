"""The one switch for every change this package makes to another library's internals.

They are all speed-ups or robustness fixes whose absence leaves runs correct: Prefect's client,
settings and heartbeat (:mod:`espnet3_flows.orchestration.prefect_compat`), Dask's restart of a
local worker's nanny (:func:`espnet3_flows.parallel.backends.local.keep_restarted_workers`) and its
forkserver preload flag, local workers forked from a preloaded ``multiprocessing`` forkserver
(:mod:`espnet3_flows.parallel.forkserver`; off: spawned workers), the CLI's exit without the
interpreter's teardown (:func:`espnet3_flows.orchestration.entry.exit_now`), and the logging
switches that keep Prefect's shippers quiet once its API server is lost
(:func:`espnet3_flows.orchestration.prefect_compat.quiet_shipper_failures`, put back when the
watched run ends).
``ESPNET3_FLOWS_PATCHES=off`` in the environment turns every one of them off, to tell whether one
is behind a problem; ``tests/test_patch_targets.py`` fails when an upgrade removed what one patches.
"""

from __future__ import annotations

import os

#: ``off`` (or ``0``, ``false``, ``no``) in this variable: no library's internals are changed
VAR = "ESPNET3_FLOWS_PATCHES"


def patches_enabled() -> bool:
    """Whether this package may change other libraries' internals (:data:`VAR` is not ``off``)."""
    return os.environ.get(VAR, "").strip().lower() not in ("off", "0", "false", "no")
