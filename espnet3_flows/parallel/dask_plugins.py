"""The Dask plugins this project installs on a cluster: on its workers, a provider's resources
(:class:`EnvSetupPlugin`), a runner (:class:`RunnerPlugin`) and a ``setup_fn``'s resources
(:class:`WorkerEnvPlugin`); on its scheduler, the cluster's settings (:class:`ClusterSettings`);
and installing runners on a cluster's workers (:func:`install_runners`).

The only module of the engine that imports ``distributed`` at its top: it is imported where a
cluster is used, so a run in this process (``serial``, or a ``local`` run of few shards) never
pays for importing Dask's distributed scheduler (~0.5 s here).
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any
from collections.abc import Callable, Mapping

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from espnet3_flows.parallel.env_provider import EnvironmentProvider, checked_setup_fn, provider_token
from espnet3_flows.parallel.worker_registry import (
    build_setup_resources,
    drop_resources,
    ensure_resources,
    get_runner,
    keep_resources,
    register_runner,
    worker_resources,
)

#: Messages Dask's scheduler keeps per worker stream (and transitions in its log) for debugging;
#: Dask's default is 1,000 (see :class:`ClusterSettings`)
LOW_LEVEL_LOG_LENGTH = 16


class EnvSetupPlugin(WorkerPlugin):
    """Builds a provider's resources once per Dask worker, at worker start, into the worker's
    registry (:mod:`.worker_registry`).

    Args:
        token: The provider's :meth:`~.env_provider.EnvironmentProvider.env_token`.
        setup_fn: The provider's zero-argument setup function.
    """

    def __init__(self, token: str, setup_fn: Callable[[], dict[str, Any]]):
        self.token = token
        self.setup_fn = setup_fn
        self.name = f"espnet3-resources-{token}"

    def setup(self, worker: Any) -> None:  # Dask hook
        ensure_resources(self.token, self.setup_fn)

    def teardown(self, worker: Any) -> None:  # Dask hook
        drop_resources(self.token)


class RunnerPlugin(WorkerPlugin):
    """Installs a runner (a split's job: config, provider, outputs) once per Dask worker and builds its
    resources, so shard tasks name the runner by key instead of carrying it. Registering the same
    runner again (a later run on a long-lived cluster) is skipped by its name; see
    :func:`install_runners`."""

    def __init__(self, key: str, runner: Any):
        self.key = key
        self.runner = runner
        self.name = f"espnet3-runner-{key}"

    def setup(self, worker: Any) -> None:  # Dask hook
        register_runner(self.key, self.runner)
        worker_resources(self.runner.provider)


class WorkerEnvPlugin(WorkerPlugin):
    """Runs a ``setup_fn`` once per worker (present and joining later) and keeps the dict it
    returns as that worker's resources for :func:`~.parallel.parallel_map` / :func:`~.parallel.parallel_for`.

    Args:
        setup_fn: A zero-argument function returning a dict.
        token: The resources' key on the workers (a fresh one by default).
    """

    def __init__(self, setup_fn: Callable[[], Mapping[str, Any]], token: str | None = None):
        if not callable(setup_fn):
            raise ValueError(f"setup_fn must be a zero-argument function returning a dict, got {type(setup_fn).__name__}")
        self.setup_fn = setup_fn
        self.token = token or f"setup-{uuid.uuid4().hex}"
        self.name = f"espnet3-{self.token}"

    def setup(self, worker: Any = None) -> None:  # Dask hook
        keep_resources(self.token, build_setup_resources(self.setup_fn))

    def teardown(self, worker: Any = None) -> None:  # Dask hook
        drop_resources(self.token)


def plugin_for(provider: EnvironmentProvider) -> EnvSetupPlugin:
    """The worker plugin (:class:`EnvSetupPlugin`) that builds ``provider``'s
    resources (its setup function is checked now)."""
    return EnvSetupPlugin(provider_token(provider), checked_setup_fn(provider))


def install_runners(client: Any, runners: dict[str, Any]) -> dict[str, list[str]]:
    """Install runners on every worker of ``client`` (present and later ones), once per cluster:
    a runner already installed (same key: same config and outputs) is not sent or built again.

    Returns:
        Runner key → the names of its resources on a worker (building them there raises
        here, naming the provider, before any shard runs).
    """
    installed = installed_plugins(client)
    for key, runner in runners.items():
        plugin = RunnerPlugin(key, runner)
        if plugin.name not in installed:
            client.register_plugin(plugin)
    return {key: client.submit(_runner_resource_keys, key, pure=False).result() for key in runners}


def uninstall_runners(client: Any, keys: list[str]) -> None:
    """Remove the runners' plugins from a long-lived cluster's scheduler after a run, so its plugin
    list (replayed on every worker that joins) does not grow run after run. Workers keep their
    runners and resources in the bounded registries of :mod:`.worker_registry`: the next run with the same
    key builds nothing again."""
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


def _runner_resource_keys(key: str) -> list[str]:
    return sorted(worker_resources(get_runner(key).provider))


class ClusterSettings(SchedulerPlugin):
    """This project's scheduler settings, for one cluster's scheduler only (wherever it runs):
    how often a task may lose its worker (``parallel.allowed_failures``), how long a task may wait
    with no worker at all before it fails (when Dask's own ``no-workers-timeout`` is unset), and
    short developer logs
    (:data:`LOW_LEVEL_LOG_LENGTH`): each of the scheduler's streams to a worker keeps its last
    1,000 messages by default, and every ``compute-task`` message holds a whole Prefect task run
    spec (~100 KB deserialized), so a run of thousands of shards kept ~100 MB per worker on the
    driver for the rest of the flow.

    Args:
        allowed_failures: The scheduler's ``allowed_failures``.
        no_workers_timeout: Seconds, or None to leave the scheduler's own setting.
        log_length: Messages kept per worker stream, transitions in the log.
    """

    name = "espnet3-cluster-settings"

    def __init__(self, allowed_failures: int, no_workers_timeout: float | None = None,
                 log_length: int = LOW_LEVEL_LOG_LENGTH):
        self.allowed_failures = allowed_failures
        self.no_workers_timeout = no_workers_timeout
        self.log_length = log_length

    async def start(self, scheduler: Any) -> None:  # Dask hook
        scheduler.allowed_failures = self.allowed_failures
        if self.no_workers_timeout is not None and scheduler.no_workers_timeout is None:
            scheduler.no_workers_timeout = self.no_workers_timeout
        scheduler.transition_log = deque(scheduler.transition_log, maxlen=self.log_length)
        for worker in list(scheduler.stream_comms):
            self._shorten(scheduler, worker)

    def add_worker(self, scheduler: Any, worker: str) -> None:  # Dask hook
        self._shorten(scheduler, worker)

    def _shorten(self, scheduler: Any, worker: str) -> None:
        stream = scheduler.stream_comms.get(worker)
        if stream is not None:
            stream.recent_message_log = deque(stream.recent_message_log, maxlen=self.log_length)
