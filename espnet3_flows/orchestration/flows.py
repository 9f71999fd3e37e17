"""The Prefect flows: pending shard tasks on the configured task runner, merge-and-publish, artifacts."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import queue
import time
from typing import Any, Iterator

from distributed.diagnostics.plugin import WorkerPlugin
from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from espnet3_flows.config import load_config, to_plain
from espnet3_flows.orchestration import console
from espnet3_flows.orchestration.artifacts import ProgressArtifact, publish_split_artifacts, publish_table_artifact
from espnet3_flows.orchestration.prefect_compat import (
    cache_settings_hydration,
    cache_settings_serialization,
    share_tls_contexts,
)
from espnet3_flows.orchestration.job_run import JobRun, SplitRun, current_run, plan_job, running
from espnet3_flows.orchestration.jobs import get_job, preflight
from espnet3_flows.orchestration.local_server import drain_prefect_clients
from espnet3_flows.orchestration.shard_tasks import merge_task, retry_unless_bad_item, shard_task
from espnet3_flows.orchestration.task_runner import PREFECT_WORKER_MODULES, make_task_runner, prestart_workers
from espnet3_flows.parallel.forkserver import worker_start_method
from espnet3_flows.parallel.runner import ShardFailure
from espnet3_flows.parallel.worker_env import (
    env_keys,
    install_runners,
    installed_plugins,
    register_runner,
    uninstall_runners,
)
from espnet3_flows.storage import redact

log = logging.getLogger("espnet3_flows")

#: Shard tasks in flight at once: enough to keep hundreds of workers busy, few enough that the
#: driver's futures and the scheduler's tasks stay flat in the number of shards.
SUBMIT_WINDOW = 256


def shown_config(cfg: Any) -> dict[str, Any]:
    """The config as a flow parameter: plain data with the storage options' credentials masked."""
    shown = to_plain(cfg)
    shown["storage_options"] = redact(shown.get("storage_options"))
    return shown


def run_job(job: str, config: Any = None, progress: bool = True,
            planned: JobRun | None = None) -> dict[str, Any]:
    """Plan a job, then run its pending shards as a subflow on the task runner its ``parallel``
    section asks for, and merge and publish every split.

    Shards finished earlier (a ``done`` record with the same hash) are never submitted: they are
    counted as cached. When nothing is pending and every split's outputs were merged from
    exactly this plan, no cluster starts and no flow runs: the published summaries are returned.

    Args:
        job: A registered job name (see :mod:`espnet3_flows.job_registry`).
        config: The job's config: an instance of its schema (validated already, used as is) or
            plain data (validated here, before any work).
        progress: Show a terminal progress bar.
        planned: A run planned already (by the CLI, while the API server started).

    Returns:
        Split name → published summary.
    """
    spec = get_job(job)
    share_tls_contexts()
    cache_settings_serialization()
    if planned is None:
        cfg = config if isinstance(config, spec.config_class) else load_config(spec.config_class, base=config or {})
        preflight(job, cfg)
        planned = plan_job(job, cfg)
    run, cfg = planned, planned.cfg
    _export_api_url()
    log.info("%s: %d split(s), %d shard(s): %d done earlier, %d to compute (%d utterances); planned in %.1f s",
             job, len(run.splits), run.total_shards, run.done_shards, run.pending_shards, run.pending_items,
             run.plan_seconds)
    kept = run.unchanged_summaries
    if kept is not None:
        log.info("%s: nothing to compute and every split's outputs are up to date", job)
        if _in_flow():
            for split in run.splits:
                publish_split_artifacts(job, kept[split.split], split.runner.storage, split.runner.outputs_rel)
            publish_table_artifact(job, list(kept.values()))
        return kept
    if run.pending_shards:
        prestart_workers(cfg.parallel, spec.worker_modules)
        warn_if_dask_client_open(cfg.parallel)
        warn_if_api_unreachable(cfg.parallel)
        runner, start_method = make_task_runner(cfg.parallel)
    else:  # only merges: in this process
        runner, start_method = ThreadPoolTaskRunner(max_workers=1), "spawn"
    sub = shard_flow.with_options(task_runner=runner, name=f"{job.replace('_', '-')}-shards")
    with running(run), worker_start_method(start_method):  # the cluster starts inside the flow
        return sub(job=job, config=shown_config(cfg), progress=progress)


