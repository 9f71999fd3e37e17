"""``parallel.env: serial``: a run mode, not a cluster: the shards run in this process, one after
the other, with no Dask (ESPnet3's earlier ``local``, and its runner with no parallel config)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from espnet3_flows.parallel.backends.base import Placement

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings


class InThisProcess(Placement):
    """The shards run in the calling process: no cluster, no client, no workers to start."""

    output_here = True

    def describe(self, cfg: ParallelSettings) -> str:
        return f"{self.name}: in this process, no Dask"

    def runs_here(self, cfg: ParallelSettings, pending_shards: int) -> bool:
        return True


SERIAL = InThisProcess("serial", doc="In this process, one shard after the other, no Dask (ESPnet3's earlier "
                                     "``local``, and its runner with no parallel config).")
