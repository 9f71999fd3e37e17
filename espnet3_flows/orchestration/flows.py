"""The Prefect flows: the engine's scheduler with Prefect's task runner as its executor — a task
per pending shard, a merge task per runner, progress and report artifacts — for the registered
jobs (:func:`run_job`) and for any :class:`~espnet3_flows.parallel.base_runner.BaseRunner`
(:func:`runner_flow`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from typing import Any
from collections.abc import Sequence

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from espnet3_flows.config import load_config
from espnet3_flows.credentials import mask_secrets, redact
from espnet3_flows.orchestration import console
from espnet3_flows.orchestration.api_watch import api_call, api_lost_now, hold_while, lost_error
from espnet3_flows.orchestration.artifacts import (
    ProgressArtifact,
    publish_runner_artifact,
    publish_split_artifacts,
    publish_table_artifact,
)
from espnet3_flows.orchestration.cluster_warnings import warn_if_api_unreachable, warn_if_dask_client_open
from espnet3_flows.orchestration.job_run import PlannedFlow, current_run, plan_job, runner_modules, running
from espnet3_flows.orchestration.jobs import get_job, preflight
from espnet3_flows.orchestration.local_server import prefect_api
from espnet3_flows.orchestration.prefect_private.client import share_tls_contexts, untokenized_task_keys
from espnet3_flows.orchestration.prefect_private.contexts import cache_settings_serialization
from espnet3_flows.orchestration.prefect_private.events import skip_pending_events
from espnet3_flows.orchestration.prefect_private.gate import patched_run
from espnet3_flows.orchestration.prefect_private.lifecycle import forked_children_exit_cleanly, prompt_heartbeat_stop
from espnet3_flows.orchestration.run_log import job_logger, run_log
from espnet3_flows.orchestration.shard_tasks import merge_task, retry_unless_bad_item, shard_task
from espnet3_flows.orchestration.task_runner import make_task_runner, prestart_workers
from espnet3_flows.timeline import mark
from espnet3_flows.parallel.backends import worker_slots
from espnet3_flows.parallel.cluster import with_worker_environ
from espnet3_flows.parallel.parallel_config import ParallelConfig
from espnet3_flows.parallel.forkserver import check_main_imported
from espnet3_flows.parallel.main_guard import refuse_while_importing_main
from espnet3_flows.parallel.scheduler import (
    SUBMIT_WINDOW,
    InProcessExecutor,
    PlannedRunner,
    plan_runner,
    run_parallel_config,
    run_planned,
)
from espnet3_flows.parallel.worker_registry import register_runner, worker_resources
from espnet3_flows.sharding import Shard

log = logging.getLogger("espnet3_flows")


def shown_config(cfg: Any) -> dict[str, Any]:
    """The config as a flow parameter: plain data with every credential masked, in any section
    (:func:`~espnet3_flows.credentials.mask_secrets`)."""
    return mask_secrets(cfg)


def run_job(job: str, config: Any = None, progress: bool = True, planned: PlannedFlow | None = None) -> dict[str, Any]:
    """Plan a job, then run its pending shards as a flow on the task runner its ``parallel``
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
    if planned is None:
        cfg = config if isinstance(config, spec.config_class) else load_config(spec.config_class, base=config or {})
        preflight(job, cfg)
        planned = plan_job(job, cfg)
    run, cfg = planned, planned.cfg
    log.info("%s: %d split(s), %d shard(s): %d done earlier, %d to compute (%d utterances); planned in %.1f s",
             job, len(run.runners), run.total_shards, run.done_shards, run.pending_shards, run.pending_items,
             run.plan_seconds)
    kept = run.unchanged_summaries
    if kept is not None:
        in_flow = _in_flow()  # (there, the line goes to the run's log)
        (job_logger() if in_flow else log).info("%s: %d split(s), %d shard(s): all done earlier (cached); every "
                                                "split's outputs are up to date", job, len(run.runners), run.total_shards)
        if in_flow:
            for p in run.runners:
                api_call(publish_split_artifacts, job, kept[p.runner.split], p.runner.storage, p.runner.outputs_rel)
            api_call(publish_table_artifact, job, list(kept.values()))
        return kept
    return _run_flow(run, f"{job.replace('_', '-')}-shards", shown_config(cfg), progress)


