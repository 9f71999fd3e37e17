"""``parallel.env: address``: a run mode, not a cluster: the Dask cluster someone else started, at
``parallel.options.address`` or the address in ``parallel.options.scheduler_file``, used and left
running."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends.base import Placement

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings


@dataclass(frozen=True)
class RunningScheduler:
    """``parallel.options`` of ``env: address``: exactly one of the two.

    Attributes:
        address: The running scheduler, e.g. ``tcp://host:8786``. The run connects a client, runs
            its shards there and closes only its client: the scheduler and workers keep running,
            so repeated runs (nightly deployments) pay neither a cluster start nor the workers'
            imports. Its workers must import this project and see the manifests' audio and
            ``output_dir`` at the same paths; for flows, the Prefect API must be reachable from
            them: set ``PREFECT_API_URL`` to a server (not the private one on the driver's
            loopback), in the workers' environment too. The cluster's own settings apply:
            ``n_workers``, other ``options`` and ``adapt`` are an error, ``threads_per_worker``
            and ``allowed_failures`` are not used. (Also read as ``parallel.address``.)
        scheduler_file: Instead of ``address``: the JSON file written by ``dask scheduler
            --scheduler-file PATH``; its ``address`` is read when a run starts (e.g. a cluster
            started in a SLURM allocation, on shared storage). (Also read as
            ``parallel.scheduler_file``.)
    """

    address: str = ""
    scheduler_file: str = ""


class RunningCluster(Placement):
    """A cluster this run connects to and leaves running; its workers were started by someone
    else, with their own settings (so none of the run's may be given)."""

    own_options: ClassVar[type | None] = RunningScheduler
    leaves_running = True

    def check_config(self, cfg: ParallelSettings) -> None:
        given = self.options_of(cfg)
        if bool(given.address) == bool(given.scheduler_file):
            raise ConfigError("parallel.env=address needs exactly one of parallel.options.address (e.g. "
                              "tcp://host:8786) or parallel.options.scheduler_file (written by `dask scheduler "
                              "--scheduler-file PATH`)" + ("; both are set" if given.address else ""))
        fixed = {"n_workers": cfg.n_workers, "adapt": cfg.adapt,
                 **{f"options.{k}": v for k, v in self.cluster_options(cfg).items()}}
        for key, value in fixed.items():
            if value:
                raise ConfigError(f"parallel.{key} cannot be set with parallel.env=address: the running cluster's "
                                  "workers were started by someone else, with their own settings")
        if given.address:
            check_scheduler_address(given.address, "parallel.options.address")

    def scheduler_address(self, cfg: ParallelSettings) -> str:
        """The scheduler's address: ``options.address``, or the ``address`` field of
        ``options.scheduler_file`` read now (the scheduler rewrites the file each time it starts).

        Raises:
            ConfigError: for a scheduler file that is missing, unreadable, not JSON or without a
                valid ``address``.
        """
        given = self.options_of(cfg)
        if given.address:
            return given.address
        path = os.path.expanduser(given.scheduler_file)
        try:
            with open(path, encoding="utf-8") as fh:
                info = json.load(fh)
        except OSError as exc:
            raise ConfigError(f"parallel.options.scheduler_file: cannot read {path} ({exc.strerror or exc}); is the "
                              "scheduler running (`dask scheduler --scheduler-file PATH`) and the file on a path this "
                              "host sees?") from None
        except ValueError as exc:
            raise ConfigError(f"parallel.options.scheduler_file: {path} is not JSON ({exc})") from None
        address = info.get("address") if isinstance(info, dict) else None
        if not isinstance(address, str) or not address:
            raise ConfigError(f"parallel.options.scheduler_file: {path} has no \"address\" field; "
                              "is it a file written by `dask scheduler --scheduler-file`?")
        check_scheduler_address(address, f"parallel.options.scheduler_file ({path})")
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
        given = self.options_of(cfg)
        where = given.address or f"the scheduler of {given.scheduler_file}"
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
