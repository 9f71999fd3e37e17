"""The jobs: each job package declares itself once, in a ``jobspec.py`` holding ``JOB = JobSpec(...)``.

Orchestration, the command line (``python -m espnet3_flows JOB``, ``--help``), the Prefect
flows and the deployments find jobs here; none of them names a job. A package of this project
is a job when it has a ``jobspec.py``; a package installed elsewhere adds one through the entry
point group ``espnet3_flows.jobs`` (``name = "package.module:JOB"``). See
``docs/adding-a-job.md``.

A spec refers to its config class, runner factory and hooks by ``"module:attribute"`` strings,
so reading the registry imports no job code (no torch, no model) until a job is used.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping

from espnet3_flows.registry import ENTRY_POINT_GROUPS, Registry, instance_of

ENTRY_POINT_GROUP = ENTRY_POINT_GROUPS["job"]


@dataclass(frozen=True)
class JobSpec:
    """What a job declares about itself.

    Attributes:
        name: The job's name (``collect_stats``): the CLI's first argument, ``flows/<name>.py``.
        title: The Prefect flow's name (``collect-stats``).
        description: One line for ``--help``, the flow and the deployment.
        schema: ``"module:Class"`` of the config dataclass (validated in ``__post_init__``).
        runners: ``"module:function"``: config → one runner per split
            (:class:`~espnet3_flows.utterance_job.SplitRunner`).
        worker_modules: Modules every worker imports (preloaded once for forked local workers).
        preflight: ``"module:function"`` (config → None, raise :class:`ConfigError`): checks on the
            driver before any cluster starts; empty for none.
        demo: ``"module:function"`` (config → dict of settings or None): for a config that names
            no input, the generated demo's settings; empty for none.
    """

    name: str
    title: str
    description: str
    schema: str
    runners: str
    worker_modules: tuple[str, ...] = ()
    preflight: str = ""
    demo: str = ""

    def load(self, attribute: str) -> Any:
        """The object one of the ``"module:attribute"`` fields names (``None`` when empty)."""
        ref = getattr(self, attribute)
        if not ref:
            return None
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    @property
    def config_class(self) -> type:
        """The config dataclass."""
        return self.load("schema")

    def build_runners(self, cfg: Any) -> list[Any]:
        """One runner per split of ``cfg``."""
        return list(self.load("runners")(cfg))

    def run_preflight(self, cfg: Any) -> None:
        """The job's own driver-side checks (raise :class:`ConfigError`)."""
        check: Callable[[Any], None] | None = self.load("preflight")
        if check is not None:
            check(cfg)

    def demo_settings(self, cfg: Any) -> dict[str, Any] | None:
        """Settings of the generated demo for a config that names no input, else ``None``."""
        demo: Callable[[Any], dict[str, Any] | None] | None = self.load("demo")
        return demo(cfg) if demo is not None else None


def _package_jobs() -> list[str]:
    """This project's jobs, as an entry point names one: ``JOB`` of each package of it with a
    ``jobspec.py`` (found on disk, nothing imported), in name order."""
    import espnet3_flows

    refs = []
    for info in sorted(pkgutil.iter_modules(espnet3_flows.__path__), key=lambda i: i.name):
        where = getattr(info.module_finder, "path", None)
        if info.ispkg and where and os.path.isfile(os.path.join(where, info.name, "jobspec.py")):
            refs.append(f"espnet3_flows.{info.name}.jobspec:JOB")
    return refs


#: every job by name: this project's packages, then the entry points of ``espnet3_flows.jobs``
JOBS: Registry[JobSpec] = Registry("job", "job", builtins=_package_jobs, accept=instance_of(JobSpec),
                                   group=ENTRY_POINT_GROUP)


def available_jobs() -> Mapping[str, JobSpec]:
    """Every job, by name, in name order: this project's packages, then entry points."""
    specs = JOBS.items()
    return {name: specs[name] for name in sorted(specs)}


def get_job(name: str) -> JobSpec:
    """The job called ``name``; a :class:`ConfigError` naming the jobs there are otherwise."""
    return JOBS.get(name)
