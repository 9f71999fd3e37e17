"""``parallel.env: serial``: a run mode, not a cluster: the shards run in this process, one after
the other, with no Dask (ESPnet3's earlier ``local``, and its runner with no parallel config)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends.base import Placement

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings


class InThisProcess(Placement):
    """The shards run in the calling process: no cluster, no client, no workers to start."""

    output_here = True
    uses_workers = False

    def connect(self, cfg: ParallelSettings) -> Any:
        raise ConfigError(f"parallel.env={self.name} runs in this process: there is no client to build "
                          "(parallel_map and parallel_for run the function here)")

    def dask_runner_options(self, cfg: ParallelSettings) -> dict[str, Any]:
        raise ConfigError(f"parallel.env={self.name} runs in this process: there is no Dask cluster "
                          "for a DaskTaskRunner")

    def describe(self, cfg: ParallelSettings) -> str:
        return f"{self.name}: in this process, no Dask"

    def runs_here(self, cfg: ParallelSettings, pending_shards: int) -> bool:
        return True


SERIAL = InThisProcess("serial", doc="In this process, one shard after the other, no Dask (ESPnet3's earlier "
                                     "``local``, and its runner with no parallel config).")
