"""The one shard scheduler: the pending shards of planned runners go through an executor — this
process, a Dask client, or (in :mod:`espnet3_flows.orchestration`) Prefect's task runner — at most
a window at a time; each runner is merged when its last shard is in; failures are collected and
reported together, naming every shard.

``runner(indices)``, ``runner.run(...)``, the built-in jobs' flows and ``runner_flow`` all run
through :func:`run_planned`; only the executor differs.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable, Iterator, Sequence

from espnet3_flows.deadlines import is_outage
from espnet3_flows.errors import ItemError, ItemFailure, ShardFailure
from espnet3_flows.parallel.merge_step import merge_runner
from espnet3_flows.parallel.results import ShardResult, ShardStatus
from espnet3_flows.parallel.shard_lifecycle import DONE
from espnet3_flows.parallel.worker_deaths import memory_note
from espnet3_flows.parallel.worker_registry import get_runner, register_runner, runner_key, worker_resources
from espnet3_flows.published_files import mismatches
from espnet3_flows.sharding import Shard, ShardPlan

#: Shard tasks in flight at once on a cluster: enough to keep hundreds of workers busy, few
#: enough that the driver's futures and the scheduler's tasks stay flat in the number of shards.
SUBMIT_WINDOW = 256
_LOG = logging.getLogger(__name__)


@dataclass
class PlannedRunner:
    """A runner with its shard plan and the shards finished earlier.

    Attributes:
        runner: The runner (config, provider, outputs).
        plan: Its shard plan.
        done: Shards finished earlier (matching ``done`` records), by index.
        key: The runner's key (how shard tasks name it on workers).
        computed: Shards computed (or found done on a worker) in this run, by index.
        run_id: This run's id, written into the ``done`` records it writes.
    """

    runner: Any
    plan: ShardPlan
    done: dict[int, ShardResult]
    key: str
    computed: dict[int, ShardStatus] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def label(self) -> str:
        """How messages name the runner: its shard directory, else its class."""
        return self.runner.shard_subdir or type(self.runner).__name__

    @property
    def name(self) -> str:
        """How task runs name the runner: a job's split, else its shard directory or class."""
        split = getattr(self.runner, "split", None)
        return split if isinstance(split, str) and split else self.label

    @property
    def pending(self) -> list[Shard]:
        """Shards to compute, in plan order."""
        return [s for s in self.plan.shards if s.index not in self.done]

    @property
    def statuses(self) -> list[ShardStatus]:
        """Every shard's status in plan order (a pending shard not computed yet counts as computed)."""
        out = []
        for s in self.plan.shards:
            if s.index in self.computed:
                out.append(self.computed[s.index])
            elif s.index in self.done:
                out.append(self.done[s.index].status())
            else:
                out.append(ShardStatus(s.index, s.hash, s.num_items, False))
        return out


def plan_runner(runner: Any, indices: Sequence[Any] | None = None, publish: bool = True,
                workers: int = 1) -> PlannedRunner:
    """Plan ``runner`` over ``indices`` (``None``: a runner that plans from its own input) for
    ``workers`` concurrent workers (a small split is cut finer for more of them), publish the
    plan's ``manifest.json`` (unless ``publish`` is false: a dry run) and read the ``done``
    records of its shards."""
    plan = runner.plan(indices, workers=workers)
    if publish:
        runner.write_plan(plan)
    return PlannedRunner(runner, plan, runner.collect_done(plan), runner_key(runner))


def recheck_done(planned: PlannedRunner) -> None:
    """Make pending again, with a warning naming the file, every shard done earlier whose published
    files no longer match the sizes and digests of its ``done`` record (a truncated copy, a file
    edited or replaced): its record is removed, so the shard is computed, never merged as it is."""
    store = planned.runner.storage
    if store is None or not planned.done:
        return
    bad = mismatches(store, {rel: d for res in planned.done.values() for rel, d in res.digests.items()})
    if not bad:
        return
    for index, res in list(planned.done.items()):
        rel = next((rel for rel in res.digests if rel in bad), None)
        if rel is not None:
            _LOG.warning("%s does not match its done record (%s): the shard is computed again", store.uri(rel),
                         bad[rel])
            store.remove(planned.runner.shard_rel(res.shard, DONE))
            del planned.done[index]


