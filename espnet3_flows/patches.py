"""The one switch for every change this package makes to another library's internals.

They are all speed-ups or robustness fixes whose absence leaves runs correct, and the reads of
other libraries' private names, one module (or package) per library: Prefect's client, settings,
contexts and heartbeat (:mod:`espnet3_flows.orchestration.prefect_private`, put back when a run
ends), Dask's restart of a local worker's nanny and its forkserver preload flag (:mod:`espnet3_flows.parallel.dask_private`), CPython's
``multiprocessing`` (:mod:`espnet3_flows.parallel.multiprocessing_private`; local workers forked
from a preloaded forkserver, :mod:`espnet3_flows.parallel.forkserver`; off: spawned workers),
Hugging Face ``datasets``' fingerprint (:mod:`espnet3_flows.inputs.formats.hf_fingerprint`; off:
one made from the dataset's files), lhotse's fbank layout (:mod:`espnet3_flows.frontends.lhotse_private`;
off: lhotse's own ``Fbank.extract``, slower), the CLI's exit without the interpreter's teardown
(:func:`espnet3_flows.orchestration.entry.exit_now`), and the logging switches that keep Prefect's
shippers quiet once its API server is lost
(:func:`espnet3_flows.orchestration.prefect_private.lifecycle.quiet_shipper_failures`, put back
when the watched run ends).
``ESPNET3_FLOWS_PATCHES=off`` in the environment turns every one of them off, to tell whether one
is behind a problem; ``ESPNET3_FLOWS_PATCHES=-name[,-name ...]`` turns off the named ones only (the
names of :data:`PATCHES`), to tell which, or to measure what one buys (``benchmarks/README.md``).
``tests/test_patch_targets.py`` fails when an upgrade removed what one patches.
"""

from __future__ import annotations

import os

#: ``off`` (or ``0``, ``false``, ``no``) in this variable: no library's internals are changed;
#: ``-name`` entries (comma-separated): those of :data:`PATCHES` are not installed
VAR = "ESPNET3_FLOWS_PATCHES"
_OFF = ("off", "0", "false", "no")
_ON = ("on", "1", "true", "yes")

#: Every patch by name: what ``-name`` turns off, and the function that installs it (or decides it)
PATCHES = {
    "share_tls_contexts": "espnet3_flows.orchestration.prefect_private.client:share_tls_contexts",
    "untokenized_task_keys": "espnet3_flows.orchestration.prefect_private.client:untokenized_task_keys",
    "prompt_heartbeat_stop": "espnet3_flows.orchestration.prefect_private.lifecycle:prompt_heartbeat_stop",
    "forked_children_exit_cleanly": "espnet3_flows.orchestration.prefect_private.lifecycle:forked_children_exit_cleanly",
    "quiet_shipper_failures": "espnet3_flows.orchestration.prefect_private.lifecycle:quiet_shipper_failures",
    "quiet_failed_run_exit": "espnet3_flows.orchestration.prefect_private.lifecycle:quiet_failed_run_exit",
    "drop_undeliverable_api_work": "espnet3_flows.orchestration.prefect_private.lifecycle:drop_undeliverable_api_work",
    "cache_settings_serialization": "espnet3_flows.orchestration.prefect_private.contexts:cache_settings_serialization",
    "cache_settings_hydration": "espnet3_flows.orchestration.prefect_private.contexts:cache_settings_hydration",
    "skip_pending_events": "espnet3_flows.orchestration.prefect_private.events:skip_pending_events",
    "exit_now": "espnet3_flows.orchestration.entry:exit_now",
    "keep_dask_preload": "espnet3_flows.parallel.dask_private:keep_dask_preload",
    "forks_workers": "espnet3_flows.parallel.backends.local:LocalProcesses.forks_workers",
    "keep_restarted_workers": "espnet3_flows.parallel.dask_private:keep_restarted_workers",
    "dataset_fingerprint": "espnet3_flows.inputs.formats.hf_fingerprint:dataset_fingerprint",
    "importing_main": "espnet3_flows.parallel.multiprocessing_private:importing_main",
    "fbank_layout": "espnet3_flows.frontends.lhotse_private:fbank_layout",
}


def patches_enabled(name: str | None = None) -> bool:
    """Whether this package may change other libraries' internals (:data:`VAR` is not ``off``)
    and, for ``name`` (one of :data:`PATCHES`), whether that patch is not turned off alone.

    Raises:
        ValueError: when :data:`VAR` names a patch that does not exist (a typo would otherwise
            measure nothing).
    """
    value = os.environ.get(VAR, "").strip()
    if value.lower() in _OFF:
        return False
    if not value:
        return True
    off = turned_off(value)
    return name is None or name not in off


def turned_off(value: str) -> set[str]:
    """The patches a value of :data:`VAR` turns off one by one (its ``-name`` entries)."""
    entries = [e.strip() for e in value.split(",") if e.strip() and e.strip().lower() not in _ON]
    wrong = [e for e in entries if not e.startswith("-") or e[1:] not in PATCHES]
    if wrong:
        raise ValueError(f"{VAR}={value!r}: {', '.join(map(repr, wrong))} is not off or -<patch>; the patches: "
                         f"{', '.join(PATCHES)}")
    return {e[1:] for e in entries}