def runner_flow(runner: Any, indices: Sequence[Any] | None = None, *, parallel: ParallelConfig | Any = None,
                retries: int = 2, retry_delay_seconds: float = 2.0, progress: bool | None = None,
                name: str | None = None, verbose: bool = False) -> Any:
    """Run any :class:`~espnet3_flows.parallel.base_runner.BaseRunner` as a Prefect flow and return
    what its ``merge`` returns.

    The same shard lifecycle as ``runner(indices)``, with a Prefect task per pending shard (Prefect
    retries for infrastructure errors, never for a bad item) and one for the merge, a progress
    artifact and a report artifact. Shards done earlier are counted and never submitted. Called
    inside a ``@flow`` of your own, it runs there as a subflow.

    Called at top level (a script), it behaves as the command line does: the plan is made first
    (items in memory plan in milliseconds), then, when something is due, a private API server
    starts if none is configured, while the local workers start; when every shard was done
    earlier, no server, cluster or flow starts and ``merge`` runs in this process, as
    ``runner(indices)`` would; the console shows this package's lines, warnings and errors, one line each, not
    Dask's or Prefect's INFO chatter, and Prefect's ``View at`` link only for a server that
    outlives the run (``PREFECT_API_URL`` set). Inside a flow of yours the console is yours, less our cluster's chatter.

    Args:
        runner: The runner (ESPnet3's contract; see :mod:`espnet3_flows.parallel.base_runner`).
        indices: Its items, as for ``runner(indices)`` (``None`` for a runner that plans from its
            own input).
        parallel: Where shards run: a ``parallel`` mapping or
            :class:`~espnet3_flows.parallel.parallel_config.ParallelConfig` (a ``DaskTaskRunner`` on its
            cluster; ``serial`` in this process); by default what ``set_parallel`` set, else ``serial``.
        retries: Retries of a failed shard task.
        retry_delay_seconds: First retry delay (doubling, jittered by up to 50 %).
        progress: Show a terminal progress bar (default: when stderr is a terminal).
        name: The flow's name (default: the runner's class name in kebab case).
        verbose: Leave the console as it is (every Dask and Prefect line).

    Returns:
        What ``runner.merge(shard_dirs)`` returned.
    """
    refuse_while_importing_main("a flow")  # an unguarded script, imported by Dask's workers: one error line
    cfg = run_parallel_config(parallel) or ParallelConfig(env="serial")
    title = name or _kebab(type(runner).__name__)
    shown = {"runner": f"{type(runner).__module__}.{type(runner).__qualname__}", "parallel": mask_secrets(cfg)}
    show_progress = sys.stderr.isatty() if progress is None else progress

    def flow_of(run: PlannedFlow) -> Any:
        p = run.runners[0]
        shown.update({"output_dir": str(runner.output_dir), "shard_subdir": runner.shard_subdir,
                      "items": p.plan.num_items, "shards": run.total_shards})
        return _run_flow(run, title, shown, show_progress)

    quiet_workers = console.quiet_workers_of(cfg.backend, verbose)
    if _in_flow():  # a subflow of the user's flow: their console (less our cluster's chatter), their server
        with contextlib.nullcontext() if verbose else console.quiet_cluster_during(), runner.output_scope():
            return flow_of(_plan_runner_flow(runner, indices, cfg, title, retries, retry_delay_seconds,
                                             quiet_workers))
    # a configured server outlives the run: its UI links are worth printing; a private one's are dead
    run_links = bool(os.environ.get("PREFECT_API_URL") or _configured_api_url())
    with contextlib.nullcontext() if verbose else console.quiet_during(run_links), runner.output_scope():
        # planned first, before any server: items in memory plan in milliseconds (a job's manifest
        # is what the command line overlaps with the server's start)
        run = _plan_runner_flow(runner, indices, cfg, title, retries, retry_delay_seconds, quiet_workers)
        if not run.pending_shards:  # every shard done earlier: no server, cluster or flow; merged here
            log.info("%s: nothing to compute: all %d shard(s) were done earlier (planned in %.2f s)", title,
                     run.total_shards, run.plan_seconds)
            return run_planned(run.runners, InProcessExecutor(), progress=False)[0]
        if not verbose and not cfg.runs_here(run.pending_shards):
            import distributed  # noqa: F401 - Dask configures its console handlers on import: quiet them too

            console.quiet_console(run_links)

        def start_workers() -> bool:  # while a private API server starts (its URL is in the environment)
            prestart_workers(cfg, run.worker_modules, run.pending_shards, environ=run.worker_environ)
            check_main_imported()  # an unguarded script ends here, while the server starts, not once it is up
            return True

        with prefect_api(needs_server=cfg.backend.uses_workers, while_starting=start_workers):
            return flow_of(run)


def _plan_runner_flow(runner: Any, indices: Sequence[Any] | None, cfg: ParallelConfig, title: str, retries: int,
                      retry_delay_seconds: float, worker_environ: dict[str, str]) -> PlannedFlow:
    """:func:`runner_flow`'s plan: the runner's shards cut for ``cfg``'s workers, and which are done."""
    t0 = time.perf_counter()
    p = plan_runner(runner, indices, workers=worker_slots(cfg))
    return PlannedFlow(title, [p], cfg, retries, retry_delay_seconds, worker_modules=runner_modules(runner),
                       worker_environ=worker_environ,
                       plan_seconds=time.perf_counter() - t0, started=t0)