def execute_shard(key: str, shard: Shard, local: bool = False, run_id: str = "") -> dict[str, Any]:
    """Compute one shard with the runner registered under ``key`` in this process and its resources
    (built once per process: by ``build_env_local`` when ``local``, else by the setup function).
    A matching ``done`` record found here is reused: it counts as computed when run ``run_id``
    wrote it (a worker that died after publishing it), as reused when an earlier run did.

    Returns:
        ``{"index", "num_items", "seconds", "reused"}``: small, whatever the shard computed.
    """
    runner = get_runner(key)
    found = runner.load_done(shard)
    if found is not None:
        return {"index": shard.index, "num_items": shard.num_items, "seconds": found.seconds,
                "reused": not run_id or found.run_id != run_id}
    res = runner.run_shard(shard, worker_resources(runner.provider, local=local), run_id)
    return {"index": shard.index, "num_items": shard.num_items, "seconds": res.seconds, "reused": False}


class ShardExecutor(Protocol):
    """Where shards and merges run. Futures need ``add_done_callback(fn(future))`` and ``result()``.

    Attributes:
        window: Shards in flight at once.
        fail_fast: Submit no more shards after the first failure (a run in this process).
    """

    window: int
    fail_fast: bool

    def prepare(self, planned: Sequence[PlannedRunner]) -> dict[str, list[str]]:
        """Install the runners where their shards run and build their resources; runner key → resource names."""

    def submit_shard(self, planned: PlannedRunner, shard: Shard) -> Any:
        """Start one shard; a future of :func:`execute_shard`'s result."""

    def submit_merge(self, planned: PlannedRunner, statuses: list[ShardStatus]) -> Any:
        """Start the runner's merge; a future of what ``merge`` returns."""

    def release(self, planned: Sequence[PlannedRunner]) -> None:
        """Undo :meth:`prepare` where it would outlive the run (a cluster someone else runs)."""


def _done_future(fn: Callable[..., Any], *args: Any) -> Future:
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except Exception as exc:  # noqa: BLE001 - delivered through the future, as from a cluster
        fut.set_exception(exc)
    return fut


class InProcessExecutor:
    """Shards run one after another in this process, on the resources ``build_env_local()`` builds (ESPnet3's
    local run).

    Args:
        fail_fast: The first failure stops the run (ESPnet3's local run); ``False`` for shards
            that would have run on a cluster (:meth:`~espnet3_flows.parallel.parallel_config.ParallelConfig.runs_here`),
            where every shard is tried and the failures are reported together.
    """

    window = 1

    def __init__(self, fail_fast: bool = True):
        self.fail_fast = fail_fast

    def prepare(self, planned: Sequence[PlannedRunner]) -> dict[str, list[str]]:
        for p in planned:
            register_runner(p.key, p.runner)
        return {p.key: sorted(worker_resources(p.runner.provider, local=True)) for p in planned}

    def submit_shard(self, planned: PlannedRunner, shard: Shard) -> Future:
        return _done_future(execute_shard, planned.key, shard, True, planned.run_id)

    def submit_merge(self, planned: PlannedRunner, statuses: list[ShardStatus]) -> Future:
        return _done_future(merge_runner, planned.runner, statuses)

    def release(self, planned: Sequence[PlannedRunner]) -> None:
        pass


