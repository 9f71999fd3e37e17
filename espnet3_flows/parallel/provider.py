"""EnvironmentProvider: builds a job's environment (model, dataset) once per process or worker."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping

from espnet3_flows.config import to_plain
from espnet3_flows.errors import Espnet3FlowsError
from espnet3_flows.sharding import digest


class ProviderError(Espnet3FlowsError, RuntimeError):
    """The provider's environment is unusable (a setup function of the wrong kind, a missing key)."""


class EnvironmentProvider(ABC):
    """Builds the environment a runner's ``forward`` receives, as in ESPnet3.

    ``build_env_local()`` returns the env dict for in-process runs (the driver);
    ``build_worker_setup_fn()`` returns a zero-argument function that a Dask worker runs
    once to build the same dict. The function must not capture ``self``: build it from
    plain config values so it pickles small.

    Args:
        config: The job's configuration (a dataclass, OmegaConf node or mapping).
        params: Extra keyword parameters (e.g. ``{"device": "cuda:0"}``).
    """

    def __init__(self, config: Any, params: Mapping[str, Any] | None = None):
        self.config = config
        self.params = dict(params or {})

    @abstractmethod
    def build_env_local(self) -> dict[str, Any]:
        """Build the env dict in this process."""

    @abstractmethod
    def build_worker_setup_fn(self) -> Callable[[], dict[str, Any]]:
        """Return a zero-argument function that builds the env dict on a worker."""

    def env_token(self) -> str:
        """A key identifying this environment: the same config gives the same token on every worker."""
        cls = type(self)
        return digest({"cls": f"{cls.__module__}.{cls.__qualname__}",
                       "config": to_plain(self.config), "params": to_plain(self.params)})[:24]

    def checked_setup_fn(self) -> Callable[[], dict[str, Any]]:
        """``build_worker_setup_fn()``, checked to be a zero-argument callable (ESPnet3's common mistake)."""
        fn = self.build_worker_setup_fn()
        if isinstance(fn, Mapping):
            raise ProviderError(
                f"{type(self).__name__}.build_worker_setup_fn() returned a dict; it must return a "
                "zero-argument function that builds the dict on the worker (otherwise the model "
                "would be built on the driver and shipped to every worker)")
        if not callable(fn):
            raise ProviderError(
                f"{type(self).__name__}.build_worker_setup_fn() returned {type(fn).__name__}, "
                "not a zero-argument function")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return fn
        required = [p.name for p in sig.parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if required:
            raise ProviderError(
                f"{type(self).__name__}.build_worker_setup_fn() returned a function that needs "
                f"arguments {required}; it must take none")
        return fn


def check_env(env: Any, who: str) -> dict[str, Any]:
    """Check that an environment is a dict with string keys."""
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise ProviderError(f"{who} must return a dict with string keys, got {type(env).__name__}")
    return env
