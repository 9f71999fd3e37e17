"""``parallel.env: lab_processes``: a local cluster of worker processes that import this package
anew (they are spawned: nothing is inherited from the flow's process but the environment)."""

from __future__ import annotations

from espnet3_flows.parallel.backends import Backend


def process_cluster(n_workers: int = 1, threads_per_worker: int = 1):
    """A ``LocalCluster`` of ``n_workers`` spawned processes."""
    from distributed import LocalCluster

    return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=True,
                        dashboard_address=":0")


BACKEND = Backend("lab_processes", "lab_plugins.backends.process_cluster",
                  doc="Spawned worker processes on this machine that import the lab's package anew.")
