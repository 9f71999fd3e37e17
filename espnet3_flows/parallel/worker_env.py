"""Per-process registry of built environments, and the Dask worker plugin that fills it."""

from __future__ import annotations

import threading
from typing import Any, Callable

from distributed.diagnostics.plugin import WorkerPlugin

from espnet3_flows.parallel.provider import EnvironmentProvider, check_env

_ENVS: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()


def get_env(provider: EnvironmentProvider, local: bool = False) -> dict[str, Any]:
    """The provider's environment in this process, built on first use and then reused.

    On a Dask worker the :class:`EnvSetupPlugin` usually built it already at worker start;
    otherwise (e.g. a worker that joined later, or a Prefect task runner) it is built here
    once, from ``build_worker_setup_fn()``. ``local=True`` builds with ``build_env_local()``.
    """
    token = provider.env_token()
    env = _ENVS.get(token)
    if env is not None:
        return env
    with _LOCK:
        env = _ENVS.get(token)
        if env is None:
            if local:
                env = check_env(provider.build_env_local(), f"{type(provider).__name__}.build_env_local()")
            else:
                fn = provider.checked_setup_fn()
                env = check_env(fn(), f"the setup function of {type(provider).__name__}")
            _ENVS[token] = env
    return env


def env_keys(provider: EnvironmentProvider) -> list[str]:
    """Keys of the provider's environment in this process (builds it if needed)."""
    return sorted(get_env(provider))


def clear_envs() -> None:
    """Forget every environment built in this process (tests, or to free a model)."""
    with _LOCK:
        _ENVS.clear()


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
                _ENVS[self.token] = check_env(self.setup_fn(), "worker setup function")

    def teardown(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        with _LOCK:
            _ENVS.pop(self.token, None)


def plugin_for(provider: EnvironmentProvider) -> EnvSetupPlugin:
    """The worker plugin that builds ``provider``'s environment (its setup function is checked now)."""
    return EnvSetupPlugin(provider.env_token(), provider.checked_setup_fn())
