"""``parallel.env: address``: a run mode, not a cluster: the Dask cluster someone else started, at
``parallel.address`` or the address in ``parallel.scheduler_file``, used and left running."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

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

    leaves_running = True

    def scheduler_address(self, cfg: ParallelSettings) -> str:
        """The scheduler's address: ``cfg.address``, or the ``address`` field of
        ``cfg.scheduler_file`` read now (the scheduler rewrites the file each time it starts).

        Raises:
            ConfigError: for a scheduler file that is missing, unreadable, not JSON or without a
                valid ``address``.
        """
        if cfg.address:
            return cfg.address
        path = os.path.expanduser(cfg.scheduler_file)
        try:
            with open(path, encoding="utf-8") as fh:
                info = json.load(fh)
        except OSError as exc:
            raise ConfigError(f"parallel.scheduler_file: cannot read {path} ({exc.strerror or exc}); is the scheduler "
                              "running (`dask scheduler --scheduler-file PATH`) and the file on a path this host "
                              "sees?") from None
        except ValueError as exc:
            raise ConfigError(f"parallel.scheduler_file: {path} is not JSON ({exc})") from None
        address = info.get("address") if isinstance(info, dict) else None
        if not isinstance(address, str) or not address:
            raise ConfigError(f"parallel.scheduler_file: {path} has no \"address\" field; "
                              "is it a file written by `dask scheduler --scheduler-file`?")
        check_scheduler_address(address, f"parallel.scheduler_file ({path})")
        return address

    def connect(self, cfg: ParallelSettings) -> Any:
        """A client of the running scheduler; close only the client, the cluster keeps running."""
        from distributed import Client

        address = self.scheduler_address(cfg)
        try:
            return Client(address)
        except OSError as exc:
            raise OSError(f"parallel.env={self.name}: no Dask scheduler answers at {address}: {exc}") from exc

    def dask_runner_options(self, cfg: ParallelSettings) -> dict[str, Any]:
        """The runner connects to the running scheduler (its file read now) and closes only its client."""
        return {"address": self.scheduler_address(cfg)}  # no workers of ours to start

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
