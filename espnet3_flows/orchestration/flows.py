"""The Prefect flows: shard tasks on the configured task runner, merge-and-publish, artifacts."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import uuid
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin
from prefect import flow, get_run_logger
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from espnet3_flows.config import load_config, to_plain
from espnet3_flows.orchestration.artifacts import ProgressArtifact, publish_split_artifacts, publish_table_artifact
from espnet3_flows.orchestration.client_tls import share_tls_contexts
from espnet3_flows.orchestration.jobs import check_output_dir, get_job
from espnet3_flows.orchestration.shard_tasks import (
    merge_task,
    unchanged_summary,
    result_storage_for,
    retry_delays,
    shard_task,
)
from espnet3_flows.orchestration.local_server import drain_prefect_clients
from espnet3_flows.orchestration.settings_serialization import cache_settings_serialization
from espnet3_flows.orchestration.task_runner import PREFECT_WORKER_MODULES, make_task_runner, prestart_workers
from espnet3_flows.parallel.forkserver import worker_start_method
from espnet3_flows.parallel.runner import ShardFailure
from espnet3_flows.parallel.worker_env import env_keys, plugin_for
from espnet3_flows.sharding import shard_name
from espnet3_flows.storage import redact


#: Config and plans made by :func:`run_job` for the subflow it calls in this process: the subflow's
#: parameters (shown in the UI) then carry no credentials, and nothing is planned twice.
_PLANNED: dict[str, tuple[Any, list[tuple[Any, Any, dict[int, Any]]]]] = {}


def plan_job(job: str, cfg: Any) -> list[tuple[Any, Any, dict[int, Any]]]:
    """(runner, plan, finished shards) for each split; publishes each plan's ``manifest.json``."""
    plans = []
    for runner, indices in get_job(job).runners(cfg):
        plan = runner.plan(indices)
        runner.write_plan(plan)
        plans.append((runner, plan, runner.collect_done(plan)))
    return plans


