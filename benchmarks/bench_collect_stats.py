"""Benchmark: collect-stats throughput of the kernel, lhotse's pipeline, our engine and our Prefect flow.

All methods compute 80-bin lhotse ``Fbank`` (dither 0) features of the same generated
utterances (2–6 s, 16 kHz; 2,000 of them, 200 with ``--quick``) and their global statistics:

- **kernel**: one process, one torch thread, a plain loop ``soundfile.read`` → lhotse's
  ``Fbank.extract`` → float64 sum / sum² — the work itself, nothing else (the reference of
  the collect-stats speed target). "2 × kernel" is the ideal for 2 cores; the same loop with
  the job's ``FastFbank`` (lhotse's features to float32 rounding, ~2x faster) is shown too;
  "kernel, 2 processes" runs that loop on half the data in each of 2 spawned processes
  (timed after both processes are warm) to show what this shared machine really gives.
- **lhotse**: ``Recording.from_file`` → ``CutSet.compute_and_store_features(num_jobs=2)`` →
  ``compute_global_feature_stats`` (features are written to disk and read back). Run as
  shipped (spawned children default to one torch thread per core) and with
  ``OMP_NUM_THREADS=1`` in the children (lhotse's own advice for ``num_jobs > 1``).
- **engine**: ``CollectStatsRunner.run`` without Prefect, ``parallel.env=serial`` in this
  process, and on a ``LocalCluster(n_workers=2, threads_per_worker=1)``: cluster start,
  first run (workers import torch/lhotse and build the env) and a second run on warm workers.
- **flow**: ``run_job("collect_stats", ...)`` with ``parallel: {env: local, n_workers: 2}``,
  a fresh ``output_dir`` each time, so it includes cluster start, planning, Prefect task
  submission, merge and artifacts. "Cold" stops the workers' forkserver first, so the run pays
  its imports as a fresh ``python flows/collect_stats.py`` process does; "repeat run in the same
  process" starts with the forkserver's imports done, as a second ``run_job`` call in a notebook
  does. The Prefect API server is started once per session and reported separately.

End-to-end throughput is utterances / wall time. Steady-state throughput is utterances / the
shard phase (first shard start to last shard end, from the ``done`` records), i.e. without
start-up and merge; "compute-only" is utterances / (sum of shard compute seconds / 2 workers).

Run ``python -m benchmarks --only collect_stats [--quick]``.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from benchmarks import common

NAME = "collect_stats"
FLOW = "flow (Prefect + LocalCluster 2×1), cold"
FLOW_WARM = "flow (Prefect + LocalCluster 2×1), repeat run in the same process (forkserver warm)"
CLUSTER = "engine, LocalCluster 2×1"
TRIM_ON = " [MALLOC_TRIM_THRESHOLD_=65536: Dask's default]"
TRIM_OFF = " [MALLOC_TRIM_THRESHOLD_ unset: as the product's clusters]"
FLOW_TRIM = " [parallel.options.trim_worker_memory=true]"
FLOW_SPAWN = " [parallel.options.start_method=spawn]"
KERNEL_FAST = "kernel (1 process), the job's FastFbank"
KERNEL2_FAST = "kernel, 2 processes (measured), the job's FastFbank"
N_LARGE = 16000
FLOW_LARGE = f"flow (Prefect + LocalCluster 2×1), cold, {N_LARGE:,} utterances"
NUM_MEL_BINS = 80

_EXTRACTOR: Any = None


def _extractor() -> Any:
    global _EXTRACTOR
    if _EXTRACTOR is None:
        import torch
        from lhotse import Fbank, FbankConfig

        torch.set_num_threads(1)
        _EXTRACTOR = Fbank(FbankConfig(num_mel_bins=NUM_MEL_BINS, dither=0.0))
    return _EXTRACTOR


def kernel_loop(paths: Sequence[str], fast: bool = False) -> dict[str, Any]:
    """The work itself: read, fbank, float64 sum and sum of squares; one process, one thread.

    Args:
        fast: Compute the fbank with the job's ``FastFbank`` (same features to float32
            rounding) instead of lhotse's ``Fbank.extract``.
    """
    import numpy as np
    import soundfile as sf

    from espnet3_flows.frontends.fbank import FastFbank

    lhotse_fbank = _extractor()
    extract = FastFbank(lhotse_fbank) if fast else (lambda wave: lhotse_fbank.extract(wave, common.SAMPLE_RATE))
    total = np.zeros(NUM_MEL_BINS)
    total_sq = np.zeros(NUM_MEL_BINS)
    frames = 0
    with common.Stopwatch() as sw:
        for path in paths:
            wave, _ = sf.read(path, dtype="float32")
            feats = np.asarray(extract(wave), dtype=np.float64)
            total += feats.sum(axis=0)
            total_sq += np.square(feats).sum(axis=0)
            frames += feats.shape[0]
    return {"wall": sw.wall, "cpu": sw.cpu, "frames": frames, "mean": total / frames}


def _kernel_warm(_: int) -> int:
    _extractor()
    time.sleep(0.2)  # both workers get one warm-up task
    return os.getpid()


def _kernel_chunk(job: tuple[Sequence[str], bool]) -> float:
    return kernel_loop(*job)["wall"]


def kernel_two_processes(paths: Sequence[str], fast: bool = False) -> float:
    """Wall seconds of the kernel on 2 warm spawned processes, half of the data each.

    Args:
        fast: Use the job's ``FastFbank`` (see :func:`kernel_loop`).
    """
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(common.WORKERS) as pool:
        pool.map(_kernel_warm, range(common.WORKERS), chunksize=1)
        halves = [(paths[k::common.WORKERS], fast) for k in range(common.WORKERS)]
        t0 = time.perf_counter()
        pool.map(_kernel_chunk, halves, chunksize=1)
        return time.perf_counter() - t0


def lhotse_pipeline(paths: Sequence[str], ids: Sequence[str], workdir: Path, one_thread: bool) -> dict[str, Any]:
    """lhotse end to end: recordings from files, features stored by 2 processes, global stats."""
    from lhotse import CutSet, Fbank, FbankConfig, Recording, RecordingSet
    from lhotse.features.io import NumpyFilesWriter

    saved = {k: os.environ.pop(k, None) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if one_thread:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    try:
        t0 = time.perf_counter()
        recordings = RecordingSet.from_recordings(Recording.from_file(p, recording_id=i) for p, i in zip(paths, ids, strict=True))
        cuts = CutSet.from_manifests(recordings=recordings)
        t1 = time.perf_counter()
        extractor = Fbank(FbankConfig(num_mel_bins=NUM_MEL_BINS, dither=0.0))
        with_feats = cuts.compute_and_store_features(extractor=extractor, storage_path=str(workdir / "feats"),
                                                     num_jobs=common.WORKERS, storage_type=NumpyFilesWriter,
                                                     progress_bar=False)
        t2 = time.perf_counter()
        stats = with_feats.compute_global_feature_stats()
        t3 = time.perf_counter()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    return {"wall": t3 - t0, "manifest": t1 - t0, "features": t2 - t1, "stats": t3 - t2,
            "mean": stats["norm_means"]}


def engine_config(manifest: Path, output_dir: Path, shard_size: int, env: str = "serial") -> Any:
    """The collect-stats config the engine runs use."""
    from espnet3_flows.parallel.parallel_config import ParallelConfig
    from espnet3_flows.stats.job import CollectStatsConfig

    return CollectStatsConfig(manifests={"train": str(manifest)}, output_dir=str(output_dir), shard_size=shard_size,
                              parallel=ParallelConfig(env=env, n_workers=common.WORKERS, options={"inline_shards": 0}))


def engine_run(manifest: Path, n: int, shard_size: int, client: Any = None, output_dir: Path | None = None) -> dict[str, Any]:
    """One engine run (serial without a client); a fresh output directory unless one is given."""
    from espnet3_flows.stats.job import CollectStatsRunner

    out = output_dir or common.scratch("engine")
    cfg = engine_config(manifest, out, shard_size, "serial" if client is None else "local")
    t0 = time.perf_counter()
    runner = CollectStatsRunner(cfg, "train")
    outcome = runner.run(client=client, parallel=cfg.parallel if client is None else None, progress=False)
    wall = time.perf_counter() - t0
    phase = common.shard_phase(out)
    result = {"wall": wall, "computed": outcome.computed, "cached": outcome.cached, "shards": len(outcome.shards),
              "phase": phase, "mean": stats_mean(out)}
    if output_dir is None:
        common.clean_scratch(out)
    return result


def stats_mean(output_dir: Path) -> Any:
    """The feature mean of a finished run, from its ``feats_stats.npz``."""
    import numpy as np

    with np.load(output_dir / "train" / "feats_stats.npz") as stats:
        return stats["sum"] / stats["count"]


def start_cluster(trim: bool) -> tuple[Any, Any, float]:
    """A plain 2-worker, 1-thread process LocalCluster and its client; returns them and the start seconds.

    Args:
        trim: Whether the workers get Dask's default ``MALLOC_TRIM_THRESHOLD_=65536`` (see
            :func:`common.dask_malloc_trim`).
    """
    from distributed import Client, LocalCluster

    t0 = time.perf_counter()
    with common.dask_malloc_trim(trim):
        cluster = LocalCluster(n_workers=common.WORKERS, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
        client.wait_for_workers(common.WORKERS)
    return cluster, client, time.perf_counter() - t0


def flow_config(manifest: Path, output_dir: Path, shard_size: int, parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain config of a flow run on a local 2-worker cluster (also for a single shard: what is
    measured is the cluster); ``parallel`` adds ``parallel.*`` keys."""
    options = {"inline_shards": 0, **(parallel or {}).get("options", {})}  # theirs beside inline_shards: 0
    parallel = {"env": "local", "n_workers": common.WORKERS, **(parallel or {}), "options": options}
    return {"manifests": {"train": str(manifest)}, "output_dir": str(output_dir), "shard_size": shard_size,
            "parallel": parallel}


