"""A planned flow run: its runners (one per split for a job), their shard plans and finished
shards, and the settings the flow's tasks take (no Prefect here)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator, Sequence

from espnet3_flows.orchestration.jobs import get_job
from espnet3_flows.parallel.backends import worker_slots
from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.parallel.scheduler import PlannedRunner, plan_runner
from espnet3_flows.split_outputs import OWNER, owned_error, owner_conflict, trusted_summary
from espnet3_flows.storage import Storage


@dataclass
class PlannedFlow:
    """What a flow works on, planned on the driver and handed to the flow in-process (so nothing
    is planned twice and no credential travels as a flow parameter).

    Attributes:
        title: How logs and artifacts name the run (a job's name, or the runner's).
        runners: The planned runners (a job: one per split).
        parallel: Where the shards run.
        retries: Retries of a failed shard task (infrastructure errors only, never a bad item).
        retry_delay_seconds: First retry delay (exponential backoff, jittered).
        job: The registered job, or ``None`` for a user's runner (:func:`runner_flow`).
        cfg: The job's config (``None`` for a user's runner).
        worker_modules: Modules forked local workers preload.
        plan_seconds: How long planning took.
        started: When planning started (``time.perf_counter()``).
        worker_environ: Variables the run's local worker processes start with (its console's
            rule: :func:`~.console.quiet_worker_environ`); empty by default.
    """

    title: str
    runners: list[PlannedRunner]
    parallel: ParallelConfig
    retries: int = 2
    retry_delay_seconds: float = 2.0
    job: str | None = None
    cfg: Any = None
    worker_modules: tuple[str, ...] = ()
    plan_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    worker_environ: dict[str, str] = field(default_factory=dict)

    @property
    def total_shards(self) -> int:
        """Shards in every runner's plan."""
        return sum(len(p.plan.shards) for p in self.runners)

    @property
    def done_shards(self) -> int:
        """Shards finished earlier."""
        return sum(len(p.done) for p in self.runners)

    @property
    def pending_shards(self) -> int:
        """Shards to compute."""
        return self.total_shards - self.done_shards

    @property
    def pending_items(self) -> int:
        """Items in the shards to compute."""
        return sum(s.num_items for p in self.runners for s in p.pending)

    @functools.cached_property
    def unchanged_summaries(self) -> dict[str, dict[str, Any]] | None:
        """A job's published summaries, by split, when nothing is pending and no split needs merging
        again (its outputs were merged from exactly this plan), else ``None``. Read once per run:
        the CLI asks before it waits for the server, and again before the flow."""
        if self.job is None or self.pending_shards:
            return None
        out = {}
        for p in self.runners:
            summary = published_summary(p)
            if summary is None:
                return None
            out[p.runner.split] = {**summary, "shards_computed": 0, "shards_cached": len(p.plan.shards)}
        return out


def published_summary(planned: PlannedRunner) -> dict[str, Any] | None:
    """A job split's published ``summary.json`` if it was merged from exactly this plan's shards
    and its files are still the ones it records (:func:`~espnet3_flows.split_outputs.trusted_summary`)."""
    store = planned.runner.storage
    if store is None:
        return None
    return trusted_summary(store, planned.runner.outputs_rel, planned.plan.digest)


#: Preloaded by local workers after the driver's script: quiets Prefect's console as asked
QUIET_WORKERS = "espnet3_flows.orchestration.quiet_workers"


def runner_modules(runner: Any) -> tuple[str, ...]:
    """What a worker imports to run ``runner``: its class's and its provider's modules and the
    runner's own ``worker_modules`` (a script's ``__main__`` is left out: the forkserver imports
    the main module itself), and :data:`QUIET_WORKERS` (after the script: it quiets the console
    the script's imports set up)."""
    classes = (type(runner), type(getattr(runner, "provider", None)))
    names = [c.__module__ for c in classes if c.__module__ not in ("__main__", "builtins")]
    return tuple(dict.fromkeys([*names, *getattr(runner, "worker_modules", ()), QUIET_WORKERS]))


def plan_job(job: str, cfg: Any, publish: bool = True, spool: Storage | None = None) -> PlannedFlow:
    """Plan every split of ``job`` (streaming its manifest), publish each plan's ``manifest.json``
    (unless ``publish`` is false: a dry run) and read the ``done`` records of its shards. A
    joined data directory or unpacked manifest is written to ``spool`` when one is given (a dry
    run's temporary directory), else beside the outputs."""
    spec = get_job(job)
    t0 = time.perf_counter()
    workers = worker_slots(cfg.parallel)
    built = spec.build_runners(cfg)
    check_owners(job, built)
    if spool is not None:
        for runner in built:
            runner.spool = spool
    runners = [plan_runner(runner, None, publish, workers) for runner in built]
    modules = dict.fromkeys([*spec.worker_modules, *(m for p in runners for m in runner_modules(p.runner))])
    return PlannedFlow(job, runners, cfg.parallel, cfg.retries, cfg.retry_delay_seconds, job, cfg,
                       tuple(modules), time.perf_counter() - t0, t0)


def check_owners(job: str, runners: Sequence[Any]) -> None:
    """Refuse a run whose split directories hold another job's outputs or this job's made with
    another config, naming every such split in one line, before any split is planned or claimed
    (a run would otherwise stop at the first, and its rerun at the next)."""
    conflicts = []
    for runner in runners:
        owner = getattr(runner, "owner_record", None)  # (an UtteranceRunner's: a plugin's runner may claim none)
        store = runner.storage
        what = owner_conflict(store, runner.outputs_rel, *owner()) if owner is not None and store is not None else None
        if what is not None:
            rel = runner.outputs_rel
            conflicts.append((store.uri(rel), store.uri(posixpath.join(rel, OWNER)), what))
    if conflicts:
        raise owned_error(job, conflicts)


#: The planned run a flow works on, set around the flow call by whoever planned it: the flow's
#: parameters (stored by the server, shown in the UI) then carry neither the plan nor any
#: credential. Reached through functions: a flow function is pickled by value for Dask, and a
#: ``ContextVar`` in its globals cannot be.
_CURRENT: contextvars.ContextVar[PlannedFlow | None] = contextvars.ContextVar("espnet3_current_run", default=None)


@contextlib.contextmanager
def running(run: PlannedFlow) -> Iterator[PlannedFlow]:
    """Make ``run`` the current run (see :func:`current_run`) for the duration of the block."""
    token = _CURRENT.set(run)
    try:
        yield run
    finally:
        _CURRENT.reset(token)


def current_run() -> PlannedFlow:
    """The run set by :func:`running`; raises when there is none."""
    run = _CURRENT.get()
    if run is None:
        raise RuntimeError("no planned run: the shards flow runs inside run_job() or runner_flow()")
    return run