def run_job(job: str, config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Plan a job, then run its shards as a subflow on the task runner its ``parallel`` section asks for.

    When every shard is already done, no cluster is started: the shard tasks are cache hits
    (``Cached`` in the UI) resolved by an in-process runner.

    Args:
        job: ``collect_stats`` or ``extract_xvectors``.
        config: The job config as plain data (validated here, before any work).
        progress: Show a terminal progress bar.

    Returns:
        Split name → published summary.
    """
    spec = get_job(job)
    cfg = load_config(spec.schema, base=config)
    share_tls_contexts()
    cache_settings_serialization()
    check_output_dir(_output_dir(cfg), cfg.storage_options)
    _export_api_url()
    prestart_workers(cfg.parallel, spec.worker_modules)
    plans = plan_job(job, cfg)
    pending = sum(len(plan.shards) - len(done) for _, plan, done in plans)
    if pending:
        warn_if_dask_client_open(cfg.parallel)
    runner, start_method = make_task_runner(cfg.parallel) if pending else (ThreadPoolTaskRunner(max_workers=4), "spawn")
    token = uuid.uuid4().hex
    _PLANNED[token] = (cfg, plans)
    shown = to_plain(cfg)
    shown["storage_options"] = redact(shown.get("storage_options"))
    try:
        sub = shard_flow.with_options(task_runner=runner, name=f"{job.replace('_', '-')}-shards")
        with worker_start_method(start_method):  # the cluster starts inside the flow
            return sub(job=job, config=shown, progress=progress, plan_token=token)
    finally:
        _PLANNED.pop(token, None)


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
    logging.getLogger("espnet3_flows").warning(
        "a Dask client is open in this process (%s): prefect-dask will run the shard tasks on its cluster, "
        "not on parallel.env=%s; close it (client.close()) or run the flow in its own process",
        getattr(client, "scheduler", None) and client.scheduler.address, parallel.env)
    return True


def _export_api_url() -> None:
    """Put the API URL in the environment: Dask workers (local processes, SLURM jobs) inherit it."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url and not os.environ.get("PREFECT_API_URL"):
        os.environ["PREFECT_API_URL"] = str(url)


def _prepare_workers(runners: list[Any]) -> list[tuple[Any, list[str]]]:
    """Build each runner's env where its shards will run; return ``(runner, env keys)`` pairs.

    On a Dask task runner this starts the cluster, then on every worker at once: shares
    Prefect's TLS contexts, imports Prefect's task engine and builds each split's env (also on
    workers that join later), instead of one worker after another as first tasks arrive.
    Elsewhere the env is built in this process, where the tasks run. A failing setup raises
    here, naming the provider, before any shard runs.
    """
    from prefect.context import FlowRunContext
    from prefect_dask import DaskTaskRunner

    ctx = FlowRunContext.get()
    task_runner = ctx.task_runner if ctx else None
    if not isinstance(task_runner, DaskTaskRunner):
        return [(runner, env_keys(runner.provider)) for runner in runners]
    client = task_runner.client  # starts the cluster
    client.register_plugin(PrefectWorkerSetup())  # present workers now, later ones (SLURM) as they join
    out = []
    for runner in runners:
        client.register_plugin(plugin_for(runner.provider))
        out.append((runner, client.submit(env_keys, runner.provider, pure=False).result()))
    return out


class PrefectWorkerSetup(WorkerPlugin):
    """On each Dask worker: Prefect's clients share TLS contexts, and Prefect's task engine is
    imported before the first shard task arrives. When the worker closes, the logs and events
    (task-run states) its tasks queued are sent: a forked worker exits without the interpreter
    shutdown that would otherwise send them."""

    name = "espnet3-prefect-worker-setup"

    def setup(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        share_tls_contexts()
        for module in PREFECT_WORKER_MODULES:
            importlib.import_module(module)

    async def teardown(self, worker: Any) -> None:  # noqa: D401 - Dask hook
        await asyncio.to_thread(drain_prefect_clients)  # off the loop: Prefect's drain blocks


def _output_dir(cfg: Any) -> str:
    return cfg.output_dir


@flow(name="shards", log_prints=True, validate_parameters=False)
def shard_flow(job: str, config: dict[str, Any], progress: bool = True, plan_token: str = "") -> dict[str, Any]:
    """Submit one cached task per shard of every split, then merge and publish each split.

    Called by :func:`run_job` (``config`` is the redacted copy shown in the UI; the real one
    travels in-process under ``plan_token``).
    """
    from tqdm.auto import tqdm

    logger = get_run_logger()
    if plan_token not in _PLANNED:
        raise RuntimeError("shard_flow runs inside run_job(); call run_job() or the collect_stats flow")
    cfg, plans = _PLANNED[plan_token]
    t0 = time.perf_counter()
    storage = result_storage_for(_output_dir(cfg), cfg.storage_options)
    pending = sum(len(plan.shards) - len(done) for _, plan, done in plans)
    total = sum(len(p.shards) for _, p, _ in plans)
    logger.info("%s: %d split(s), %d shard(s), %d already done; output %s (options %s)", job, len(plans), total,
                sum(len(d) for _, _, d in plans), _output_dir(cfg), redact(cfg.storage_options))
    if pending:  # build every worker's env at once, then check env keys before any shard runs
        for runner, keys in _prepare_workers([r for r, plan, done in plans if len(done) < len(plan.shards)]):
            runner.check_env_keys(keys)
            logger.info("%s %s: env ready (%s)", job, runner.split, ", ".join(keys))
    meter = ProgressArtifact(job, total)
    bar = tqdm(total=total, desc=job, unit="shard", disable=not progress)
    futures: dict[Any, tuple[int, int]] = {}
    for k, (runner, plan, done) in enumerate(plans):
        task = shard_task.with_options(retries=cfg.retries, retry_delay_seconds=retry_delays(cfg.retries, cfg.retry_delay_seconds),
                                       result_storage=storage)
        fresh = task.with_options(refresh_cache=True)
        for shard in plan.shards:
            futures[(fresh if shard.index not in done else task).submit(runner, shard)] = (k, shard.index)
    records: dict[tuple[int, int], tuple[dict[str, Any], bool]] = {}
    failures: list[tuple[str, BaseException]] = []
    for fut in as_completed(list(futures)):
        where = futures[fut]
        try:
            rec = fut.result()
        except Exception as exc:  # noqa: BLE001 - collect every failure, report after all finish
            failures.append((f"{plans[where[0]][0].shard_subdir}/{shard_name(where[1])}", exc))
            continue
        cached = fut.state.name == "Cached" or bool(rec.get("reused"))
        records[where] = (rec, cached)
        bar.update(1)
        meter.advance()
    bar.close()
    if failures:
        names = ", ".join(n for n, _ in failures)
        raise ShardFailure(f"{len(failures)} shard(s) failed ({names}); finished shards are published and a rerun "
                           f"resumes. First error: {failures[0][1]}") from failures[0][1]
    summaries: dict[str, Any] = {}
    wall = time.perf_counter() - t0
    for k, (runner, plan, _) in enumerate(plans):
        recs = [records[(k, s.index)] for s in plan.shards]
        summary = unchanged_summary(runner, plan) if all(c for _, c in recs) else None
        if summary is None:
            summary = merge_task.submit(runner, [(s.index, s.hash, c) for s, (_, c) in zip(plan.shards, recs)]).result()
        else:
            logger.info("%s %s: nothing changed since the last merge; outputs kept", job, runner.split)
            summary.update(shards_computed=0, shards_cached=len(plan.shards))
        summary["wall_seconds"] = wall
        computed_utts = sum(r["num_items"] for r, c in recs if not c)
        summary["throughput_utt_per_s"] = computed_utts / wall if wall > 0 else None
        summary["realtime_factor"] = summary.get("seconds", 0.0) / wall if wall > 0 and computed_utts else None
        publish_split_artifacts(job, summary, runner.storage, runner.outputs_rel)
        summaries[runner.split] = summary
        logger.info("%s %s: %s utterances, %s shard(s) computed, %s cached, %s skipped", job, runner.split,
                    summary.get("utterances"), summary.get("shards_computed"), summary.get("shards_cached"),
                    summary.get("skipped"))
    publish_table_artifact(job, list(summaries.values()))
    return summaries