def flow_run(manifest: Path, shard_size: int, output_dir: Path | None = None, parallel: dict[str, Any] | None = None,
             warm_process: bool = False) -> dict[str, Any]:
    """One ``run_job`` call; a fresh (cold) output directory unless one is given.

    Args:
        parallel: Extra ``parallel.*`` keys (e.g. ``{"options": {"start_method": "spawn"}}``).
        warm_process: Run as a second run in this process would: the workers' forkserver is
            already running with its modules imported. Otherwise it is stopped first, so the
            run pays its start as a fresh process (``python flows/collect_stats.py``) does.
    """
    from espnet3_flows import timeline
    from espnet3_flows.orchestration.flows import run_job
    from espnet3_flows.parallel.forkserver import stop_forkserver

    if warm_process:
        warm_forkserver()
    else:
        stop_forkserver()
    out = output_dir or common.scratch("flow")
    events = out.with_name(f"{out.name}-timeline-{time.time_ns()}.jsonl")
    os.environ[timeline.VAR] = str(events)
    try:
        t0, epoch0 = time.perf_counter(), time.time()
        summary = run_job("collect_stats", flow_config(manifest, out, shard_size, parallel), progress=False)["train"]
        wall = time.perf_counter() - t0
        epoch1 = time.time()
    finally:
        os.environ.pop(timeline.VAR, None)
    phase = common.shard_phase(out)
    shards = {"shards_start": phase["first_start"], "shards_end": phase["last_end"]} if phase["shards"] else {}
    marks = common.timeline_events(events, epoch0, start=epoch0, end=epoch1, **shards)
    events.unlink(missing_ok=True)
    result = {"wall": wall, "computed": summary["shards_computed"], "cached": summary["shards_cached"],
              "shards": summary["shards"], "utterances": summary["utterances"], "phase": phase, "out": out,
              "timeline": common.phases(marks, FLOW_PHASES)}
    if output_dir is None:
        result["mean"] = stats_mean(out)
        common.clean_scratch(out)
    return result


