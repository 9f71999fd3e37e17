"""Every private name of Dask (``distributed``) this package reads or sets, in one module, each
behind the patches' switch (:mod:`espnet3_flows.patches`) and checked by
``tests/test_patch_targets.py``: ``SpecCluster._update_worker_status`` (:func:`keep_restarted_workers`)
and ``distributed.utils._forkserver_preload_set`` (:func:`keep_dask_preload`)."""

from __future__ import annotations

from typing import Any


def keep_restarted_workers(cluster: Any) -> None:
    """Stop ``cluster`` (a ``SpecCluster`` whose nannies live in this process: ``local``,
    ``local_gpu``) from closing a nanny whose worker died.

    Dask's ``SpecCluster`` closes a worker's nanny for good when, ``distributed.deploy.
    lost-worker-timeout`` (15 s) after its worker left, that worker is not back at that instant. A
    nanny restarts its worker itself, so for a shard that kills every worker it runs on the check
    fell, sooner or later, between one death and the next restart: the cluster lost its nannies
    one by one and the run waited forever on an empty cluster. The check exists for workers in
    jobs that vanish; local nannies cannot, so their workers' comings and goings are only tracked.
    """
    from distributed import SpecCluster
    from distributed.deploy.cluster import Cluster

    from espnet3_flows.patches import patches_enabled

    patched = "_update_worker_status"  # SpecCluster's own (the timer), over the base Cluster's
    if (isinstance(cluster, SpecCluster) and patches_enabled("keep_restarted_workers") and patched in vars(SpecCluster)
            and patched in vars(Cluster)):
        # the base Cluster's bookkeeping of the scheduler's worker list, without SpecCluster's timer
        cluster._update_worker_status = super(SpecCluster, cluster)._update_worker_status


def keep_dask_preload() -> None:
    """Tell Dask our forkserver's preload is chosen: on its first worker start, Dask's
    ``get_mp_context`` would otherwise import its own preload list (pandas among it) in this
    process, for a server already running with ours (``distributed.utils``' private flag; nothing
    happens where it is absent)."""
    import distributed.utils

    from espnet3_flows.patches import patches_enabled

    if patches_enabled("keep_dask_preload") and getattr(distributed.utils, "_forkserver_preload_set", True) is False:
        distributed.utils._forkserver_preload_set = True
