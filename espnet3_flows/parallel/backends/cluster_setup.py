"""What a run does around a cluster it starts itself (:meth:`~.base.Backend.make_cluster`,
:meth:`~.base.Backend.prepare`): Dask's malloc trimming for its local workers, set for the block
in which they start only; the run's variables in the options of workers that do not inherit its
environment; the check that every worker imports this project."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

from espnet3_flows.config import ConfigError

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import Settings

#: Worker environments' setting of Dask's malloc trimming (their nannies add it when it is unset)
_TRIM_KEY = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"


@dataclass(frozen=True)
class WorkerMemory:
    """``parallel.options`` of a cluster whose workers this run starts (``local``, ``local_gpu``,
    the batch schedulers).

    Attributes:
        trim_worker_memory: Keep Dask's default ``MALLOC_TRIM_THRESHOLD_=65536`` in worker
            processes. Off by default: setting it disables glibc's dynamic mmap threshold, so
            every waveform or feature array over 128 KiB is a fresh mmap that is page-faulted and
            unmapped again, several times the fbank loop's CPU time (``benchmarks/README.md``).
            Turn it on if workers must hand memory back to the OS promptly; ``local`` workers are
            then spawned. (Also read as ``parallel.trim_worker_memory``.)
    """

    trim_worker_memory: bool = False


@contextlib.contextmanager
def worker_settings(trim: bool) -> Iterator[None]:
    """For the block in which a cluster starts its local workers: Dask's malloc trimming for
    their environment when ``trim`` (``trim_worker_memory``; their nannies read it when they are
    made), and Dask's ``MALLOC_TRIM_THRESHOLD_`` left in this process's environment by an earlier
    nanny kept from them. Both are undone when the block ends."""
    import dask

    from espnet3_flows.parallel.forkserver import DASK_TRIM_DEFAULT, without_inherited_trim_threshold

    value = int(DASK_TRIM_DEFAULT) if trim else None
    with dask.config.set({_TRIM_KEY: value}), without_inherited_trim_threshold():
        yield


def check_workers_import(client: Any, module: str = "espnet3_flows") -> None:
    """Raise a :class:`ConfigError` naming each worker that cannot import ``module`` (its
    interpreter lacks this project: the shard tasks would fail there to unpickle)."""
    probe = f"__import__('importlib.util').util.find_spec({module!r}) is not None"
    found = client.run(eval, probe)  # a builtin: nothing of this project is shipped for the check
    missing = sorted(addr for addr, ok in found.items() if not ok)
    if missing:
        hosts = sorted({addr.split("://")[-1].rsplit(":", 1)[0] for addr in missing})
        raise ConfigError(f"{module} cannot be imported on host(s) {', '.join(hosts)} (workers "
                          f"{', '.join(missing)}): install espnet3-flows in the workers' Python there "
                          "(parallel.options.remote_python for ssh) or put this checkout on their PYTHONPATH")


def set_option(cfg: Settings, where: str, variables: dict[str, str]) -> Settings:
    """``cfg`` with ``variables`` merged into the option at ``where`` (dotted); the user's own
    entries win."""
    import copy
    import dataclasses

    options = copy.deepcopy(cfg.options)
    node = options
    *parents, leaf = where.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = {**variables, **(node.get(leaf) or {})}
    return dataclasses.replace(cfg, options=options)