class DaskExecutor:
    """Shards run as plain Dask tasks on ``client``'s cluster; each runner is installed once per
    worker (its resources built there at once); merges run in this process.

    Args:
        client: A ``distributed.Client``.
        owned: Whether this run started the cluster (else its plugins are removed afterwards).
    """

    window = SUBMIT_WINDOW
    fail_fast = False

    def __init__(self, client: Any, owned: bool = False):
        self.client = client
        self.owned = owned

    def prepare(self, planned: Sequence[PlannedRunner]) -> dict[str, list[str]]:
        from espnet3_flows.parallel.env_provider import checked_setup_fn

        for p in planned:
            store = p.runner.storage
            if store is not None and store.fs.protocol in ("memory", ("memory",)):
                raise ValueError(f"output_dir {p.runner.output_dir!r} is in this process's memory; Dask workers in "
                                 "other processes cannot write there: use a path or an object store URL")
            checked_setup_fn(p.runner.provider)
        from espnet3_flows.parallel.dask_plugins import install_runners

        return install_runners(self.client, {p.key: p.runner for p in planned})

    def submit_shard(self, planned: PlannedRunner, shard: Shard) -> Any:
        return self.client.submit(execute_shard, planned.key, shard, False, planned.run_id,
                                  key=f"{shard.name}-{shard.hash[:12]}", pure=False)

    def submit_merge(self, planned: PlannedRunner, statuses: list[ShardStatus]) -> Future:
        return _done_future(merge_runner, planned.runner, statuses)

    def release(self, planned: Sequence[PlannedRunner]) -> None:
        if not self.owned:
            from espnet3_flows.parallel.dask_plugins import uninstall_runners

            uninstall_runners(self.client, [p.key for p in planned])


def run_parallel_config(parallel: Any = None) -> Any:
    """The ``parallel`` config a run without a client uses: ``parallel`` (a mapping or
    :class:`~espnet3_flows.parallel.parallel_config.ParallelConfig`), else ``set_parallel``'s, else
    ``None`` (this process)."""
    from espnet3_flows.parallel.parallel_config import as_parallel_config
    from espnet3_flows.parallel.parallel import get_parallel_config, parallel_is_set

    return as_parallel_config(parallel) if parallel is not None else (
        get_parallel_config() if parallel_is_set() else None)


def planning_workers(client: Any = None, cfg: Any = None) -> int:
    """How many shards a run computes at once: the threads of ``client``'s workers, else those
    ``cfg`` (:func:`run_parallel_config`) asks for
    (:func:`~espnet3_flows.parallel.backends.worker_slots`); 1 in this process."""
    from espnet3_flows.parallel.backends import worker_slots

    if client is not None:
        return max(1, sum(client.nthreads().values()))
    return 1 if cfg is None else worker_slots(cfg)


@contextlib.contextmanager
def engine_executor(planned: PlannedRunner, client: Any = None, parallel: Any = None) -> Iterator[ShardExecutor]:
    """The executor of ``runner.run``: ``client``'s cluster; else a cluster started for the run
    from ``parallel`` (or ``set_parallel``'s config), closed afterwards; else, for ``serial``,
    no config, nothing pending, or few enough shards to run here
    (:meth:`~espnet3_flows.parallel.parallel_config.ParallelConfig.runs_here`), this process."""
    from espnet3_flows.parallel.parallel import get_client

    if not planned.pending:
        yield InProcessExecutor()
        return
    if client is not None:
        yield DaskExecutor(client)
        return
    cfg = run_parallel_config(parallel)
    if cfg is None or cfg.runs_here(len(planned.pending)):
        yield InProcessExecutor(fail_fast=cfg is None or not cfg.backend.uses_workers)
        return
    with get_client(cfg) as own:
        yield DaskExecutor(own, owned=cfg.backend.owns_cluster)


