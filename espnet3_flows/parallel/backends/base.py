"""What a ``parallel.env`` is, as classes.

A :class:`Placement` is where a run's shards go. Two are run modes, not clusters: this process
(:class:`~.serial.InThisProcess`) and a cluster someone else runs
(:class:`~.address.RunningCluster`). Every other env is a :class:`Backend`: a Dask cluster the
run starts and closes. A backend knows how to make its cluster (its class or factory, the
defaults it fills, how ``n_workers`` becomes workers), how to describe it, how to give its
workers the run's environment, and how many shards it computes at once. Every placement gives
the engine its Dask client (:meth:`Placement.connect`) and the flows their ``DaskTaskRunner``'s
options (:meth:`Placement.dask_runner_options`) on the same cluster, so neither asks which env it
got. Each built-in backend is one module of this package, read by ``docs/configuration.md``'s table.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar
from collections.abc import Iterator

from espnet3_flows.config import ConfigError, did_you_mean
from espnet3_flows.parallel.backends.named_objects import keywords_of, module_of, extra_hint, import_object
from espnet3_flows.parallel.backends.own_options import own_option_names, read_own_options

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings, Settings


class Placement:
    """One ``parallel.env``: where a run's shards go.

    Args:
        name: The env's name.
        doc: One sentence for the generated table of envs (``docs/configuration.md``).
    """

    #: Whether the run starts (and closes) a cluster of its own
    owns_cluster: ClassVar[bool] = False
    #: Whether the run uses a cluster someone else runs and leaves it running: what the run
    #: registered on its workers is removed when it ends
    leaves_running: ClassVar[bool] = False
    #: Whether shards run in processes of their own (Dask workers), which report to a Prefect API:
    #: a run with no server configured then starts its private one
    uses_workers: ClassVar[bool] = True
    #: Whether its workers' output is this terminal (a process of this machine, or this one)
    output_here: ClassVar[bool] = False
    #: The dataclass of its own typed options, read from ``parallel.options`` and not passed to a
    #: cluster (:mod:`~.own_options`); ``None``: it has none
    own_options: ClassVar[type | None] = None

    def __init__(self, name: str, *, doc: str = "") -> None:
        self.name, self.doc = name, doc

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def check_config(self, cfg: ParallelSettings) -> None:
        """Raise :class:`ConfigError` for a ``parallel`` section this env cannot run (called when the
        config is read). By default: its own options are read, a running scheduler's refused."""
        self.options_of(cfg)
        for key in ("address", "scheduler_file"):
            if cfg.options.get(key) and key not in own_option_names(self.own_options):
                raise ConfigError(f"parallel.options.{key} names a running scheduler, used only with "
                                  f"parallel.env=address (parallel.env is {cfg.env!r})")

    def options_of(self, cfg: ParallelSettings) -> Any:
        """Its own options (an instance of :attr:`own_options`, typed and checked) as ``cfg``'s
        ``parallel.options`` sets them; ``None`` for a placement without any."""
        return None if self.own_options is None else read_own_options(self.own_options, cfg.options, self.name)

    def cluster_options(self, cfg: ParallelSettings) -> dict[str, Any]:
        """``cfg``'s ``parallel.options`` less its own: what its cluster is called with."""
        return {k: v for k, v in cfg.options.items() if k not in own_option_names(self.own_options)}

    def check_installed(self) -> None:
        """A :class:`ConfigError` naming the extra when a package the env needs is missing."""

    def describe(self, cfg: ParallelSettings) -> str:
        """One line: where a run of ``cfg`` puts its shards (``--dry-run`` prints it)."""
        return f"{self.name}: {self.doc}"

    def worker_slots(self, cfg: ParallelSettings) -> int:
        """How many shards ``cfg``'s run computes at once, as far as the config tells (1 when it
        cannot know)."""
        return 1

    def forks_workers(self, cfg: ParallelSettings) -> bool:
        """Whether ``cfg``'s workers are forked from this project's forkserver (none are, but a
        local cluster's: :class:`~.local.LocalProcesses`)."""
        return False

    def runs_here(self, cfg: ParallelSettings, pending_shards: int) -> bool:
        """Whether a run with ``pending_shards`` shards to compute runs them in this process."""
        return False

    def with_worker_environ(self, cfg: Settings, variables: dict[str, str]) -> Settings:
        """``cfg`` with ``variables`` in its workers' OS environment; unchanged where the workers
        inherit this process's environment (or were started by someone else). A plugin written
        for the hook's earlier name, ``with_worker_env``, is still asked under that name."""
        if type(self).with_worker_env is not Placement.with_worker_env:
            return self.with_worker_env(cfg, variables)
        return cfg

    def with_worker_env(self, cfg: Settings, variables: dict[str, str]) -> Settings:
        """:meth:`with_worker_environ`'s earlier name: an override of it is still asked."""
        return cfg

    # ---- the cluster a run uses: the engine's client, the flows' task runner -----------------
    def connect(self, cfg: ParallelSettings) -> Any:
        """A ``distributed.Client`` on the cluster a run of ``cfg`` uses (the engine's
        :func:`~espnet3_flows.parallel.parallel.build_client`); a :class:`ConfigError` with none."""
        raise ConfigError(f"parallel.env={self.name} has no Dask cluster: there is no client to build")

    def dask_runner_options(self, cfg: ParallelSettings) -> dict[str, Any]:
        """Keyword arguments of prefect-dask's ``DaskTaskRunner`` on that same cluster (the flows'
        task runner), checked now; a :class:`ConfigError` with none, or options it cannot run."""
        raise ConfigError(f"parallel.env={self.name} has no Dask cluster for a DaskTaskRunner")

    def prepare(self, client: Any, cfg: ParallelSettings) -> None:
        """Make ready a client of that cluster before shards go to it (nothing, here)."""

    def spec(self, cfg: ParallelSettings) -> ClusterSpec:
        """The cluster a run of ``cfg`` starts; a :class:`ConfigError` for an env that starts none."""
        raise ConfigError(f"parallel.env={self.name}: no cluster to build ({self.describe(cfg)})")

    def make_cluster(self, cfg: ParallelSettings) -> Any:
        """Start that cluster (:meth:`Backend.make_cluster`); here :meth:`spec`'s error: there is none."""
        return self.spec(cfg)  # raises

    def scheduler_address(self, cfg: ParallelSettings) -> str:
        """The running scheduler a run of ``cfg`` connects to; a :class:`ConfigError` for an env with none."""
        raise ConfigError(f"parallel.env={self.name} has no running scheduler to connect to; use parallel.env=address")

    def table_row(self) -> list[str]:
        """Its row of the generated table of envs (Markdown cells): ``env``, what it is, its
        cluster, what ``n_workers`` counts, the options it needs, its extra."""
        return [f"``{self.name}``", self.doc or "—", "none", "—", "—", "—"]