def _in_flow() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def warn_if_dask_client_open(parallel: Any) -> bool:
    """Warn when a Dask client is already open in this process: prefect-dask's task runner then
    runs every task on that client's cluster and ignores ``parallel``. Returns whether it warned."""
    if parallel.env == "serial":
        return False
    from distributed import default_client

    try:
        client = default_client()
    except ValueError:
        return False
    log.warning(
        "a Dask client is open in this process (%s): prefect-dask will run the shard tasks on its cluster, "
        "not on parallel.env=%s; close it (client.close()) or run the flow in its own process",
        getattr(client, "scheduler", None) and client.scheduler.address, parallel.env)
    return True


def warn_if_api_unreachable(parallel: Any) -> bool:
    """Warn when the shards run on a cluster started elsewhere while the Prefect API is on this
    machine's loopback (a private server): workers on other hosts cannot report to it."""
    from prefect.settings import PREFECT_API_URL

    url = str(PREFECT_API_URL.value() or "")
    if parallel.env != "address" or not any(h in url for h in ("//127.", "//localhost", "//[::1]")):
        return False
    log.warning("parallel.env=address with the Prefect API at %s: Dask workers on other hosts cannot reach a "
                "loopback address; start a Prefect server they can reach and set PREFECT_API_URL", url)
    return True


def _export_api_url() -> None:
    """Put the API URL in the environment: Dask workers (local processes, SLURM jobs) inherit it."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url and not os.environ.get("PREFECT_API_URL"):
        os.environ["PREFECT_API_URL"] = str(url)


def _prepare_workers(splits: list[SplitRun]) -> dict[str, list[str]]:
    """Install each split's runner where its shards will run; return runner key → env keys.

    On a Dask task runner this starts the cluster (or connects to it), then on every worker at
    once: shares Prefect's TLS contexts, imports Prefect's task engine, installs the runners and
    builds their envs (also on workers that join later). A runner already installed on a
    long-lived cluster by an earlier run is not sent again. Elsewhere the runners are registered
    in this process, where the tasks run. A failing setup raises here, naming the provider,
    before any shard runs.
    """
    from prefect.context import FlowRunContext
    from prefect_dask import DaskTaskRunner

    ctx = FlowRunContext.get()
    task_runner = ctx.task_runner if ctx else None
    runners = {s.key: s.runner for s in splits}
    if not isinstance(task_runner, DaskTaskRunner):
        for key, runner in runners.items():
            register_runner(key, runner)
        return {key: env_keys(runner.provider) for key, runner in runners.items()}
    client = task_runner.client  # starts the cluster
    if PrefectWorkerSetup.name not in installed_plugins(client):
        client.register_plugin(PrefectWorkerSetup())  # present workers now, later ones (SLURM) as they join
    return install_runners(client, runners)


class PrefectWorkerSetup(WorkerPlugin):
    """On each Dask worker: Prefect's clients share TLS contexts, and Prefect's task engine is
    imported before the first shard task arrives. When the worker closes, the logs and events
    (task-run states) its tasks queued are sent: a forked worker exits without the interpreter
    shutdown that would otherwise send them."""

    name = "espnet3-prefect-worker-setup"

    def setup(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        console.apply_from_environment()
        share_tls_contexts()
        cache_settings_hydration()
        for module in PREFECT_WORKER_MODULES:
            importlib.import_module(module)

    async def teardown(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        await asyncio.to_thread(drain_prefect_clients)  # off the loop: Prefect's drain blocks


def _pending_work(run: JobRun) -> Iterator[tuple[int, Any]]:
    for k, split in enumerate(run.splits):
        for shard in split.pending:
            yield k, shard


@flow(name="shards", log_prints=True, validate_parameters=False)
def shard_flow(job: str, config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Submit one task per pending shard of every split, then merge and publish each split.

    Called by :func:`run_job`, which plans the run and hands it over in-process
    (:func:`~espnet3_flows.orchestration.job_run.running`); ``config`` is the masked copy shown
    in the UI.
    """
    logger = get_run_logger()
    run = current_run()
    cfg = run.cfg
    t0 = time.perf_counter()
    logger.info("%s: %d split(s), %d shard(s): %d done earlier (cached), %d to compute; output %s (options %s)",
                job, len(run.splits), run.total_shards, run.done_shards, run.pending_shards, cfg.output_dir,
                redact(cfg.storage_options))
    busy = [s for s in run.splits if s.pending]
    if busy:  # install every runner and build every worker's env at once, then check env keys
        keys = _prepare_workers(busy)
        for split in busy:
            split.runner.check_env_keys(keys[split.key])
            logger.info("%s %s: env ready (%s)", job, split.split, ", ".join(keys[split.key]))
    try:
        return _run_shards(job, run, t0, progress, logger)
    finally:
        if busy and cfg.parallel.env == "address":  # a long-lived cluster: leave no plugin behind
            from prefect.context import FlowRunContext

            uninstall_runners(FlowRunContext.get().task_runner.client, [s.key for s in busy])


