"""Benchmark: thirty nights of the three jobs on standing services, as an operator runs them.

One standing Prefect server (``deployments/local-stack.sh serve``, as ``make serve``), one
standing Dask scheduler with 2 single-threaded workers (``dask scheduler`` / ``dask worker``; the
jobs run there with ``parallel.env=address``; the scheduler with the settings docs/deployments.md
gives a standing one), and collect-stats, extract-xvectors (a
random-weight ECAPA model) and extract-features as deployments on a process worker
(``local-stack.sh worker``, one run at a time). Each night the manifest gains 3 % new
utterances (of the cached benchmark corpus, 2–6 s each) and each deployment is run once, with
the parameters its deployment holds. After every run its outputs are compared with a fresh
serial run of the engine on the same manifest; after every night the scheduler's, the workers'
and the server's RSS, the size of Prefect's SQLite database, and what the scheduler keeps
between runs (its Python objects, spans, event topics, remembered stream messages) are read;
``ESPNET3_BENCH_SOAK_TRACE=1`` also traces the scheduler's Python allocations from the first night.

Targets: every run completes with a fresh run's outputs; the scheduler's and the largest
worker's RSS after the last night within 10 % of after night 3. The database's growth per run
is stated (docs/deployments.md, "Keeping the database small", says how to bound it).

Run ``python -m benchmarks --only soak`` (``ESPNET3_BENCH_SOAK_NIGHTS``, default 30;
``ESPNET3_BENCH_SOAK_UTTS``, the first night's utterances, default 100). Not in a quick group:
even three nights stand up four services and nine deployment runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

from benchmarks import common
from espnet3_flows.orchestration.local_server import _free_port  # the private server's own choice of a port

NAME = "soak"
#: job → (deployment name, its output directory under the work directory)
JOBS = {
    "collect_stats": ("collect-stats/soak-stats", "exp/stats"),
    "extract_xvectors": ("extract-xvectors/soak-xvectors", "exp/xvectors"),
    "extract_features": ("extract-features/soak-features", "exp/features"),
}
GROWTH = 0.03
#: the standing scheduler's settings docs/deployments.md gives (and docker-compose.yml's dask-scheduler has)
SCHEDULER_SETTINGS = {"DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": "100"}
MB = 1024 ** 2
#: nights shown in the README's table (the others are in the JSON)
SHOWN = (1, 3, 10, 20, 30)


def night_sizes(first: int, nights: int) -> list[int]:
    """Utterances each night: ``first``, then 3 % more (at least one) every night."""
    sizes = [first]
    while len(sizes) < nights:
        sizes.append(sizes[-1] + max(1, math.ceil(GROWTH * sizes[-1])))
    return sizes


def _prefect_yaml(work: Path, address: str, model: Path) -> str:
    import yaml

    parallel = {"env": "address", "options": {"address": address}}
    extra = {"extract_xvectors": {"xvector": {"pretrained_model": str(model)}}}
    return yaml.safe_dump({
        "name": "soak", "prefect-version": "3.8.8",
        "pull": [{"espnet3_flows.orchestration.deploy_steps.working_directory": {"directory": str(work)}}],
        "deployments": [{
            "name": deployment.split("/")[1], "entrypoint": f"espnet3_flows.flows.{job}",
            "work_pool": {"name": "espnet3", "work_queue_name": "default"},
            "parameters": {"manifests": {"train": "data/train.tsv"}, "output_dir": out, "parallel": parallel,
                           **extra.get(job, {})},
        } for job, (deployment, out) in JOBS.items()]}, sort_keys=False)


class Services:
    """The standing server, scheduler, workers and process worker of a soak, in ``work``."""

    def __init__(self, work: Path):
        self.work = work
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(work / "prefect-home"), "PREFECT_PORT": str(self.port),
                    "PREFECT": str(Path(sys.executable).with_name("prefect")), "PREFECT_API_URL": self.url,
                    "ESPNET3_STACK_DIR": str(work / "stack"), "ESPNET3_FLOWS_WORKDIR": str(work),
                    "ESPNET3_WORKER_LIMIT": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1"}
        self.dask: list[subprocess.Popen[bytes]] = []
        self.address = f"tcp://127.0.0.1:{_free_port()}"

    def stack(self, command: str) -> str:
        done = subprocess.run(["bash", str(common.REPO / "deployments" / "local-stack.sh"), command],
                              cwd=common.REPO, env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"local-stack.sh {command}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout

    def prefect(self, *args: str) -> None:
        done = subprocess.run([self.env["PREFECT"], "--no-prompt", *args], cwd=self.work, env=self.env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def start(self, model: Path) -> None:
        self.stack("serve")
        dask = str(Path(sys.executable).with_name("dask"))
        with open(self.work / "dask.log", "ab") as log:  # each process holds its own descriptor
            self.dask.append(subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port",
                                               self.address.rsplit(":", 1)[1], "--no-dashboard"],
                                              env={**self.env, **SCHEDULER_SETTINGS}, stdout=log, stderr=log,
                                              start_new_session=True))
            _wait_for_workers(self.address, 0)  # a worker gives up on a scheduler that is not listening yet
            self.dask.append(subprocess.Popen([dask, "worker", self.address, "--nworkers", str(common.WORKERS),
                                               "--nthreads", "1", "--no-dashboard"],
                                              env=self.env, stdout=log, stderr=log, start_new_session=True))
        _wait_for_workers(self.address, common.WORKERS)
        if os.environ.get("ESPNET3_BENCH_SOAK_TRACE"):
            _on_scheduler(self.address, _start_tracing)
        (self.work / "prefect.yaml").write_text(_prefect_yaml(self.work, self.address, model))
        self.prefect("work-pool", "create", "espnet3", "--type", "process", "--overwrite")
        self.prefect("deploy", "--all", "--prefect-file", str(self.work / "prefect.yaml"))
        self.stack("worker")

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stack("stop")
        for proc in reversed(self.dask):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)

    def run(self, deployment: str) -> dict[str, Any]:
        """Run a deployment with its own parameters and wait for its end."""
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        t0 = time.perf_counter()
        with temporary_settings(updates={PREFECT_API_URL: self.url}):
            flow_run = run_deployment(deployment, timeout=1800)
        state = flow_run.state
        return {"wall_s": time.perf_counter() - t0, "state": state.type.value if state else "none",
                "message": (state.message or "")[:300] if state else ""}

    def measure(self) -> dict[str, Any]:
        """RSS of the scheduler, the largest worker and the server's processes; the database's size."""
        import psutil

        scheduler = psutil.Process(self.dask[0].pid)
        workers = [p for p in psutil.Process(self.dask[1].pid).children(recursive=True)
                   if "spawn_main" in " ".join(p.cmdline()) or "forkserver" in " ".join(p.cmdline())]
        server_pid = int((self.work / "stack" / "server.pid").read_text())
        server = psutil.Process(server_pid)
        server_rss = sum(p.memory_info().rss for p in [server, *server.children(recursive=True)])
        db = self.work / "prefect-home" / "prefect.db"
        db_bytes = sum(p.stat().st_size for p in (db, db.with_name("prefect.db-wal")) if p.exists())
        return {"scheduler_rss_mb": scheduler.memory_info().rss / MB, **_on_scheduler(self.address, scheduler_state),
                "worker_rss_mb": max((w.memory_info().rss for w in workers), default=0) / MB,
                "workers_seen": len(workers), "server_rss_mb": server_rss / MB, "db_mb": db_bytes / MB}


def _on_scheduler(address: str, func: Any) -> Any:
    """``func(dask_scheduler)`` run on the scheduler at ``address``, through a client of its own."""
    from distributed import Client

    with Client(address, timeout=60, set_as_default=False) as client:
        return client.run_on_scheduler(func)


def _start_tracing(dask_scheduler: Any) -> None:
    import tracemalloc

    tracemalloc.start(8)


def scheduler_state(dask_scheduler: Any) -> dict[str, Any]:
    """What a standing scheduler keeps between runs (run on it): Python objects, the MB Python has
    allocated since its workers joined when ``ESPNET3_BENCH_SOAK_TRACE=1`` traces it, the spans it
    remembers, its event topics and events, and the messages its worker streams remember."""
    import gc
    import tracemalloc

    gc.collect()
    spans = dask_scheduler.extensions.get("spans")
    topics = dask_scheduler._broker._topics
    return {"scheduler_objects": len(gc.get_objects()),
            "scheduler_traced_mb": tracemalloc.get_traced_memory()[0] / MB if tracemalloc.is_tracing() else None,
            "scheduler_spans": len(spans.spans) if spans is not None else None,
            "scheduler_event_topics": len(topics),
            "scheduler_events": sum(len(t.events) for t in topics.values()),
            "scheduler_stream_messages": sum(len(b.recent_message_log) for b in dask_scheduler.stream_comms.values())}


def _wait_for_workers(address: str, n: int, timeout: float = 120) -> None:
    from distributed import Client

    with Client(address, timeout=timeout, set_as_default=False) as client:  # waits for the scheduler
        if n:
            client.wait_for_workers(n, timeout=timeout)


@contextlib.contextmanager
def standing(work: Path, model: Path) -> Iterator[Services]:
    """The soak's services, started and (whatever happens) stopped."""
    services = Services(work)
    try:
        services.start(model)
        yield services
    finally:
        services.stop()