def run_planned(planned: Sequence[PlannedRunner], executor: ShardExecutor, *, progress: bool = True,
                desc: str | None = None, on_shard: Callable[[int, ShardStatus], None] | None = None) -> list[Any]:
    """Compute every pending shard of ``planned`` through ``executor`` and merge each runner.

    Runners whose shards are all done earlier are merged at once (the plan may have lost shards).
    A shard done earlier whose published files no longer match its ``done`` record is computed
    again (:func:`recheck_done`). Resource names are checked on the executor's workers before any shard runs.

    Args:
        planned: The planned runners (e.g. one per split).
        executor: Where shards and merges run.
        progress: Show a terminal progress bar.
        desc: The progress bar's label.
        on_shard: Called with (runner position, status) as each shard finishes.

    Returns:
        What each runner's ``merge`` returned, in order.

    Raises:
        ShardFailure: naming every failed shard (:class:`ItemFailure` when the first failure is a bad
            item); finished shards stay published, and the runners with a failed shard are not merged.
    """
    from tqdm.auto import tqdm

    for p in planned:
        recheck_done(p)
    busy = [p for p in planned if p.pending]
    try:
        if busy:  # every runner installed and every worker's resources built at once, then the keys checked
            keys = executor.prepare(busy)
            for p in busy:
                p.runner.check_resource_keys(keys[p.key])
        total = sum(len(p.plan.shards) for p in planned)
        bar = tqdm(total=total, initial=sum(len(p.done) for p in planned), unit="shard",
                   desc=desc or (planned[0].label if len(planned) == 1 else "shards"), disable=not progress or not busy)
        try:
            merges, failures = _run_shards(planned, executor, bar, on_shard)
        finally:
            bar.close()
        merged = [merges[k].result() if k in merges else None for k in range(len(planned))]
    finally:
        if busy:
            executor.release(busy)
    if failures:
        raise _failure(failures)
    return merged


def _run_shards(planned: Sequence[PlannedRunner], executor: ShardExecutor, bar: Any,
                on_shard: Callable[[int, ShardStatus], None] | None) -> tuple[dict[int, Any], list[tuple[str, BaseException]]]:
    remaining = [len(p.pending) for p in planned]
    failed: set[int] = set()
    failures: list[tuple[str, BaseException]] = []
    merges: dict[int, Any] = {}
    finished: queue.SimpleQueue[tuple[int, Shard, Any]] = queue.SimpleQueue()
    work = ((k, shard) for k, p in enumerate(planned) for shard in p.pending)
    in_flight = 0

    def submit_next() -> None:
        nonlocal in_flight
        # a storage endpoint that stopped answering fails every shard the same way: submit no more
        stop = failures and (executor.fail_fast or is_outage(failures[-1][1]))
        item = None if stop else next(work, None)
        if item is None:
            return
        k, shard = item
        fut = executor.submit_shard(planned[k], shard)
        in_flight += 1
        fut.add_done_callback(lambda f, k=k, shard=shard: finished.put((k, shard, f)))

    for k, p in enumerate(planned):
        if not p.pending:  # nothing to compute, but the plan may have changed (lines removed): merge again
            merges[k] = executor.submit_merge(p, p.statuses)
    for _ in range(executor.window):
        submit_next()
    while in_flight:
        k, shard, fut = finished.get()
        in_flight -= 1
        remaining[k] -= 1
        try:
            out = fut.result()
        except Exception as exc:  # noqa: BLE001 - every failure is collected and reported together
            failures.append((f"{planned[k].label}/{shard.name}", exc))
            failed.add(k)
        else:
            status = ShardStatus(shard.index, shard.hash, shard.num_items, bool(out["reused"]), float(out["seconds"]))
            planned[k].computed[shard.index] = status
            bar.update(1)
            if on_shard is not None:
                on_shard(k, status)
            if remaining[k] == 0 and k not in failed:
                merges[k] = executor.submit_merge(planned[k], planned[k].statuses)
        submit_next()
    return merges, failures


def _failure(failures: list[tuple[str, BaseException]]) -> ShardFailure:
    names = ", ".join(n for n, _ in failures[:20]) + (" ..." if len(failures) > 20 else "")
    first = failures[0][1]
    kind = ItemFailure if isinstance(first, ItemError) else ShardFailure
    err = kind(f"{len(failures)} shard(s) failed ({names}); finished shards are published and a rerun resumes. "
               f"First error: {first}{memory_note(first)}")
    err.__cause__ = first
    return err
