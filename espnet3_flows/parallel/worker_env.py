"""Per-process registry of built environments and installed runners (filled on Dask workers by the
plugins of :mod:`.dask_plugins`, in this process by an in-process run)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any
from collections.abc import Callable, Mapping

from espnet3_flows.parallel.env_provider import EnvironmentProvider, check_env, checked_setup_fn, provider_token
from espnet3_flows.hashing import token

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

    On a Dask worker the :class:`~.dask_plugins.EnvSetupPlugin` usually built it already at worker start;
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


def ensure_env(token: str, setup_fn: Callable[[], Any], what: str = "worker setup function") -> None:
    """Build and keep the env under ``token`` with ``setup_fn`` unless this process has it."""
    with _LOCK:
        if token not in _ENVS:
            _keep(_ENVS, token, check_env(setup_fn(), what))


def build_setup_env(setup_fn: Callable[[], Any]) -> dict[str, Any]:
    """Run a ``setup_fn`` (the parallel API's) and check what it returned: a dict with string keys,
    else a ``ValueError``."""
    env = setup_fn()
    if not isinstance(env, Mapping) or not all(isinstance(k, str) for k in env):
        raise ValueError(f"setup_fn must return a dict of env entries (name -> object), got {type(env).__name__}")
    return dict(env)


def runner_key(runner: Any) -> str:
    """A key naming a runner's work: its class, environment, output location and shard options."""
    store = runner.storage
    return token(None, {"cls": f"{type(runner).__module__}.{type(runner).__qualname__}",
                        "env": provider_token(runner.provider), "output": store.uri() if store else None,
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