def warm_forkserver() -> None:
    """Start the collect-stats workers' forkserver (if needed) and wait until its imports are done."""
    import multiprocessing

    from espnet3_flows.orchestration.jobs import get_job
    from espnet3_flows.orchestration.task_runner import prestart_workers
    from espnet3_flows.parallel.parallel_config import ParallelConfig

    prestart_workers(ParallelConfig(env="local"), get_job("collect_stats").worker_modules)
    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
    child.start()  # the server forks only once its preload imports finished
    child.join()


#: Where a flow run's wall time goes: the driver's timeline (:mod:`espnet3_flows.timeline`)
#: and the shards' first start and last end from their done records (:func:`common.shard_phase`)
FLOW_PHASES = (("plan + flow start", ("start",), "flow_started"),
               ("cluster start + worker envs (imports, model/dataset)", ("flow_started",), "shards_start"),
               ("shard phase", ("shards_start",), "shards_end"), ("merge + publish", ("shards_end",), "shards_merged"),
               ("flow end + cluster close", ("shards_merged",), "end"))
TIMELINE = tuple(name for name, _, _ in FLOW_PHASES)


class _Methods:
    """The measured methods over one corpus, each recording its samples (and means, timelines)."""

    def __init__(self, manifest: Path, manifest_large: Path | None, shard_size: int):
        self.manifest, self.manifest_large, self.shard_size = manifest, manifest_large, shard_size
        lines = [line.split("\t") for line in manifest.read_text().splitlines()]
        self.ids, self.paths = [x[0] for x in lines], [x[1] for x in lines]
        self.n = len(lines)
        self.samples: dict[str, list[dict[str, Any]]] = {}
        self.timelines: dict[str, list[dict[str, float]]] = {}
        self.means: dict[str, Any] = {}

    def record(self, method: str, **values: Any) -> None:
        self.samples.setdefault(method, []).append(values)

    def kernel(self, fast: bool) -> None:
        r = kernel_loop(self.paths, fast=fast)
        self.means["kernel, FastFbank" if fast else "kernel"] = r["mean"]
        self.record(KERNEL_FAST if fast else "kernel (1 process)", wall=r["wall"], cpu=r["cpu"])

    def kernel2(self, fast: bool) -> None:
        self.record(KERNEL2_FAST if fast else "kernel, 2 processes (measured)",
                    wall=kernel_two_processes(self.paths, fast=fast))

    def lhotse(self, one_thread: bool) -> None:
        import numpy as np

        work = common.scratch("lhotse")
        r = lhotse_pipeline(self.paths, self.ids, work, one_thread=one_thread)
        common.clean_scratch(work)
        if one_thread:
            self.means["lhotse"] = np.asarray(r["mean"], dtype=np.float64)
        self.record("lhotse, 2 jobs, OMP_NUM_THREADS=1" if one_thread else "lhotse, 2 jobs, as shipped",
                    wall=r["wall"], manifest=r["manifest"], features=r["features"], stats=r["stats"])

    def serial(self) -> None:
        r = engine_run(self.manifest, self.n, self.shard_size)
        self.means["engine"] = r["mean"]
        self.record("engine, serial", wall=r["wall"], span=r["phase"]["span"], compute=r["phase"]["compute"])

    def cluster(self, trim: bool) -> None:
        suffix = TRIM_ON if trim else TRIM_OFF
        cluster, client, start = start_cluster(trim)
        try:
            cold = engine_run(self.manifest, self.n, self.shard_size, client=client)
            warm = engine_run(self.manifest, self.n, self.shard_size, client=client)
        finally:
            client.close()
            cluster.close()
        for label, r in ((f"{CLUSTER}, first run{suffix}", cold), (f"{CLUSTER}, warm workers{suffix}", warm)):
            self.record(label, wall=r["wall"], cluster_start=start, span=r["phase"]["span"],
                        compute=r["phase"]["compute"])

    def flow(self, suffix: str = "", parallel: dict[str, Any] | None = None) -> None:
        label = FLOW + suffix
        r = flow_run(self.manifest, self.shard_size, parallel=parallel)
        self.timelines.setdefault(label, []).append(r["timeline"])
        self.means["flow" + suffix] = r["mean"]
        self.record(label, wall=r["wall"], span=r["phase"]["span"], compute=r["phase"]["compute"])

    def flow_warm(self) -> None:
        r = flow_run(self.manifest, self.shard_size, warm_process=True)
        self.timelines.setdefault(FLOW_WARM, []).append(r["timeline"])
        self.means["flow, warm process"] = r["mean"]
        self.record(FLOW_WARM, wall=r["wall"], span=r["phase"]["span"], compute=r["phase"]["compute"])

    def flow_large(self) -> None:
        warm_read = common.read_into_page_cache(common.manifest_paths(self.manifest_large))
        r = flow_run(self.manifest_large, self.shard_size)
        self.record(FLOW_LARGE, n=N_LARGE, wall=r["wall"], span=r["phase"]["span"], compute=r["phase"]["compute"],
                    page_cache_read=warm_read)

    def chosen(self, quick: bool) -> list[Callable[[], None]]:
        """The methods of a run: --quick is a smoke test (one lhotse and one Dask variant)."""
        methods = [functools.partial(self.kernel, False), functools.partial(self.kernel, True),
                   functools.partial(self.kernel2, False), functools.partial(self.kernel2, True),
                   functools.partial(self.lhotse, True), self.serial, functools.partial(self.cluster, False),
                   self.flow]
        if not quick:
            methods += [functools.partial(self.lhotse, False), functools.partial(self.cluster, True),
                        functools.partial(self.flow, FLOW_TRIM, {"options": {"trim_worker_memory": True}}),
                        functools.partial(self.flow, FLOW_SPAWN, {"options": {"start_method": "spawn"}}),
                        self.flow_warm, self.flow_large]
        return methods


