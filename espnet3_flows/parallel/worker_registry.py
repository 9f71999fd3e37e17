"""Per-process registry of built worker resources and installed runners (filled on Dask workers by
the plugins of :mod:`.dask_plugins`, in this process by an in-process run).

A worker's resources are the dict a provider (or a ``setup_fn``) builds once per process and the
engine injects into ``forward`` and the hooks by parameter name: ESPnet3 calls it the "env"."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any
from collections.abc import Callable, Mapping

from espnet3_flows.parallel.env_provider import EnvironmentProvider, check_resources, checked_setup_fn, provider_token
from espnet3_flows.hashing import token

#: Most resource dicts (models) a process keeps, and most runners (small: config and plan options):
#: a long-lived worker that serves runs with other configs drops the least recently used
#: instead of growing without bound.
MAX_RESOURCES = 4
MAX_RUNNERS = 64

_RESOURCES: OrderedDict[str, dict[str, Any]] = OrderedDict()
_RUNNERS: OrderedDict[str, Any] = OrderedDict()
_LOCK = threading.RLock()


def _keep(registry: OrderedDict[str, Any], key: str, value: Any) -> None:
    registry[key] = value
    registry.move_to_end(key)
    while len(registry) > (MAX_RESOURCES if registry is _RESOURCES else MAX_RUNNERS):
        registry.popitem(last=False)


def worker_resources(provider: EnvironmentProvider, local: bool = False) -> dict[str, Any]:
    """The provider's resources in this process, built on first use and then reused.

    On a Dask worker the :class:`~.dask_plugins.EnvSetupPlugin` usually built them already at worker
    start; otherwise (e.g. a worker that joined later, or a Prefect task runner) they are built
    here once, from ``build_worker_setup_fn()``. ``local=True`` builds with ``build_env_local()``
    (an in-process run, as ESPnet3's local runs do), kept apart from the worker-built ones.
    """
    key = provider_token(provider) + (":local" if local else "")
    resources = _RESOURCES.get(key)
    if resources is not None:
        return resources
    with _LOCK:
        resources = _RESOURCES.get(key)
        if resources is None:
            if local:
                resources = check_resources(provider.build_env_local(), f"{type(provider).__name__}.build_env_local()")
            else:
                resources = check_resources(checked_setup_fn(provider)(),
                                            f"the setup function of {type(provider).__name__}")
            _keep(_RESOURCES, key, resources)
    return resources


#: :func:`worker_resources`' earlier name (``espnet3_flows.parallel.get_env``), kept for code that imports it
get_env = worker_resources


def keep_resources(key: str, resources: dict[str, Any]) -> None:
    """Keep ``resources`` in this process's registry under ``key`` (a ``setup_fn``'s on a worker)."""
    with _LOCK:
        _keep(_RESOURCES, key, resources)


def drop_resources(key: str) -> None:
    """Forget the resources kept under ``key``."""
    with _LOCK:
        _RESOURCES.pop(key, None)


def lookup_resources(key: str) -> dict[str, Any]:
    """The resources kept under ``key`` in this process (:func:`keep_resources`).

    Raises:
        LookupError: when this process has none (its worker plugin did not run here).
    """
    resources = _recent(_RESOURCES, key)
    if resources is None:
        raise LookupError(f"no worker resources {key} in this process: the setup_fn's worker plugin did not run on "
                          "this worker (was it restarted without its plugins?)")
    return resources


def _recent(registry: OrderedDict[str, Any], key: str) -> Any:
    """The entry under ``key`` (now the most recently used), or ``None``."""
    with _LOCK:
        value = registry.get(key)
        if value is not None:
            registry.move_to_end(key)
    return value


def resource_keys(provider: EnvironmentProvider) -> list[str]:
    """Names of the provider's resources in this process (builds them if needed)."""
    return sorted(worker_resources(provider))


def ensure_resources(key: str, setup_fn: Callable[[], Any], what: str = "worker setup function") -> None:
    """Build and keep the resources under ``key`` with ``setup_fn`` unless this process has them."""
    with _LOCK:
        if key not in _RESOURCES:
            _keep(_RESOURCES, key, check_resources(setup_fn(), what))


def build_setup_resources(setup_fn: Callable[[], Any]) -> dict[str, Any]:
    """Run a ``setup_fn`` (the parallel API's) and check what it returned: a dict with string keys,
    else a ``ValueError``."""
    resources = setup_fn()
    if not isinstance(resources, Mapping) or not all(isinstance(k, str) for k in resources):
        raise ValueError("setup_fn must return a dict of worker resources (name -> object), "
                         f"got {type(resources).__name__}")
    return dict(resources)


def runner_key(runner: Any) -> str:
    """A key naming a runner's work: its class, resources, output location and shard options."""
    store = runner.storage
    return token(None, {"cls": f"{type(runner).__module__}.{type(runner).__qualname__}",
                        "resources": provider_token(runner.provider), "output": store.uri() if store else None,
                        "subdir": runner.shard_subdir, "on_error": runner.on_error, "batch_size": runner.batch_size,
                        "config": runner.hash_config()})


def register_runner(key: str, runner: Any) -> None:
    """Make ``runner`` available in this process under ``key`` (see :func:`get_runner`)."""
    with _LOCK:
        _keep(_RUNNERS, key, runner)


def get_runner(key: str) -> Any:
    """The runner registered under ``key`` in this process (by :class:`~.dask_plugins.RunnerPlugin`
    on a worker)."""
    runner = _recent(_RUNNERS, key)
    if runner is None:
        raise LookupError(f"no runner {key} in this process: the flow installs runners on its workers before "
                          "submitting shards (was this worker restarted without its plugins?)")
    return runner
