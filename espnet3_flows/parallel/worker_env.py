"""Per-process registry of built environments, and the Dask worker plugin that fills it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

from distributed.diagnostics.plugin import WorkerPlugin

from espnet3_flows.parallel.env_provider import EnvironmentProvider, check_env, checked_setup_fn, provider_token
from espnet3_flows.sharding import digest

#: Most environments (models) a process keeps, and most runners (small: config and plan options):
#: a long-lived worker that serves runs with other configs drops the least recently used
#: instead of growing without bound.
MAX_ENVS = 4
MAX_RUNNERS = 64

_ENVS: OrderedDict[str, dict[str, Any]] = OrderedDict()
_RUNNERS: OrderedDict[str, Any] = OrderedDict()
_LOCK = threading.RLock()


def _keep(registry: OrderedDict[str, Any], key: str, value: Any) -> None:
    registry[key] = value
    registry.move_to_end(key)
    while len(registry) > (MAX_ENVS if registry is _ENVS else MAX_RUNNERS):
        registry.popitem(last=False)


def get_env(provider: EnvironmentProvider, local: bool = False) -> dict[str, Any]:
    """The provider's environment in this process, built on first use and then reused.

    On a Dask worker the :class:`EnvSetupPlugin` usually built it already at worker start;
    otherwise (e.g. a worker that joined later, or a Prefect task runner) it is built here
    once, from ``build_worker_setup_fn()``. ``local=True`` builds with ``build_env_local()`` (an
    in-process run, as ESPnet3's local runs do), kept apart from the worker-built one.
    """
    token = provider_token(provider) + (":local" if local else "")
    env = _ENVS.get(token)
    if env is not None:
        return env
    with _LOCK:
        env = _ENVS.get(token)
        if env is None:
            if local:
                env = check_env(provider.build_env_local(), f"{type(provider).__name__}.build_env_local()")
            else:
                env = check_env(checked_setup_fn(provider)(), f"the setup function of {type(provider).__name__}")
            _keep(_ENVS, token, env)
    return env


def keep_env(token: str, env: dict[str, Any]) -> None:
    """Keep ``env`` in this process's registry under ``token`` (a ``setup_fn``'s env on a worker)."""
    with _LOCK:
        _keep(_ENVS, token, env)


def drop_env(token: str) -> None:
    """Forget the env kept under ``token``."""
    with _LOCK:
        _ENVS.pop(token, None)


def lookup_env(token: str) -> dict[str, Any]:
    """The env kept under ``token`` in this process (:func:`keep_env`).

    Raises:
        LookupError: when this process has none (its worker plugin did not run here).
    """
    env = _recent(_ENVS, token)
    if env is None:
        raise LookupError(f"no env {token} in this process: the setup_fn's worker plugin did not run on this worker "
                          "(was it restarted without its plugins?)")
    return env


def _recent(registry: OrderedDict[str, Any], key: str) -> Any:
    """The entry under ``key`` (now the most recently used), or ``None``."""
    with _LOCK:
        value = registry.get(key)
        if value is not None:
            registry.move_to_end(key)
    return value


def env_keys(provider: EnvironmentProvider) -> list[str]:
    """Keys of the provider's environment in this process (builds it if needed)."""
    return sorted(get_env(provider))


class EnvSetupPlugin(WorkerPlugin):
    """Builds an environment once per Dask worker, at worker start, into the registry.

    Args:
        token: The provider's :meth:`~EnvironmentProvider.env_token`.
        setup_fn: The provider's zero-argument setup function.
    """

    def __init__(self, token: str, setup_fn: Callable[[], dict[str, Any]]):
        self.token = token
        self.setup_fn = setup_fn
        self.name = f"espnet3-env-{token}"

    def setup(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        with _LOCK:
            if self.token not in _ENVS:
                _keep(_ENVS, self.token, check_env(self.setup_fn(), "worker setup function"))

    def teardown(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        with _LOCK:
            _ENVS.pop(self.token, None)


def plugin_for(provider: EnvironmentProvider) -> EnvSetupPlugin:
    """The worker plugin that builds ``provider``'s environment (its setup function is checked now)."""
    return EnvSetupPlugin(provider_token(provider), checked_setup_fn(provider))


def runner_key(runner: Any) -> str:
    """A key naming a runner's work: its class, environment, output location and shard options."""
    store = runner.storage
    return digest({"cls": f"{type(runner).__module__}.{type(runner).__qualname__}",
                   "env": provider_token(runner.provider), "output": store.uri() if store else None,
                   "subdir": runner.shard_subdir, "on_error": runner.on_error, "batch_size": runner.batch_size,
                   "config": runner.hash_config()})[:24]


def register_runner(key: str, runner: Any) -> None:
    """Make ``runner`` available in this process under ``key`` (see :func:`get_runner`)."""
    with _LOCK:
        _keep(_RUNNERS, key, runner)


def get_runner(key: str) -> Any:
    """The runner registered under ``key`` in this process (by :class:`RunnerPlugin` on a worker)."""
    runner = _recent(_RUNNERS, key)
    if runner is None:
        raise LookupError(f"no runner {key} in this process: the flow installs runners on its workers before "
                          "submitting shards (was this worker restarted without its plugins?)")
    return runner


class RunnerPlugin(WorkerPlugin):
    """Installs a runner (a split's job: config, provider, outputs) once per Dask worker and builds its
    environment, so shard tasks name the runner by key instead of carrying it. Registering the same
    runner again (a later run on a long-lived cluster) is skipped by its name; see :func:`install_runners`."""

    def __init__(self, key: str, runner: Any):
        self.key = key
        self.runner = runner
        self.name = f"espnet3-runner-{key}"

    def setup(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        register_runner(self.key, self.runner)
        get_env(self.runner.provider)


def install_runners(client: Any, runners: dict[str, Any]) -> dict[str, list[str]]:
    """Install runners on every worker of ``client`` (present and later ones), once per cluster:
    a runner already installed (same key: same config and outputs) is not sent or built again.

    Returns:
        Runner key → the env keys of its environment on a worker (building it there raises
        here, naming the provider, before any shard runs).
    """
    installed = installed_plugins(client)
    for key, runner in runners.items():
        plugin = RunnerPlugin(key, runner)
        if plugin.name not in installed:
            client.register_plugin(plugin)
    return {key: client.submit(_runner_env_keys, key, pure=False).result() for key in runners}


def uninstall_runners(client: Any, keys: list[str]) -> None:
    """Remove the runners' plugins from a long-lived cluster's scheduler after a run, so its plugin
    list (replayed on every worker that joins) does not grow run after run. Workers keep their
    runners and envs in the bounded registries above: the next run with the same key builds
    nothing again."""
    installed = installed_plugins(client)
    for key in keys:
        name = f"espnet3-runner-{key}"
        if name in installed:
            client.unregister_worker_plugin(name)


def installed_plugins(client: Any) -> set[str]:
    """Names of the worker plugins the cluster's scheduler holds (it replays them on every worker
    that joins): registering one of them again would tear it down and set it up anew."""
    return set(client.run_on_scheduler(_scheduler_plugins))


def _scheduler_plugins(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.worker_plugins)


def _runner_env_keys(key: str) -> list[str]:
    return sorted(get_env(get_runner(key).provider))
