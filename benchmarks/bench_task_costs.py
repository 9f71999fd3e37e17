"""Benchmark: what one Prefect task run costs in CPU, part by part, in warm loops (issue "Prefect's
cost per shard and per run").

Each figure is the CPU time (user + system, every thread) of one process per task run, over a loop
of tasks that do nothing, after a warm-up; each arm runs in a fresh process against the API server
``python -m benchmarks`` starts, so the figures hold what Prefect does around a shard and nothing of
a shard's own work:

- **task engine**: Prefect's ``run_task_sync`` as a Dask worker runs it around each shard (with the
  flow run's serialized context, its events and logs to the API), in one process: with this
  package's patches installed as on a worker (``PrefectWorkerSetup``) and with
  ``ESPNET3_FLOWS_PATCHES=off``.
- **driver**: the flow's process while it submits tasks to a ``DaskTaskRunner`` of 2 local worker
  processes and waits for their results, as a shard flow does (the scheduler is in that process);
  beside the same process submitting plain functions with ``Client.submit`` (what Dask alone costs
  it). Patches installed as a run installs them.
- **API server**: the private server's own CPU while the task engine's loop runs, per task run (its
  task-run recorder and event pipeline; not measured when ``PREFECT_API_URL`` names another server).

The target adds the patched parts: the task engine, the server's share and the driver's CPU beyond
plain Dask's, against issue 61's 10 ms per task run.

Run ``python -m benchmarks --only task_costs [--quick]``; ``$ESPNET3_BENCH_TASK_COSTS_N`` sets the
tasks per loop (default 1,000; 40 with ``--quick``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import uuid
from typing import Any

from benchmarks import common

NAME = "task_costs"
ARMS = (("task engine", "engine", "on"), ("task engine", "engine", "off"), ("driver", "driver", "on"))
#: tasks run before each measured loop
WARM_UP = 50


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _install_driver_patches() -> None:
    """The speed patches a run on a cluster installs in its driver (``orchestration.flows._run_flow``
    and ``_run_patched_flow``); its lifecycle patches (heartbeats, exit hooks) cost nothing per task."""
    from espnet3_flows.orchestration.prefect_private import client, contexts, events, gate

    gate.enter_run()
    client.share_tls_contexts()
    client.untokenized_task_keys()
    contexts.cache_settings_serialization()
    events.skip_pending_events()


def _noop_task() -> Any:
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from espnet3_flows.orchestration.console import SHARD_TASK

    @task(name=SHARD_TASK, cache_policy=NO_CACHE, persist_result=False, task_run_name="bench/{i}")
    def shard(i: int) -> int:
        return i

    return shard


def engine_child(n: int) -> dict[str, float]:
    """Per task run: CPU and wall (ms) of Prefect's task engine in this process."""
    from prefect import flow
    from prefect.context import serialize_context
    from prefect.task_engine import run_task_sync

    from espnet3_flows.orchestration.prefect_worker import PrefectWorkerSetup
    from espnet3_flows.patches import patches_enabled

    if patches_enabled():
        PrefectWorkerSetup().setup(None)
    shard, out = _noop_task(), {}

    @flow(name="bench-task-costs")
    def loop() -> None:
        context = serialize_context()
        for rep, count in (("warm-up", WARM_UP), ("measured", n)):
            c0, w0 = _cpu_s(), time.perf_counter()
            for i in range(count):
                run_task_sync(shard, task_run_id=uuid.uuid4(), parameters={"i": i}, context=context,
                              return_type="result")
            out[rep] = (1000 * (_cpu_s() - c0) / count, 1000 * (time.perf_counter() - w0) / count)

    loop()
    return {"cpu_ms": out["measured"][0], "wall_ms": out["measured"][1]}


