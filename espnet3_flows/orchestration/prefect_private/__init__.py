"""Every change this package makes to Prefect's (and prefect-dask's) internals, and every read of their
private names: nowhere else (``tests/test_private_reads.py`` holds the rest of the code to that).

They are speed-ups and fixes whose absence leaves runs correct, installed only through one gate,
:mod:`.gate`: a Prefect version they were verified against (``VERIFIED_PREFECT``; with another
none is installed and a warning says so) and ``ESPNET3_FLOWS_PATCHES`` not ``off`` (nor ``-name``
for the one named). A run installs them inside :func:`.gate.patched_run`, which puts Prefect's own
attributes back when the last run of the process ends; ``tests/test_patch_targets.py`` checks
each target against the installed versions.

- :mod:`.client`: API clients that share verified TLS contexts (``share_tls_contexts``); Dask keys
  that are not a token of a task's arguments (``untokenized_task_keys``).
- :mod:`.contexts`: the settings context serialized once per flow on the driver
  (``cache_settings_serialization``), it and the flow run's context validated once per worker
  (``cache_settings_hydration``).
- :mod:`.lifecycle`: heartbeats that stop with the run (``prompt_heartbeat_stop``); processes
  forked after a run that exit 0 (``forked_children_exit_cleanly``); no drain into a lost API
  server (``drop_undeliverable_api_work``), its shippers' failures kept off the console
  (``quiet_shipper_failures``); a run failed on purpose logged once (``quiet_failed_run_exit``).
- :mod:`.events`: no event for the Pending state a worker creates a task run in
  (``skip_pending_events``).

What each buys is in ``benchmarks/README.md``, "Figures behind settings in the code".
"""
