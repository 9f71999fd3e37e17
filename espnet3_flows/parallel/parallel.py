"""ESPnet3's parallel API (``espnet3.parallel.parallel``): the process-wide ``parallel`` config,
clients on the clusters it describes, and ``parallel_map`` / ``parallel_for`` over any function,
with worker resources built once per worker by a ``setup_fn`` and injected into the function by
parameter name (the same injection a runner's ``forward`` gets).

Code written for ``espnet3.parallel`` runs here with its imports changed to
``espnet3_flows.parallel``, ``build_local_gpu_cluster`` and ``DictReturnWorkerPlugin`` included. What
differs on purpose: ``parallel.env: serial`` runs in this process (no client: ``parallel_map`` and
``parallel_for`` then call the function here, ``setup_fn`` once); ``set_parallel(None)`` clears the
config (ESPnet3 keeps the previous one); see ``docs/espnet3-conformance.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping

from espnet3_flows.config import ConfigError
from espnet3_flows.parallel.backends import get_backend, visible_gpu_count
from espnet3_flows.parallel.parallel_config import ParallelConfig, as_parallel_config
from espnet3_flows.parallel.injection import conflicting_keys, injected
from espnet3_flows.parallel.worker_registry import build_setup_resources, lookup_resources

_LOG = logging.getLogger(__name__)
_CURRENT: ParallelConfig | None = None
#: client → the token of the resources its ``setup_fn`` built on the workers (see :func:`get_client`)
_SETUP_RESOURCES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

# (the two plugin names come from the module-level __getattr__ below: imported on first use)
__all__ = ["DictReturnWorkerPlugin", "GpuClusterError", "WorkerEnvPlugin", "build_client", "build_local_gpu_cluster",  # noqa: F822
           "get_client", "get_parallel_config", "parallel_for", "parallel_is_set", "parallel_map", "set_parallel",
           "visible_gpu_count"]


class GpuClusterError(ConfigError, RuntimeError):
    """:func:`build_local_gpu_cluster` cannot start a GPU cluster here: dask-cuda is not installed.
    A ``RuntimeError``, as ESPnet3 raises it, and a :class:`ConfigError` (a ``ValueError``), as
    every other "this env cannot run here" error of this package."""


def set_parallel(config: ParallelConfig | Any | None) -> None:
    """Set the process-wide ``parallel`` config used by :func:`get_client`, :func:`parallel_map`
    and runners without a client (ESPnet3's API): a :class:`ParallelConfig`, or a mapping /
    OmegaConf node of its keys (``cfg.parallel``). ``None`` clears it: runners then run in this
    process again."""
    global _CURRENT
    _CURRENT = None if config is None else as_parallel_config(config)


def parallel_is_set() -> bool:
    """Whether :func:`set_parallel` set a config (runners without a client then use it)."""
    return _CURRENT is not None


def get_parallel_config() -> ParallelConfig:
    """The config set with :func:`set_parallel` (a default ``local`` one if none was set)."""
    return _CURRENT if _CURRENT is not None else ParallelConfig()


def _config(config: ParallelConfig | Any | None) -> ParallelConfig:
    return get_parallel_config() if config is None else as_parallel_config(config)


def build_client(config: ParallelConfig | Any | None = None) -> Any:
    """A ``distributed.Client`` for ``config`` (``set_parallel``'s by default): on a new cluster
    (close both: ``client.close(); client.cluster.close()``, or use :func:`get_client`), or
    connected to the running scheduler of ``env: address`` (close the client only).

    Raises:
        ConfigError: (a ``ValueError``) for an unknown ``env`` (naming the known ones), bad
            options, or ``env: serial``, which runs in this process and has no client.
    """
    cfg = _config(config)
    return cfg.backend.connect(cfg)


def build_local_gpu_cluster(n_workers: int, options: Mapping[str, Any] | None = None) -> Any:
    """A ``distributed.Client`` on a new ``dask_cuda.LocalCUDACluster`` of this machine, one worker
    per GPU (ESPnet3's ``build_local_gpu_cluster``); the same cluster ``parallel.env: local_gpu``
    starts (:func:`build_client`). Close both when done: ``client.close(); client.cluster.close()``.

    Args:
        n_workers: Workers, one GPU each: at most the visible GPUs (fewer leaves GPUs idle, with a
            warning); 0 starts one per visible GPU.
        options: Keyword arguments for ``LocalCUDACluster`` (``parallel.options``), checked by name
            before the cluster starts.

    Raises:
        GpuClusterError: (a ``RuntimeError``) dask-cuda is not installed; the message names the install.
        ValueError: ``n_workers`` is negative, not an int, or more than the visible GPUs.
    """
    try:
        get_backend("local_gpu").check_installed()
    except ConfigError as exc:
        raise GpuClusterError(f"build_local_gpu_cluster: {exc}; in a checkout of this project: make install "
                              "EXTRAS=dev,gpu CONSTRAINTS=constraints-gpu.txt") from None
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
        raise ValueError(f"build_local_gpu_cluster: n_workers must be an int >= 0 (0: one per GPU), got {n_workers!r}")
    gpus = visible_gpu_count()
    if n_workers > gpus:
        raise ValueError(f"build_local_gpu_cluster: n_workers={n_workers} > num_gpus={gpus} visible to this process "
                         "(each worker takes one GPU)")
    if 0 < n_workers < gpus:
        warnings.warn(f"build_local_gpu_cluster: n_workers={n_workers} < num_gpus={gpus}, some GPUs may be idle",
                      UserWarning, stacklevel=2)
    return build_client(ParallelConfig(env="local_gpu", n_workers=n_workers, options=dict(options or {})))


@contextlib.contextmanager
def get_client(config: ParallelConfig | Any | None = None, setup_fn: Callable[[], Mapping[str, Any]] | None = None,
               *, plugin: Any = None, wait_for_workers: int = 1) -> Iterator[Any]:
    """A client on a cluster for ``config`` (``set_parallel``'s by default), closed with the cluster it
    started when the block ends; for ``env: address``, only the client is closed (and what it
    registered on the workers removed), the cluster keeps running.

    ``get_client(plugin)``, a ``distributed.WorkerPlugin`` first, is the seed's form: the plugin is
    registered on every worker (e.g. one that loads a model in ``setup``).

    Args:
        config: The ``parallel`` config (a :class:`ParallelConfig` or a mapping of its keys).
        setup_fn: A zero-argument function run once per worker, returning a dict: the resources that
            :func:`parallel_map` / :func:`parallel_for` on this client inject into the function.
        plugin: A worker plugin to register.
        wait_for_workers: Block until this many workers joined (0: do not wait).
    """
    from distributed.diagnostics.plugin import WorkerPlugin

    from espnet3_flows.parallel.dask_plugins import WorkerEnvPlugin

    if isinstance(config, WorkerPlugin):
        config, plugin = None, config
        if setup_fn is not None and not callable(setup_fn):  # the older get_client(plugin, config)
            config, setup_fn = setup_fn, None
    cfg = _config(config)
    with contextlib.ExitStack() as stack:
        client = build_client(cfg)
        owned = cfg.backend.owns_cluster
        if owned:
            stack.callback(client.cluster.close)  # after the client (callbacks run last in, first out)
        stack.callback(client.close)
        if wait_for_workers:
            expected = cfg.n_workers or 1
            client.wait_for_workers(min(wait_for_workers, expected) if owned else wait_for_workers, timeout=600)
        if setup_fn is not None:
            setup_plugin = WorkerEnvPlugin(setup_fn)
            _register(client, setup_plugin, stack, cfg)
            _SETUP_RESOURCES[client] = setup_plugin.token
        if plugin is not None:
            _register(client, plugin, stack, cfg)
        yield client


def _register(client: Any, plugin: Any, stack: contextlib.ExitStack, cfg: ParallelConfig) -> None:
    """Register ``plugin`` on every worker; on a cluster someone else runs, unregister it at the end."""
    client.register_plugin(plugin)
    if cfg.backend.leaves_running:
        stack.callback(_unregister_plugin, client, plugin)


def _unregister_plugin(client: Any, plugin: Any) -> None:
    name = getattr(plugin, "name", None)
    if not name:
        return
    try:
        client.unregister_worker_plugin(name)
    except Exception as exc:  # noqa: BLE001 - the results are in; a leftover plugin only costs memory
        _LOG.warning("could not unregister worker plugin %s from %s: %s", name, client.scheduler.address, exc)


@contextlib.contextmanager
def _mapping_target(client: Any, setup_fn: Callable[[], Any] | None) -> Iterator[tuple[Any, str | None, dict]]:
    """(client or ``None`` for this process, the resources' token on the workers, the resources here)."""
    if client is None:
        cfg = get_parallel_config()
        if not cfg.backend.uses_workers:
            yield None, None, build_setup_resources(setup_fn) if setup_fn is not None else {}
            return
        with get_client(cfg, setup_fn=setup_fn) as own:
            yield own, _SETUP_RESOURCES.get(own), {}
        return
    if setup_fn is None:
        yield client, _SETUP_RESOURCES.get(client), {}
        return
    from espnet3_flows.parallel.dask_plugins import WorkerEnvPlugin

    setup_plugin = WorkerEnvPlugin(setup_fn)
    client.register_plugin(setup_plugin)
    try:
        yield client, setup_plugin.token, {}
    finally:
        _unregister_plugin(client, setup_plugin)


def _call_on_worker(item: Any, func: Callable[..., Any], token: str | None, kwargs: Mapping[str, Any]) -> Any:
    """``func(item, **kwargs, **resources)`` on a worker, the resources being those ``token`` names there."""
    resources = lookup_resources(token) if token else {}
    return _call(func, item, resources, kwargs)


def _call(func: Callable[..., Any], item: Any, resources: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Any:
    clash = conflicting_keys(func, resources, kwargs)
    if clash:
        raise ValueError(f"{_name(func)}: {', '.join(repr(k) for k in clash)} given both in the arguments and by "
                         "the worker resources (setup_fn); rename one of them")
    return func(item, **kwargs, **injected(func, {k: v for k, v in resources.items() if k not in kwargs}, 1))


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", None) or type(func).__name__


def _check_before_submit(client: Any, token: str | None, func: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Raise the conflict error before any item runs: the resources' names, read on one worker."""
    if not token or not kwargs:
        return
    keys_by_worker = client.run(_resource_keys, token, workers=list(client.scheduler_info()["workers"])[:1])
    keys = next(iter(keys_by_worker.values()), [])
    clash = conflicting_keys(func, keys, kwargs)
    if clash:
        raise ValueError(f"{_name(func)}: {', '.join(repr(k) for k in clash)} given both in the arguments and by "
                         "the worker resources (setup_fn); rename one of them")


def _resource_keys(token: str) -> list[str]:
    return sorted(lookup_resources(token))


def parallel_map(func: Callable[..., Any], data: Iterable[Any], client: Any = None,
                 setup_fn: Callable[[], Mapping[str, Any]] | None = None, **kwargs: Any) -> list[Any]:
    """``func(item, **kwargs)`` for every item, on the cluster, results in input order.

    Worker resources (from ``setup_fn``, or the one ``get_client(config, setup_fn=...)`` gave
    ``client``) reach ``func`` by parameter name; all of them where it takes ``**kwargs``.

    Args:
        func: The function; its first parameter takes the item.
        data: The items.
        client: A ``distributed.Client``; without one, a cluster from ``set_parallel``'s config,
            closed afterwards (``serial``: this process).
        setup_fn: A zero-argument function, run once per worker, returning a dict (the resources).
        **kwargs: Further arguments of ``func``, the same for every item.

    Raises:
        ValueError: a name given both in ``kwargs`` and by the resources (before any item runs), or a
            ``setup_fn`` that does not return a dict. An exception of ``func`` is raised as is,
            the remaining items cancelled.
    """
    items = list(data)
    with _mapping_target(client, setup_fn) as (target, token, local_resources):
        if target is None:
            return [_call(func, item, local_resources, kwargs) for item in items]
        _check_before_submit(target, token, func, kwargs)
        call = functools.partial(_call_on_worker, func=func, token=token, kwargs=kwargs)
        futures = target.map(call, items, pure=False)
        try:
            return target.gather(futures)
        except BaseException:
            target.cancel(futures)
            raise


def parallel_for(func: Callable[..., Any], data: Iterable[Any], client: Any = None,
                 setup_fn: Callable[[], Mapping[str, Any]] | None = None, **kwargs: Any) -> Iterator[Any]:
    """Like :func:`parallel_map`, but yields each result as it completes (not in input order).

    An exception of ``func`` is raised when the iteration reaches it, and the remaining items are
    cancelled; so are they when the loop stops early. A cluster started for the call is closed
    when the iteration ends.
    """
    items = list(data)
    with _mapping_target(client, setup_fn) as (target, token, local_resources):
        if target is None:
            for item in items:
                yield _call(func, item, local_resources, kwargs)
            return
        from distributed import as_completed

        _check_before_submit(target, token, func, kwargs)
        call = functools.partial(_call_on_worker, func=func, token=token, kwargs=kwargs)
        futures = target.map(call, items, pure=False)
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            target.cancel([f for f in futures if not f.done()])


def __getattr__(name: str) -> Any:
    """:class:`~.dask_plugins.WorkerEnvPlugin` where ESPnet3's code finds it, also under ESPnet3's name
    ``DictReturnWorkerPlugin`` (runs a ``setup_fn`` once per worker; a ``ValueError`` when it does
    not return a dict), imported on first use (it imports ``distributed``)."""
    if name in ("WorkerEnvPlugin", "DictReturnWorkerPlugin"):
        from espnet3_flows.parallel.dask_plugins import WorkerEnvPlugin

        return WorkerEnvPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
