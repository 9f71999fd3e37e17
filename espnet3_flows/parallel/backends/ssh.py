"""``parallel.env: ssh``: Dask's ``SSHCluster`` on the hosts of ``parallel.options.hosts``: the
first runs the scheduler, each other one a worker of ``n_workers`` processes."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends.base import Backend, ClusterSpec
from espnet3_flows.parallel.backends.cluster_setup import set_option

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings, Settings

#: the loggers of the lines by which SSHCluster finds its remote processes ("Scheduler at",
#: "Start worker at", read from their stderr at INFO)
_START_LOGGERS = ("distributed.scheduler", "distributed.worker")


@contextlib.contextmanager
def start_lines_logged() -> Iterator[None]:
    """Dask's config, which SSHCluster hands its remote processes, with the loggers of their start
    lines at INFO for the block: with ``logging.distributed: warning`` (a user's config or
    ``DASK_LOGGING__DISTRIBUTED``) those lines never come and SSHCluster waits for them forever.
    A logging config of Python's own form (``version: 1``) is left as the user wrote it."""
    import dask

    logging_config = dask.config.get("logging", default={}) or {}
    if not isinstance(logging_config, dict) or "version" in logging_config:
        yield
        return
    with dask.config.set({"logging": {**logging_config, **dict.fromkeys(_START_LOGGERS, "info")}}):
        yield


class SSHHosts(Backend):
    """Workers on other machines over SSH; they do not inherit this process's environment (it
    goes in ``options.worker_options.env``)."""

    counts = "processes per host"

    def defaults(self, cfg: ParallelSettings) -> dict[str, Any]:
        # the remote workers run the driver's interpreter path unless told otherwise (a venv at the
        # same path on every host, as a lab's shared software tree has it)
        return {"remote_python": sys.executable}

    def check(self, cfg: ParallelSettings) -> None:
        hosts = cfg.options.get("hosts")
        if not isinstance(hosts, (list, tuple)) or len(hosts) < 2 or not all(isinstance(h, str) and h for h in hosts):
            raise ConfigError("parallel.options.hosts: a list of at least two host names, the first running the "
                              f"scheduler and the others one worker each (SSHCluster's hosts), got {hosts!r}")

    def place_workers(self, cfg: ParallelSettings, kwargs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if cfg.n_workers:  # processes per host
            kwargs["worker_options"] = {**kwargs.get("worker_options", {}), "n_workers": cfg.n_workers}
        return cfg.n_workers, {}

    def with_worker_environ(self, cfg: Settings, variables: dict[str, str]) -> Settings:
        return set_option(cfg, "worker_options.env", variables) if variables else cfg

    @contextlib.contextmanager
    def starting(self, spec: ClusterSpec, cfg: ParallelSettings) -> Iterator[dict[str, Any]]:
        with super().starting(spec, cfg) as kwargs, start_lines_logged():
            yield kwargs

    def worker_slots(self, cfg: ParallelSettings) -> int:
        hosts = cfg.options.get("hosts") or []
        return max(1, len(hosts) - 1) * max(1, cfg.n_workers)


SSH = SSHHosts("ssh", "distributed.SSHCluster", required=("hosts",), also_accepts="distributed.SpecCluster",
               requires="asyncssh", extra="ssh",
               doc="Workers on other machines over SSH: ``options.hosts``' first runs the scheduler, each other one "
                   "a worker of ``n_workers`` processes.")
