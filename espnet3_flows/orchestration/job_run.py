"""A planned run of a job: per split its runner, shard plan and finished shards (no Prefect here)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from espnet3_flows.orchestration.jobs import get_job
from espnet3_flows.parallel.results import ShardResult
from espnet3_flows.parallel.worker_env import runner_key
from espnet3_flows.sharding import Shard, ShardPlan
from espnet3_flows.utterance_job import SplitRunner


@dataclass
class SplitRun:
    """One split of a run.

    Attributes:
        runner: The split's runner (config, provider, outputs).
        plan: Its shard plan (per shard: boundaries, hash, source).
        done: Shards finished earlier (matching ``done`` records), by index.
        key: The runner's key (how shard tasks name it on workers).
    """

    runner: SplitRunner
    plan: ShardPlan
    done: dict[int, ShardResult]
    key: str

    @property
    def split(self) -> str:
        """The split's name."""
        return str(self.runner.split)

    @property
    def pending(self) -> list[Shard]:
        """Shards to compute, in plan order."""
        return [s for s in self.plan.shards if s.index not in self.done]

    def published_summary(self) -> dict[str, Any] | None:
        """The split's published ``summary.json`` if it was merged from exactly this plan's shards."""
        store = self.runner.storage
        if store is None:
            return None
        summary = store.read_json(self.runner.outputs_rel, "summary.json")
        if summary and summary.get("plan_digest") == self.plan.digest:
            return summary
        return None


@dataclass
class JobRun:
    """A job's run, planned: the splits, what is done and what is pending. Built once on the
    driver (:func:`plan_job`) and handed to the flow in-process, so nothing is planned twice and
    no credential travels as a flow parameter."""

    job: str
    cfg: Any
    splits: list[SplitRun]
    plan_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @property
    def total_shards(self) -> int:
        """Shards in every split's plan."""
        return sum(len(s.plan.shards) for s in self.splits)

    @property
    def done_shards(self) -> int:
        """Shards finished earlier."""
        return sum(len(s.done) for s in self.splits)

    @property
    def pending_shards(self) -> int:
        """Shards to compute."""
        return self.total_shards - self.done_shards

    @property
    def pending_items(self) -> int:
        """Utterances in the shards to compute."""
        return sum(s.num_items for split in self.splits for s in split.pending)

    @functools.cached_property
    def unchanged_summaries(self) -> dict[str, dict[str, Any]] | None:
        """Every split's published summary when nothing is pending and no split needs merging
        again (its outputs were merged from exactly this plan), else ``None``. Read once per run:
        the CLI asks before it waits for the server, and again before the flow."""
        if self.pending_shards:
            return None
        out = {}
        for split in self.splits:
            summary = split.published_summary()
            if summary is None:
                return None
            out[split.split] = {**summary, "shards_computed": 0, "shards_cached": len(split.plan.shards)}
        return out


def plan_job(job: str, cfg: Any, publish: bool = True) -> JobRun:
    """Plan every split of ``job`` (streaming its manifest), publish each plan's ``manifest.json``
    (unless ``publish`` is false: a dry run) and read the ``done`` records of its shards."""
    t0 = time.perf_counter()
    splits = []
    for runner in get_job(job).build_runners(cfg):
        plan = runner.plan()
        if publish:
            runner.write_plan(plan)
        splits.append(SplitRun(runner, plan, runner.collect_done(plan), runner_key(runner)))
    return JobRun(job, cfg, splits, time.perf_counter() - t0, t0)


#: The planned run a flow works on, set around the flow call by whoever planned it: the flow's
#: parameters (stored by the server, shown in the UI) then carry neither the plan nor any
#: credential. Reached through functions: a flow function is pickled by value for Dask, and a
#: ``ContextVar`` in its globals cannot be.
_CURRENT: contextvars.ContextVar[JobRun | None] = contextvars.ContextVar("espnet3_current_run", default=None)


@contextlib.contextmanager
def running(run: JobRun) -> Iterator[JobRun]:
    """Make ``run`` the current run (see :func:`current_run`) for the duration of the block."""
    token = _CURRENT.set(run)
    try:
        yield run
    finally:
        _CURRENT.reset(token)


def current_run() -> JobRun:
    """The run set by :func:`running`; raises when there is none."""
    run = _CURRENT.get()
    if run is None:
        raise RuntimeError("no planned run: the shards flow runs inside run_job() (or a job's flow)")
    return run