def fresh_outputs(job: str, manifest: Path, model: Path, out: Path) -> None:
    """The job's outputs from scratch: the engine, serially, in this process."""
    from espnet3_flows.orchestration.jobs import get_job, resolve_config

    overrides = [f"manifests.train={manifest}", f"output_dir={out}", "parallel.env=serial"]
    if job == "extract_xvectors":
        overrides.append(f"xvector.pretrained_model={model}")
    cfg = resolve_config(job, None, {}, overrides)
    for runner in get_job(job).build_runners(cfg):
        runner.run(progress=False)


def same_outputs(job: str, got: Path, fresh: Path) -> str:
    """``""`` when a run's outputs equal a fresh run's within float tolerance, else what differs."""
    import numpy as np

    if job == "collect_stats":
        with np.load(got / "train" / "feats_stats.npz") as a, np.load(fresh / "train" / "feats_stats.npz") as b:
            if int(a["count"]) != int(b["count"]):
                return f"count {int(a['count'])} != {int(b['count'])}"
            for key in ("sum", "sum_square"):
                if not np.allclose(a[key], b[key], rtol=1e-9, atol=0):
                    return f"{key} differs"
        shapes = [sorted((d / "train" / "feats_shape").read_text().splitlines()) for d in (got, fresh)]
        return "" if shapes[0] == shapes[1] else "feats_shape differs"
    name = "feats.scp" if job == "extract_features" else "xvector.scp"
    return _same_scp(_one(got, name), _one(fresh, name))