def driver_child(n: int) -> dict[str, float]:
    """Per task: the driver process's CPU (ms) for Prefect tasks on a DaskTaskRunner, and for plain
    ``Client.submit`` calls on the same cluster (its scheduler in this process, as a flow's is)."""
    from distributed import Client, LocalCluster
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    from espnet3_flows.orchestration.prefect_worker import PrefectWorkerSetup
    from espnet3_flows.patches import patches_enabled

    if patches_enabled():
        _install_driver_patches()
    shard, out = _noop_task(), {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        if patches_enabled():
            client.register_plugin(PrefectWorkerSetup(quiet=True))

        @flow(name="bench-task-costs", task_runner=DaskTaskRunner(address=cluster.scheduler_address))
        def loop() -> None:
            for rep, count in (("warm-up", WARM_UP), ("prefect", n)):
                c0 = _cpu_s()
                [f.result() for f in [shard.submit(i) for i in range(count)]]
                out[rep] = 1000 * (_cpu_s() - c0) / count

        loop()
        client.gather([client.submit(int, i, pure=False) for i in range(WARM_UP)])
        c0 = _cpu_s()
        client.gather([client.submit(int, i, pure=False) for i in range(n)])
        out["dask"] = 1000 * (_cpu_s() - c0) / n
    return {"cpu_ms": out["prefect"], "dask_cpu_ms": out["dask"]}


def _arm(mode: str, patches: str, n: int) -> dict[str, Any]:
    """One arm in a fresh process; with the API server's CPU per task meanwhile (read 1.5 s after
    the process ends: the server's consumers flush their batches once a second)."""
    from benchmarks.cpu_time import process_cpu_s

    env = dict(os.environ, ESPNET3_FLOWS_PATCHES=patches, PREFECT_LOGGING_LEVEL="WARNING")
    server = common.PREFECT.get("pid")
    before = process_cpu_s(server)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_task_costs", f"--{mode}", str(n)], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=common.REPO)
    time.sleep(1.5)
    after = process_cpu_s(server)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": (proc.stderr or proc.stdout)[-800:]}
    tasks = n + WARM_UP  # (the server's figure covers the warm-up's task runs too)
    server_ms = None if before is None or after is None or mode != "engine" else 1000 * (after - before) / tasks
    return {"ok": True, **json.loads(lines[-1]), "server_cpu_ms": server_ms}


def make_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 61's 10 ms of CPU per task run, of Prefect's parts alone: the worker's task engine, the
    server's share and the driver's beyond plain Dask (patches on)."""
    engine = next((r for r in rows if r["part"] == "task engine" and r["patches"] == "on"), {})
    driver = next((r for r in rows if r["part"] == "driver"), {})
    parts = [engine.get("cpu_ms"), engine.get("server_cpu_ms"), driver.get("cpu_ms"), driver.get("dask_cpu_ms")]
    if not (engine.get("ok") and driver.get("ok")) or any(x is None for x in parts):
        return [common.target("CPU per task run, Prefect's parts (ms)", "≤ 10", "not measured", False)]
    total = parts[0] + parts[1] + parts[2] - parts[3]
    return [common.target("CPU per task run, Prefect's parts in warm loops (worker's task engine + server + "
                          "driver beyond plain Dask, ms)", "≤ 10", round(total, 2), total <= 10)]


def run(quick: bool = False) -> dict[str, Any]:
    n = 40 if quick else int(os.environ.get("ESPNET3_BENCH_TASK_COSTS_N") or 1000)
    rows = []
    for part, mode, patches in ARMS:
        print(f"[bench] {NAME}: {part}, patches {patches}, {n} tasks ...", flush=True)
        rows.append({"part": part, "patches": patches, "tasks": n, **_arm(mode, patches, n)})
    notes = ["CPU of every thread of one process per task run, warm loops of no-op tasks against a running "
             "private server; the driver's process holds Dask's scheduler and client, as a shard flow's does. "
             "In a real run the parts add up to more: 2 cores shared by the driver, the server and 2 workers "
             "(`scale`'s CPU per task run)."]
    return common.write_result(NAME, quick, rows, make_targets(rows), notes, plot=lambda path: _plot(rows, path))


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.6))
    names = [f"{r['part']}, patches {r['patches']}" for r in rows][::-1]
    ax.barh(names, [r.get("cpu_ms") or 0.0 for r in rows][::-1], label="the process")
    ax.barh(names, [r.get("server_cpu_ms") or 0.0 for r in rows][::-1],
            left=[r.get("cpu_ms") or 0.0 for r in rows][::-1], label="the API server")
    ax.set_xlabel("CPU ms per task run")
    ax.legend(fontsize=7, loc="lower right")
    common.save_figure(fig, path)


def table(result: dict[str, Any]) -> str:
    return common.markdown_table(
        ["part", "patches", "tasks", "CPU ms per task run", "API server CPU ms per task run",
         "plain Dask CPU ms per task"],
        [[r["part"], r["patches"], r["tasks"], common.fmt(r.get("cpu_ms"), 2) if r.get("ok") else "failed",
          common.fmt(r.get("server_cpu_ms"), 2), common.fmt(r.get("dask_cpu_ms"), 2)] for r in result["rows"]])


if __name__ == "__main__":
    if sys.argv[1:2] in (["--engine"], ["--driver"]):
        print(json.dumps((engine_child if sys.argv[1] == "--engine" else driver_child)(int(sys.argv[2]))))