def _run_shards(job: str, run: JobRun, t0: float, progress: bool, logger: Any) -> dict[str, Any]:
    """Submit the pending shards (at most :data:`SUBMIT_WINDOW` at once), merge each split when its
    last shard is in, publish artifacts; raise :class:`ShardFailure` naming every failed shard."""
    from tqdm.auto import tqdm

    cfg = run.cfg
    t_ready = time.perf_counter()  # workers ready
    meter = ProgressArtifact(job, run.total_shards, done=run.done_shards)
    bar = tqdm(total=run.total_shards, initial=run.done_shards, desc=job, unit="shard", disable=not progress)
    # Prefect's exponential backoff (first, 2x, 4x, ...) jittered by up to 50 %, so shards that
    # failed together (a store outage) do not all retry at the same instant
    task = shard_task.with_options(retries=cfg.retries, retry_condition_fn=retry_unless_bad_item,
                                   retry_delay_seconds=exponential_backoff(cfg.retry_delay_seconds),
                                   retry_jitter_factor=0.5)
    remaining = [len(s.pending) for s in run.splits]
    computed: list[dict[int, dict[str, Any]]] = [{} for _ in run.splits]
    failures: list[tuple[str, BaseException]] = []
    merges: dict[int, Any] = {}
    finished: queue.SimpleQueue[tuple[int, Any, Any]] = queue.SimpleQueue()
    work = _pending_work(run)
    in_flight = 0
    first_done: float | None = None

    def submit_next() -> None:
        nonlocal in_flight
        item = next(work, None)
        if item is None:
            return
        k, shard = item
        fut = task.submit(run.splits[k].key, run.splits[k].split, shard)
        fut.add_done_callback(lambda f, k=k, shard=shard: finished.put((k, shard, f)))
        in_flight += 1

    def merge(k: int) -> None:
        split = run.splits[k]
        entries = [(s.index, s.hash, s.index not in computed[k] or bool(computed[k][s.index]["reused"]))
                   for s in split.plan.shards]
        merges[k] = merge_task.submit(split.runner, entries)

    for k, split in enumerate(run.splits):
        if not split.pending:
            merge(k)  # nothing to compute, but the plan changed (e.g. lines removed): merge again
    for _ in range(SUBMIT_WINDOW):
        submit_next()
    while in_flight:
        k, shard, fut = finished.get()
        in_flight -= 1
        submit_next()
        remaining[k] -= 1
        try:
            rec = fut.result()
        except Exception as exc:  # noqa: BLE001 - collect every failure, report after all finish
            failures.append((f"{run.splits[k].runner.shard_subdir}/{shard.name}", exc))
            continue
        first_done = first_done or time.perf_counter()
        computed[k][shard.index] = rec
        bar.update(1)
        meter.advance()
        if remaining[k] == 0 and not any(n.startswith(run.splits[k].runner.shard_subdir + "/") for n, _ in failures):
            merge(k)
    bar.close()
    meter.finish()
    summaries: dict[str, Any] = {}
    wall = time.perf_counter() - t0
    for k, split in enumerate(run.splits):
        if k not in merges:
            continue
        summary = merges[k].result()
        summary["wall_seconds"] = wall
        summary["plan_seconds"] = run.plan_seconds
        summary["time_to_first_shard_seconds"] = (first_done - run.started) if first_done else None
        summary["workers_ready_seconds"] = t_ready - t0
        computed_utts = sum(r["num_items"] for r in computed[k].values() if not r["reused"])
        summary["throughput_utt_per_s"] = computed_utts / wall if wall > 0 else None
        summary["realtime_factor"] = summary.get("seconds", 0.0) / wall if wall > 0 and computed_utts else None
        publish_split_artifacts(job, summary, split.runner.storage, split.runner.outputs_rel)
        summaries[split.split] = summary
        logger.info("%s %s: %s utterances, %s shard(s) computed, %s cached, %s skipped", job, split.split,
                    summary.get("utterances"), summary.get("shards_computed"), summary.get("shards_cached"),
                    summary.get("skipped"))
    if failures:
        names = ", ".join(n for n, _ in failures[:20]) + (" ..." if len(failures) > 20 else "")
        raise ShardFailure(f"{len(failures)} shard(s) failed ({names}); finished shards are published and a rerun "
                           f"resumes. First error: {failures[0][1]}") from failures[0][1]
    publish_table_artifact(job, list(summaries.values()))
    return summaries