def run(quick: bool = False) -> dict[str, Any]:
    """Measure every method, write ``collect_stats.json`` / ``.png`` and return the result."""
    from benchmarks.collect_stats_report import notes, plot, rows_of, targets, timeline_of

    from espnet3_flows.stats.job import CollectStatsConfig

    n = 200 if quick else 2000
    reps = 1 if quick else 3
    shard_size = CollectStatsConfig.shard_size  # the product's default
    m = _Methods(common.corpus_manifest(n), None if quick else common.corpus_manifest(N_LARGE), shard_size)
    audio = common.audio_seconds(m.paths)
    with common.prefect_session():
        kernel_loop(m.paths[:5])  # imports and extractor
        methods = m.chosen(quick)
        for rep in range(reps):
            k = rep % len(methods)
            for method in methods[k:] + methods[:k]:  # rotate so slow drifts of the load hit every method
                with common.preserved_environ():
                    method()
            print(f"[bench] {NAME}: repetition {rep + 1}/{reps} done")
    rows = rows_of(m.samples, n, audio)
    by = {r["method"]: r for r in rows}
    return common.write_result(NAME, quick, rows, targets(by, n), notes(by, n, audio, reps, shard_size, m.means),
                               plot=lambda p: plot(rows, p), shard_size=shard_size,
                               flow_timeline=timeline_of(m.timelines))


def table(result: dict[str, Any]) -> str:
    """The markdown tables of a result (:func:`benchmarks.collect_stats_report.table`)."""
    from benchmarks.collect_stats_report import table as report_table

    return report_table(result)


if __name__ == "__main__":
    common.script_main(NAME)