def _one(root: Path, name: str) -> Path:
    found = sorted(root.glob(f"**/train/{name}"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} {name} under {root}")
    return found[0]


def _same_scp(a: Path, b: Path) -> str:
    import kaldiio
    import numpy as np

    ours, theirs = kaldiio.load_scp(str(a)), kaldiio.load_scp(str(b))
    if sorted(ours) != sorted(theirs):
        return f"keys differ ({len(ours)} vs {len(theirs)})"
    bad = [k for k in ours if not np.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-5)]
    return f"{len(bad)} of {len(ours)} values differ (e.g. {bad[0]})" if bad else ""


def run(quick: bool = False) -> dict[str, Any]:
    """Run the nights, write ``soak.json`` / ``.png`` and return the result."""
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    nights = int(os.environ.get("ESPNET3_BENCH_SOAK_NIGHTS") or (3 if quick else 30))
    sizes = night_sizes(int(os.environ.get("ESPNET3_BENCH_SOAK_UTTS") or (12 if quick else 100)), nights)
    corpus = common.corpus_manifest(sizes[-1]).read_text().splitlines(keepends=True)
    work = common.scratch("soak")
    rows: list[dict[str, Any]] = []
    try:
        model = build_random_ecapa_dir(work / "ecapa")
        manifest = work / "data" / "train.tsv"
        with standing(work, model) as services:
            for night, n in enumerate(sizes, 1):
                common.write_lines(manifest, corpus[:n])  # tonight's new utterances appended
                for job, (deployment, out) in JOBS.items():
                    ran = services.run(deployment)
                    fresh = work / "fresh" / job
                    fresh_outputs(job, manifest, model, fresh)
                    diff = same_outputs(job, work / out, fresh) if ran["state"] == "COMPLETED" else "not completed"
                    common.clean_scratch(fresh)
                    rows.append({"section": "run", "night": night, "job": job, "utterances": n, **ran,
                                 "equals_fresh": not diff, "difference": diff})
                rows.append({"section": "night", "night": night, "utterances": n, **services.measure()})
                print(f"[bench] {NAME}: night {night}/{nights} ({n} utterances) done")
    finally:
        common.clean_scratch(work)
    return common.write_result(NAME, quick, rows, make_targets(rows), notes(rows, sizes),
                               plot=lambda path: _plot(rows, path))


def _per_night(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["night"]: r[key] for r in rows if r["section"] == "night"}


