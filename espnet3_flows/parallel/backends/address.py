"""``parallel.env: address``: a run mode, not a cluster: the Dask cluster someone else started, at
``parallel.address`` or the address in ``parallel.scheduler_file``, used and left running."""

from __future__ import annotations

from typing import TYPE_CHECKING

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends.base import Placement

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings


class RunningCluster(Placement):
    """A cluster this run connects to and leaves running; its workers were started by someone
    else, with their own settings (so none of the run's may be given)."""

    def check_config(self, cfg: ParallelSettings) -> None:
        if bool(cfg.address) == bool(cfg.scheduler_file):
            raise ConfigError("parallel.env=address needs exactly one of parallel.address (e.g. tcp://host:8786) "
                              "or parallel.scheduler_file (written by `dask scheduler --scheduler-file PATH`)"
                              + ("; both are set" if cfg.address else ""))
        fixed = {"n_workers": cfg.n_workers, "options": cfg.options, "adapt": cfg.adapt,
                 "trim_worker_memory": cfg.trim_worker_memory}
        for key, value in fixed.items():
            if value:
                raise ConfigError(f"parallel.{key} cannot be set with parallel.env=address: the running cluster's "
                                  "workers were started by someone else, with their own settings")
        if cfg.address:
            check_scheduler_address(cfg.address, "parallel.address")

    def describe(self, cfg: ParallelSettings) -> str:
        where = cfg.address or f"the scheduler of {cfg.scheduler_file}"
        return f"{self.name}: the running cluster at {where} (left running)"

    def table_row(self) -> list[str]:
        return [f"``{self.name}``", self.doc or "—", "a running one", "—", "—", "—"]


def check_scheduler_address(address: str, where: str) -> None:
    """Raise :class:`ConfigError` unless ``address`` is a Dask scheduler address (``tcp://host:port``)."""
    from distributed.comm import parse_address
    from distributed.comm.registry import backends

    protocol, location = parse_address(address)
    if protocol not in backends or not location:
        raise ConfigError(f"{where}: {address!r} is not a Dask scheduler address such as tcp://host:8786 "
                          f"(protocols: {', '.join(sorted(backends))})")


ADDRESS = RunningCluster("address", doc="The Dask cluster someone else started, at ``address`` or "
                                        "``scheduler_file``: used and left running.")