@dataclass(frozen=True)
class ClusterSpec:
    """A resolved cluster: its backend, class or factory, keyword arguments, workers, adaptivity.

    Attributes:
        backend: The backend.
        class_path: The cluster class or factory.
        kwargs: Its keyword arguments (``options``, the backend's defaults and the worker settings).
        n_workers: Workers to scale to after construction (scaled backends), else as given.
        adapt: Adaptive scaling bounds (scaled backends).
    """

    backend: Backend
    class_path: str
    kwargs: dict[str, Any]
    n_workers: int
    adapt: dict[str, Any]

    def describe(self) -> str:
        """One line: the backend, its cluster and options (credentials masked), how it scales."""
        from espnet3_flows.credentials import redact

        shown = json.dumps(redact(self.backend.shown_kwargs(self.kwargs)), default=str, sort_keys=True)
        return f"{self.backend.name}: {self.class_path}({shown}){self.backend.describe_scaling(self)}"


class Backend(Placement):
    """A Dask cluster a run starts and closes: its class or factory, called with
    ``parallel.options``, the backend's defaults, and ``n_workers`` as a constructor argument
    (subclasses scale it after construction, or spread it over hosts).

    Args:
        name: The env's name.
        cluster: ``"module.Attr"`` (or ``module:Attr``) of the cluster class or factory.
        doc: One sentence for the generated table of envs.
        extra: The pip extra that installs its package (named when the import fails).
        requires: A module its cluster needs (checked when the config is, naming ``extra``).
        required: Options that must be given.
        also_accepts: ``"module.Attr"`` of a class whose constructor takes the options a factory
            passes on through ``**kwargs`` (``SSHCluster`` → ``SpecCluster``).
    """

    owns_cluster = True
    #: What ``n_workers`` counts, for the generated table
    counts: ClassVar[str] = "workers, started with the cluster"
    #: Seconds a shard waits on a cluster with no worker at all before it fails (``None``: Dask's)
    no_workers_timeout: ClassVar[float | None] = None

    def __init__(self, name: str, cluster: str, *, doc: str = "", extra: str = "", requires: str = "",
                 required: tuple[str, ...] = (), also_accepts: str = "") -> None:
        super().__init__(name, doc=doc)
        self.cluster, self.extra, self.requires = cluster, extra, requires
        self.required, self.also_accepts = tuple(required), also_accepts

    # ---- the config -------------------------------------------------------------------------
    def check_config(self, cfg: ParallelSettings) -> None:
        """The options are checked now, not on the cluster (which imports its class)."""
        super().check_config(cfg)
        if self.cluster_options(cfg) or self.required or type(self).check is not Backend.check:
            self.spec(cfg)
        else:
            self.check_installed()

    def defaults(self, cfg: ParallelSettings) -> dict[str, Any]:
        """The options it fills where ``parallel.options`` has none."""
        return {}

    def check(self, cfg: ParallelSettings) -> None:
        """Further checks of the options (raise :class:`ConfigError`)."""

    def check_installed(self) -> None:
        """A :class:`ConfigError` naming the extra when the cluster's package (or ``requires``) is
        not installed; found without importing it (a config is checked before any import)."""
        for module in filter(None, (self.requires, module_of(self.cluster))):
            try:
                found = importlib.util.find_spec(module) is not None
            except ImportError:  # a parent package missing
                found = False
            if not found:
                raise ConfigError(f"parallel.env={self.name} needs {module}, which is not installed"
                                  f"{extra_hint(self.extra)}")

    def load(self) -> Any:
        """The cluster class or factory (:class:`ConfigError` naming the extra when it is missing)."""
        if self.requires:
            try:
                importlib.import_module(self.requires)
            except ImportError as exc:
                raise ConfigError(f"parallel.env={self.name} needs {self.requires}, which cannot be imported: "
                                  f"{exc}{extra_hint(self.extra)}") from None
        return import_object(self.cluster, f"parallel.env={self.name}", self.extra)

    def accepted_options(self, factory: Any) -> set[str] | None:
        """The keyword arguments ``factory`` takes, ``None`` when it takes any: a class's
        constructors along its MRO (and its job class's, for dask-jobqueue), a function's
        parameters (with those of ``also_accepts`` where it passes ``**kwargs`` on)."""
        if inspect.isclass(factory):
            classes = list(inspect.getmro(factory))
            job_cls = getattr(factory, "job_cls", None)
            if job_cls is not None:
                classes += list(inspect.getmro(job_cls))
            classes += self.worker_classes()
            inits = [c.__dict__["__init__"] for c in classes if "__init__" in c.__dict__]
        else:
            names, open_ended = keywords_of(factory)
            if open_ended and not self.also_accepts:
                return None
            inits = [factory] + ([import_object(self.also_accepts, f"parallel.env={self.name}").__init__]
                                 if open_ended else [])
        accepted: set[str] = set()
        for init in inits:
            accepted |= keywords_of(init)[0]
        accepted.discard("self")
        return accepted or None

    def worker_classes(self) -> list[type]:
        """Classes whose constructors also take the cluster's options (a local cluster passes
        its nanny's and worker's on)."""
        return []

    def check_options(self, cfg: ParallelSettings, factory: Any) -> None:
        """Unknown option names (with the closest valid one) and missing required ones are errors
        now, not on the cluster."""
        accepted = self.accepted_options(factory)
        if accepted is not None:
            for key in self.cluster_options(cfg):
                if key not in accepted:
                    raise ConfigError(f"parallel.options.{key}: not an option of {self.cluster}"
                                      f"{did_you_mean(key, sorted(accepted))}")
        for key in self.required:
            if key not in cfg.options:
                raise ConfigError(f"parallel.env={self.name} needs parallel.options.{key}")
        self.check(cfg)

    # ---- the cluster ------------------------------------------------------------------------
    def spec(self, cfg: ParallelSettings) -> ClusterSpec:
        """``cfg`` resolved to this backend's cluster and checked keyword arguments.

        Raises:
            ConfigError: an unknown option name (with the closest valid one), a missing required
                one, or a cluster package that is not installed (naming its extra).
        """
        self.check_options(cfg, self.load())
        kwargs = self.cluster_options(cfg)
        for key, value in self.defaults(cfg).items():
            kwargs.setdefault(key, value)
        n_workers, adapt = self.place_workers(cfg, kwargs)
        return ClusterSpec(self, self.cluster, kwargs, n_workers, adapt)

    def place_workers(self, cfg: ParallelSettings, kwargs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Turn ``n_workers`` into workers: here a constructor argument. Returns (workers to
        scale to after construction, adaptive bounds); ``kwargs`` is updated in place."""
        if cfg.n_workers:
            kwargs.setdefault("n_workers", cfg.n_workers)
        return cfg.n_workers, {}

    def make_cluster(self, cfg: ParallelSettings) -> Any:
        """Start the cluster ``cfg`` describes (:meth:`start`, with the worker settings of
        :func:`~.cluster_setup.worker_settings`). Also the ``cluster_class`` of the flows'
        ``DaskTaskRunner`` (:meth:`dask_runner_options`), called with ``cfg``.

        Raises:
            UnguardedMainError: when this script starts the cluster when it is imported (its workers,
                or their forkserver, import it: :mod:`~espnet3_flows.parallel.main_guard`), in one
                line naming the fix.
        """
        from espnet3_flows.parallel.backends.cluster_setup import worker_settings
        from espnet3_flows.parallel.main_guard import refuse_while_importing_main

        refuse_while_importing_main("a Dask cluster")
        spec = self.spec(cfg)
        with worker_settings(self.trims_worker_memory(cfg)):
            return self.start(spec, cfg)

    def trims_worker_memory(self, cfg: ParallelSettings) -> bool:
        """Whether its workers keep Dask's malloc trimming (:class:`~.cluster_setup.WorkerMemory`)."""
        return bool(getattr(self.options_of(cfg), "trim_worker_memory", False))

    def connect(self, cfg: ParallelSettings) -> Any:
        """A client on a new cluster of ``cfg``, made ready (:meth:`prepare`); the caller closes
        both (``client.close(); client.cluster.close()``)."""
        from distributed import Client

        cluster = self.make_cluster(cfg)
        try:
            client = Client(cluster)
            self.prepare(client, cfg)
            return client
        except BaseException:
            cluster.close()
            raise

    def dask_runner_options(self, cfg: ParallelSettings) -> dict[str, Any]:
        """The runner starts this cluster when its client is first used, and closes it with the flow."""
        self.spec(cfg)  # the options are checked now, not when the cluster starts inside the flow
        return {"cluster_class": self.make_cluster, "cluster_kwargs": {"cfg": cfg}}

    def prepare(self, client: Any, cfg: ParallelSettings) -> None:
        """This project's scheduler settings (:class:`~espnet3_flows.parallel.dask_plugins.ClusterSettings`),
        and a check that every worker can import this project.

        Raises:
            ConfigError: naming the workers (host and address) where ``espnet3_flows`` is not importable.
        """
        from espnet3_flows.parallel.backends.cluster_setup import check_workers_import
        from espnet3_flows.parallel.dask_plugins import ClusterSettings

        client.register_plugin(ClusterSettings(cfg.allowed_failures, no_workers_timeout=self.no_workers_timeout))
        check_workers_import(client)

    def start(self, spec: ClusterSpec, cfg: ParallelSettings) -> Any:
        """Start the cluster of ``spec`` (inside :func:`~..cluster.worker_settings`): its class or
        factory called with the keyword arguments :meth:`starting` gives, then :meth:`started`."""
        factory = self.load()
        with self.starting(spec, cfg) as kwargs:
            cluster = factory(**kwargs)
            self.started(cluster, spec)
        return cluster

    @contextlib.contextmanager
    def starting(self, spec: ClusterSpec, cfg: ParallelSettings) -> Iterator[dict[str, Any]]:
        """The block in which the cluster is made, yielding its keyword arguments: any local
        worker processes are spawned (nothing of this process is inherited but its environment)."""
        from espnet3_flows.parallel.forkserver import worker_start_method

        with worker_start_method("spawn"):
            yield spec.kwargs

    def started(self, cluster: Any, spec: ClusterSpec) -> None:
        """Called on the new cluster, still inside :meth:`starting` (scaled backends scale it)."""

    def shown_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments :meth:`ClusterSpec.describe` prints."""
        return kwargs

    def describe_scaling(self, spec: ClusterSpec) -> str:
        """How the cluster scales, appended to its description (nothing: it starts its workers)."""
        return ""

    def describe(self, cfg: ParallelSettings) -> str:
        return self.spec(cfg).describe()

    def worker_slots(self, cfg: ParallelSettings) -> int:
        """Its workers (``n_workers``, ``adapt.maximum`` when larger, or what 0 means for the
        backend: :meth:`default_workers`) times the threads of each."""
        threads = max(1, int(cfg.options.get("threads_per_worker") or cfg.threads_per_worker))
        workers = int(cfg.options.get("n_workers") or cfg.n_workers or 0) or self.default_workers()
        return max(workers, 1, int(cfg.adapt.get("maximum") or 0)) * threads

    def default_workers(self) -> int:
        """How many workers ``n_workers: 0`` starts, where this process can tell (0: it cannot)."""
        return 0

    def table_row(self) -> list[str]:
        needs = ", ".join(f"``options.{k}``" for k in self.required) or "—"
        extra = f"``[{self.extra}]``" if self.extra else "—"
        return [f"``{self.name}``", self.doc or "—", f"``{self.cluster}``", self.counts, needs, extra]