def _configured_api_url() -> str:
    from prefect.settings import get_current_settings

    return str(get_current_settings().api.url or "")


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


def _run_flow(run: PlannedFlow, name: str, shown: dict[str, Any], progress: bool) -> Any:
    """Run :func:`shard_flow` for ``run`` on the task runner its ``parallel`` asks for (in-process
    for merges only, and for shards that run here: ``ParallelConfig.runs_here``), with the patches
    of Prefect a run wants installed for as long as it runs."""
    with patched_run():
        share_tls_contexts()
        prompt_heartbeat_stop()
        forked_children_exit_cleanly()  # before the run starts Prefect's services and their exit hooks
        cache_settings_serialization()
        skip_pending_events()  # (shards that run here, the merge)
        return _run_patched_flow(run, name, shown, progress)


def _run_patched_flow(run: PlannedFlow, name: str, shown: dict[str, Any], progress: bool) -> Any:
    console.quiet_completed_shards()  # shard tasks of a serial run complete in this process
    _export_api_url()
    if run.pending_shards and not run.parallel.runs_here(run.pending_shards):
        untokenized_task_keys()  # imports prefect_dask (and distributed): only for a run on a cluster
        prestart_workers(run.parallel, run.worker_modules, environ=run.worker_environ)
        warn_if_dask_client_open(run.parallel)
        warn_if_api_unreachable(run.parallel)
        # workers that do not inherit this process's environment (ssh, kube) are given the API's URL
        api_url = {"PREFECT_API_URL": os.environ["PREFECT_API_URL"]} if os.environ.get("PREFECT_API_URL") else {}
        # (and local ones what the run's console asks of them)
        task_runner = make_task_runner(with_worker_environ(run.parallel, {**run.worker_environ, **api_url}))
        check_main_imported()  # a script that starts a run when imported fails here, not inside the flow
    else:  # shards that run here (serial, or few enough), or only merges: in this process
        if run.pending_shards:
            prestart_workers(run.parallel, run.worker_modules, run.pending_shards, environ=run.worker_environ)
        task_runner = ThreadPoolTaskRunner(max_workers=1)
    sub = shard_flow.with_options(task_runner=task_runner, name=name)
    with running(run), run_log():  # inside a flow (a deployment's, yours), the job's lines go to its log
        try:
            return sub(title=run.title, config=shown, progress=progress)
        finally:
            mark("flow_returned")


def _in_flow() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def _export_api_url() -> None:
    """Put the API URL in the environment: Dask workers (local processes, SLURM jobs) inherit it.
    Inside a flow without a configured server (Prefect's temporary one), that server's URL."""
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        client = getattr(FlowRunContext.get(), "client", None)
        url = getattr(client, "api_url", None)
    if url and not os.environ.get("PREFECT_API_URL"):
        os.environ["PREFECT_API_URL"] = str(url)


class PrefectExecutor:
    """The scheduler's executor inside a flow: shards and merges as Prefect tasks on the flow's
    task runner. On a ``DaskTaskRunner`` the runners are installed on every worker once (their
    resources built there at once); on the in-process runner (``serial``) in this process.

    Args:
        run: The planned run (its retry settings).
    """

    window = SUBMIT_WINDOW
    fail_fast = False

    def __init__(self, run: PlannedFlow):
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        task_runner = ctx.task_runner if ctx else None
        self.client = None
        if task_runner is not None and not isinstance(task_runner, ThreadPoolTaskRunner):
            from prefect_dask import DaskTaskRunner  # imports distributed: only for a run on a cluster

            if isinstance(task_runner, DaskTaskRunner):
                self.client = task_runner.client  # starts the cluster
        if self.client is not None:
            run.parallel.backend.prepare(self.client, run.parallel)
        self.leaves_running = run.parallel.backend.leaves_running
        self.quiet_workers = console.QUIET_VAR in run.worker_environ
        self.ready: float | None = None
        # Prefect's exponential backoff (first, 2x, 4x, ...) jittered by up to 50 %, so shards that
        # failed together (a store outage) do not all retry at the same instant
        self.task = shard_task.with_options(retries=run.retries, retry_condition_fn=retry_unless_bad_item,
                                            retry_delay_seconds=exponential_backoff(run.retry_delay_seconds),
                                            retry_jitter_factor=0.5)

    def prepare(self, planned: Sequence[PlannedRunner]) -> dict[str, list[str]]:
        """Install every runner where its shards run and build their resources at once (also on
        workers that join later); a failing setup raises here, naming the provider."""
        runners = {p.key: p.runner for p in planned}
        if self.client is None:
            for key, runner in runners.items():
                register_runner(key, runner)
            keys = {key: sorted(worker_resources(runner.provider, local=True)) for key, runner in runners.items()}
        else:
            from espnet3_flows.orchestration.prefect_worker import PrefectWorkerSetup
            from espnet3_flows.parallel.dask_plugins import install_runners, installed_plugins

            if PrefectWorkerSetup.name not in installed_plugins(self.client):
                # present workers now, later ones as they join
                self.client.register_plugin(PrefectWorkerSetup(quiet=self.quiet_workers))
            keys = install_runners(self.client, runners)
        self.ready = time.perf_counter()
        mark("workers_ready")
        for p in planned:
            log.debug("%s: resources ready (%s)", p.label, ", ".join(keys[p.key]))
        return keys

    def submit_shard(self, planned: PlannedRunner, shard: Shard) -> Any:
        return self.task.submit(planned.key, planned.name, shard, self.client is None, planned.run_id)

    def submit_merge(self, planned: PlannedRunner, statuses: list[Any]) -> Any:
        return hold_while(merge_task.submit(planned.runner, planned.name, [s.to_tuple() for s in statuses]))

    def release(self, planned: Sequence[PlannedRunner]) -> None:
        if self.client is not None and self.leaves_running:  # a long-lived cluster: leave no plugin behind
            from espnet3_flows.parallel.dask_plugins import uninstall_runners

            uninstall_runners(self.client, [p.key for p in planned])


