"""EnvironmentProvider: builds a job's worker resources (model, dataset) once per process or worker;
InferenceProvider: ESPnet3's provider of a ``dataset`` and a ``model`` built from one config.

ESPnet3 calls the dict a provider builds the "env" (``build_env_local``); this package calls it
the worker's resources, keeping "environment" for the OS environment and ``parallel.env`` for
where shards run. ESPnet3's class and method names are kept."""

from __future__ import annotations

import contextlib
import functools
import inspect
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from espnet3_flows.config import to_plain
from espnet3_flows.errors import Espnet3FlowsError
from espnet3_flows.hashing import token


class ProviderError(Espnet3FlowsError, RuntimeError):
    """The provider's resources are unusable (a setup function of the wrong kind, a missing key)."""


class EnvironmentProvider(ABC):
    """Builds the resources a runner's ``forward`` receives, as in ESPnet3 (which calls them its env).

    ``build_env_local()`` returns the resources dict for in-process runs (the driver);
    ``build_worker_setup_fn()`` returns a zero-argument function that a Dask worker runs
    once to build the same dict. The function must not capture ``self``: build it from
    plain config values so it pickles small.

    The engine also accepts providers that do not derive from this class (ESPnet3's own, or
    any object with these two methods); see :func:`provider_token`.

    Args:
        config: The job's configuration (a dataclass, OmegaConf node or mapping).
        params: Extra keyword parameters (e.g. ``{"device": "cuda:0"}``).
    """

    def __init__(self, config: Any, params: Mapping[str, Any] | None = None):
        self.config = config
        self.params = dict(params or {})

    @abstractmethod
    def build_env_local(self) -> dict[str, Any]:
        """Build the resources dict in this process."""

    @abstractmethod
    def build_worker_setup_fn(self) -> Callable[[], dict[str, Any]]:
        """Return a zero-argument function that builds the resources dict on a worker."""

    def env_token(self) -> str:
        """A key identifying these resources: the same config gives the same token on every worker.
        Computed once per provider object (a digest of its whole config: not per shard)."""
        token = self.__dict__.get("_env_token")
        if token is None:
            token = self.__dict__["_env_token"] = _config_token(self)
        return token

    def checked_setup_fn(self) -> Callable[[], dict[str, Any]]:
        """``build_worker_setup_fn()``, checked to be a zero-argument callable (ESPnet3's common mistake)."""
        return checked_setup_fn(self)


class InferenceProvider(EnvironmentProvider):
    """ESPnet3's ``InferenceProvider``: the resources are ``{"dataset": ..., "model": ...,
    **params}``, built by the static ``build_dataset(config)`` and ``build_model(config)`` a
    subclass defines.

    ``build_env_local()`` builds them once per provider and returns a fresh dict each time
    (changing the dict returned changes nothing kept); ``build_worker_setup_fn()`` returns a
    function that builds a new one per call from the config and a snapshot of ``params`` taken
    when it was made. The function does not capture the provider, and a provider travels to
    workers without its locally built resources.

    What differs from ESPnet3 on purpose: the local resources are built on the first
    ``build_env_local()`` call, not in the constructor, so a run on Dask workers never builds the
    model on the driver.
    """

    def __init__(self, config: Any, params: Mapping[str, Any] | None = None):
        super().__init__(config, params)
        self._local_resources: dict[str, Any] | None = None

    @staticmethod
    @abstractmethod
    def build_dataset(config: Any) -> Any:
        """The dataset, from the provider's config."""

    @staticmethod
    @abstractmethod
    def build_model(config: Any) -> Any:
        """The model, from the provider's config."""

    def build_env_local(self) -> dict[str, Any]:
        if self._local_resources is None:
            self._local_resources = self.build_worker_setup_fn()()
        return dict(self._local_resources)

    def build_worker_setup_fn(self) -> Callable[[], dict[str, Any]]:
        return functools.partial(_build_inference_resources, type(self), self.config, dict(self.params))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_local_resources"] = None  # a model built here is never shipped to a worker
        return state


def _build_inference_resources(cls: type[InferenceProvider], config: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    return {"dataset": cls.build_dataset(config), "model": cls.build_model(config), **params}


def _config_token(provider: Any) -> str:
    cls = type(provider)
    return token(None, {"cls": f"{cls.__module__}.{cls.__qualname__}",
                        "config": to_plain(getattr(provider, "config", None)),
                        "params": to_plain(getattr(provider, "params", None))})


def provider_token(provider: Any) -> str:
    """The key of ``provider``'s resources in a process's registry: its ``env_token()`` when it
    has one, else a digest of its class, ``config`` and ``params`` (equal configs share them).
    A provider whose config cannot be digested gets a token of its own, kept on the object (it
    travels with it to the workers)."""
    token = getattr(provider, "env_token", None)
    if callable(token):
        return str(token())
    kept = getattr(provider, "_espnet3_flows_token", None)
    if kept:
        return kept
    try:
        kept = _config_token(provider)
    except (TypeError, ValueError):
        kept = f"{type(provider).__qualname__}-{uuid.uuid4().hex[:16]}"
    with contextlib.suppress(AttributeError):  # slots or a frozen object: recomputed each time (equal for equal configs)
        provider._espnet3_flows_token = kept
    return kept


def checked_setup_fn(provider: Any) -> Callable[[], dict[str, Any]]:
    """``provider.build_worker_setup_fn()``, checked to be a zero-argument callable.

    Raises:
        ProviderError: naming the provider, when it returned the resources dict itself (ESPnet3's common
            mistake: the model would be built on the driver and shipped to every worker), something
            that is not callable, or a function that needs arguments.
    """
    name = type(provider).__name__
    build = getattr(provider, "build_worker_setup_fn", None)
    if not callable(build):
        raise ProviderError(f"{name} has no build_worker_setup_fn(); a provider for Dask workers needs one that "
                            "returns a zero-argument function building the resources dict")
    fn = build()
    if isinstance(fn, Mapping):
        raise ProviderError(
            f"{name}.build_worker_setup_fn() returned a dict; it must return a "
            "zero-argument function that builds the dict on the worker (otherwise the model "
            "would be built on the driver and shipped to every worker)")
    if not callable(fn):
        raise ProviderError(f"{name}.build_worker_setup_fn() returned {type(fn).__name__}, not a zero-argument function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    required = [p.name for p in sig.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ProviderError(
            f"{name}.build_worker_setup_fn() returned a function that needs arguments {required}; it must take none")
    return fn


def check_resources(resources: Any, who: str) -> dict[str, Any]:
    """Check that a provider's resources are a dict with string keys."""
    if not isinstance(resources, dict) or not all(isinstance(k, str) for k in resources):
        raise ProviderError(f"{who} must return a dict with string keys, got {type(resources).__name__}")
    return resources