def db_growth_per_run(rows: list[dict[str, Any]]) -> float | None:
    """MB of database per deployment run: the least-squares slope from night 3 on (``None`` before)."""
    import numpy as np

    db = {night: mb for night, mb in _per_night(rows, "db_mb").items() if night >= 3}
    if len(db) < 2:
        return None
    slope = np.polyfit(list(db), list(db.values()), 1)[0]
    return float(slope) / len(JOBS)


def make_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets."""
    runs = [r for r in rows if r["section"] == "run"]
    failed = [f"night {r['night']} {r['job']}: {r['difference'] or r['state']}" for r in runs
              if r["state"] != "COMPLETED" or not r["equals_fresh"]]
    targets = [common.target("every run completes with a fresh run's outputs", "all", failed[0] if failed else
                             f"all {len(runs)}", bool(runs) and not failed)]
    for key, what in (("scheduler_rss_mb", "scheduler"), ("worker_rss_mb", "largest worker")):
        per = _per_night(rows, key)
        last = max(per, default=0)
        if 3 in per and last > 3 and per[3] > 0:
            ratio = per[last] / per[3]
            targets.append(common.target(f"{what} RSS after night {last} / after night 3", "≤ 1.10",
                                         round(ratio, 3), ratio <= 1.10))
        else:
            targets.append(common.target(f"{what} RSS after the last night / after night 3", "≤ 1.10",
                                         "fewer than 4 nights", False))
    return targets


def notes(rows: list[dict[str, Any]], sizes: list[int]) -> list[str]:
    growth = db_growth_per_run(rows)
    return [
        f"{len(sizes)} nights, {sizes[0]} utterances the first night, 3 % more each night ({sizes[-1]} the last); "
        "one run of each job a night, through a process worker (one run at a time), on a standing 2-worker "
        "Dask cluster (parallel.env=address); each run's outputs compared with a fresh serial engine run "
        "(statistics rtol 1e-9, features and x-vectors rtol 1e-4).",
        "RSS after each night: the scheduler, the largest worker process, the server's processes together; "
        "database: prefect.db and its WAL. The scheduler runs with the settings docs/deployments.md gives a "
        "standing one (" + ", ".join(f"{k}={v}" for k, v in SCHEDULER_SETTINGS.items()) + "); what it keeps "
        "between runs (objects, spans, event topics, remembered stream messages) is in the JSON's night rows.",
        "Database growth per deployment run (slope from night 3): "
        + (f"{growth:.3f} MB." if growth is not None else "not measured (fewer than 4 nights)."),
    ]


def table(result: dict[str, Any]) -> str:
    """Markdown table: the walls, RSS and database size of nights 1, 3, 10, 20, 30, the last one and
    any night with a run that failed or differed from a fresh run."""
    f = common.fmt
    rows = result["rows"]
    last = max((r["night"] for r in rows if r["section"] == "night"), default=0)
    bad = {r["night"] for r in rows if r["section"] == "run" and (r["state"] != "COMPLETED" or not r["equals_fresh"])}
    shown = [n for n in sorted({*SHOWN, last, *bad}) if n <= last]
    lines = []
    for night in shown:
        runs = {r["job"]: r for r in rows if r["section"] == "run" and r["night"] == night}
        measured = next((r for r in rows if r["section"] == "night" and r["night"] == night), None)
        if measured is None:
            continue
        walls = [f(runs[j]["wall_s"], 1) if j in runs else "–" for j in JOBS]
        same = all(r["equals_fresh"] for r in runs.values())
        lines.append([night, measured["utterances"], *walls, "yes" if same else "**no**",
                      f(measured["scheduler_rss_mb"], 0), f(measured["worker_rss_mb"], 0),
                      f(measured["server_rss_mb"], 0), f(measured["db_mb"], 1)])
    return common.markdown_table(["night", "utterances", "collect-stats s", "x-vectors s", "features s",
                                  "= fresh", "scheduler MB", "worker MB", "server MB", "database MB"],
                                 lines, "rrrrrlrrrr")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = common.pyplot()
    fig, (rss, db) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, label in (("scheduler_rss_mb", "scheduler"), ("worker_rss_mb", "largest worker"),
                       ("server_rss_mb", "server")):
        per = _per_night(rows, key)
        rss.plot(list(per), list(per.values()), marker=".", label=label)
    rss.set(xlabel="night", ylabel="RSS MB", title="memory after each night")
    rss.legend()
    per = _per_night(rows, "db_mb")
    db.plot(list(per), list(per.values()), marker=".")
    db.set(xlabel="night", ylabel="MB", title="Prefect database")
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.script_main(NAME)