@flow(name="shards", log_prints=True, validate_parameters=False)
def shard_flow(title: str, config: dict[str, Any], progress: bool = True) -> Any:
    """Submit one task per pending shard of every runner, then merge each runner.

    Called by :func:`run_job` and :func:`runner_flow`, which plan the run and hand it over
    in-process (:func:`~espnet3_flows.orchestration.job_run.running`); ``config`` is what the UI
    shows of it (credentials masked).
    """
    mark("flow_started")
    logger = job_logger()
    run = current_run()
    t0 = time.perf_counter()
    output = run.cfg.output_dir if run.cfg is not None else config.get("output_dir")
    options = redact(run.cfg.storage_options) if run.cfg is not None else {}
    splits = f"{len(run.runners)} split(s), " if run.job is not None else ""
    logger.info("%s: %s%d shard(s): %d done earlier (cached), %d to compute; output %s%s", title, splits,
                run.total_shards, run.done_shards, run.pending_shards, output,
                f" (storage options {options})" if options else "")
    meter = ProgressArtifact(title, run.total_shards, done=run.done_shards)
    executor = PrefectExecutor(run)
    first: list[float] = []

    def on_shard(k: int, status: Any) -> None:
        if not first:
            first.append(time.perf_counter())
            mark("first_shard")
        meter.advance()
        if api_lost_now() and any(len(p.computed) < len(p.pending) for p in run.runners):
            raise lost_error()  # the API is gone: no further shard is awaited (a finished split's merge runs)

    try:
        merged = run_planned(run.runners, executor, progress=progress, desc=title, on_shard=on_shard)
    finally:
        meter.finish()
    mark("shards_merged")
    wall = time.perf_counter() - t0
    if run.job is None:
        api_call(publish_runner_artifact, title, run.runners[0], merged[0], wall)
        return merged[0]
    return _report_splits(run, merged, wall, {"time_to_first_shard_seconds": (first[0] - run.started) if first else None,
                                              "workers_ready_seconds": (executor.ready or t0) - t0}, logger)


def _report_splits(run: PlannedFlow, merged: list[Any], wall: float, timing: dict[str, Any], logger: Any) -> dict[str, Any]:
    """A job's split summaries with the run's timing, published as report artifacts."""
    summaries: dict[str, Any] = {}
    for p, summary in zip(run.runners, merged, strict=True):
        computed = sum(s.num_items for s in p.computed.values() if not s.cached)
        summary = {**summary, "wall_seconds": wall, "plan_seconds": run.plan_seconds, **timing,
                   "throughput_utt_per_s": computed / wall if wall > 0 else None,
                   "realtime_factor": summary.get("seconds", 0.0) / wall if wall > 0 and computed else None}
        api_call(publish_split_artifacts, run.title, summary, p.runner.storage, p.runner.outputs_rel)
        summaries[p.runner.split] = summary
        logger.info("%s %s: %s utterances, %s shard(s) computed, %s cached, %s skipped", run.title, p.runner.split,
                    summary.get("utterances"), summary.get("shards_computed"), summary.get("shards_cached"),
                    summary.get("skipped"))
    api_call(publish_table_artifact, run.title, list(summaries.values()))
    return summaries
