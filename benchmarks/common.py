"""Shared benchmark helpers: data and result locations, repetition statistics, tables, JSON + PNG, machine."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: Generated corpora, Prefect's database and scratch outputs live here, outside the checkout.
DATA = Path(os.environ.get("ESPNET3_BENCH_DATA") or Path.home() / ".cache" / "espnet3-flows" / "bench-data")
#: ``<name>.json`` and ``<name>.png`` go here (the repository's ``benchmarks/results`` by default).
RESULTS = Path(os.environ.get("ESPNET3_BENCH_RESULTS") or REPO / "benchmarks" / "results")

# before prefect is imported anywhere: a private database, no telemetry, quiet flow logs
os.environ.setdefault("PREFECT_HOME", str(DATA / "prefect-home"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Shard size of the collect-stats runs unless a benchmark sweeps it. From bench_overhead's sweep on
#: 2,000 utterances (two full runs, 4 cold flow runs per size): the flow's wall time falls all the
#: way to 256 (pooled medians 20.4 s at 64, 19.3 s at 128, 15.8 s at 256) because every shard task
#: cost ~190 ms of Prefect/Dask work then (~20 ms since: README, "Prefect around the one scheduler"),
#: and a 256-utterance shard is still only ~1–2 s of compute.
#: The price is coarser incremental work: a +10 % append recomputes the partial last shard too
#: (20 % of the cold run's utterances at 256 vs 10.8 % at 64); bench_overhead shows both sizes.
SHARD_SIZE = 256
WORKERS = 2
TRIM_KEY = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
SAMPLE_RATE = 16000


# ---- statistics over repetitions ---------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated measurements."""
    vals = sorted(float(v) for v in values)
    n = len(vals)
    mid = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return {"median": mid, "min": vals[0], "max": vals[-1], "n": n}


def fmt(s: dict[str, float] | float | None, digits: int = 2) -> str:
    """``median [min–max]`` for a spread, a plain number otherwise."""
    if s is None:
        return "–"
    if isinstance(s, dict):
        if s["n"] == 1:
            return f"{s['median']:.{digits}f}"
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"
    return f"{s:.{digits}f}"


class Stopwatch:
    """Wall and process-CPU seconds of a block: ``with Stopwatch() as sw: ...; sw.wall``."""

    def __enter__(self) -> "Stopwatch":
        self._t, self._c = time.perf_counter(), time.process_time()
        self.wall = self.cpu = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self._t
        self.cpu = time.process_time() - self._c


def target(name: str, goal: str, measured: float | str, met: bool) -> dict[str, Any]:
    """One target row of a result JSON."""
    return {"name": name, "target": goal, "measured": measured, "met": bool(met)}


# ---- generated data ---------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def corpus_manifest(n: int) -> Path:
    """A TSV manifest of the first ``n`` utterances of the cached benchmark corpus (2–6 s, 16 kHz).

    ``make_demo_corpus`` is a pure function of its arguments and the first ``n`` utterances do
    not depend on the total, so one ``wav/`` directory serves every size; each size gets its
    own manifest file that never changes once written (stable fingerprints, reusable shards).
    """
    from espnet3_flows.demo import make_demo_corpus

    root = DATA / "corpus"
    manifest = root / f"train_{n}.tsv"
    if manifest.exists():
        return manifest
    with _locked(root / ".lock"):
        if not manifest.exists():
            t0 = time.perf_counter()
            made = make_demo_corpus(root / "gen", n_utts=n, n_speakers=6, min_seconds=2.0, max_seconds=6.0,
                                    seed=0, splits={"train": 1.0})
            lines = made["train"].read_text().splitlines(keepends=True)[:n]
            tmp = manifest.with_suffix(".tmp")
            tmp.write_text("".join(lines))
            tmp.replace(manifest)
            print(f"[bench] generated/checked a {n}-utterance corpus in {time.perf_counter() - t0:.1f} s")
    return manifest


def manifest_paths(manifest: Path) -> list[str]:
    """The audio paths of a TSV manifest, in order."""
    return [line.split("\t")[1] for line in manifest.read_text().splitlines() if line.strip()]


def read_into_page_cache(paths: Sequence[str]) -> float:
    """Read every file once (untimed by callers) and return the seconds it took.

    The kernel rows read the same 2,000 files again and again, so they come from the page
    cache. This VM's kernel reclaims pages left untouched for a while (DAMON, ``kdamond``), so
    a larger corpus read minutes earlier comes back from disk: 14,000 files took 8.2 s the
    first time and 1.9 s the second. Reading them just before a run puts that run on the same
    footing as the kernel it is compared with.
    """
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    return time.perf_counter() - t0


def audio_seconds(paths: Sequence[str]) -> float:
    """Total duration from the WAV headers."""
    import soundfile as sf

    return float(sum(sf.info(p).duration for p in paths))


def scratch(name: str) -> Path:
    """A fresh, empty scratch directory under the data directory."""
    import shutil
    import uuid

    path = DATA / "scratch" / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def clean_scratch(path: Path) -> None:
    """Remove a scratch directory."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ---- process environment ------------------------------------------------------------------
@contextlib.contextmanager
def preserved_environ() -> Iterator[None]:
    """Restore ``os.environ`` after the block.

    A ``LocalCluster``'s nannies run in the driver and write Dask's
    ``distributed.nanny.pre-spawn-environ`` (``MALLOC_TRIM_THRESHOLD_=65536``,
    ``OMP_NUM_THREADS=1``, ...) into the driver's ``os.environ`` before spawning workers, so
    without this every later subprocess (lhotse's pool, the 2-process kernel) would inherit them.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def dask_malloc_trim(enabled: bool) -> Iterator[None]:
    """Dask workers started in the block get ``MALLOC_TRIM_THRESHOLD_=65536`` (Dask's own default,
    ``enabled=True``) or no such variable (``enabled=False``, what the product's clusters do unless
    ``parallel.trim_worker_memory``). Explicit both ways: the product sets this Dask config key
    process-wide whenever it starts a cluster, so a plain ``LocalCluster`` started later in the
    same process would otherwise inherit whatever the last flow chose."""
    import dask
    import distributed  # noqa: F401 - loads its config defaults first, or leaving the block would drop them

    with preserved_environ(), dask.config.set({TRIM_KEY: 65536 if enabled else None}):
        os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
        yield


# ---- Prefect ------------------------------------------------------------------------------
PREFECT: dict[str, Any] = {"start_seconds": None, "url": None}


@contextlib.contextmanager
def prefect_session() -> Iterator[str | None]:
    """A Prefect API for flows and their Dask workers: ``PREFECT_API_URL`` if set, else a private
    local server started once (re-entering inside a session reuses it). Records its start time."""
    from espnet3_flows.orchestration.local_server import prefect_api

    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    t0 = time.perf_counter()
    with prefect_api(needs_server=True) as url:
        PREFECT.update(start_seconds=time.perf_counter() - t0, url=url)
        print(f"[bench] Prefect API server ready in {PREFECT['start_seconds']:.1f} s ({url})")
        yield url


# ---- shard timing from the done records ---------------------------------------------------
def shard_phase(output_dir: Path, split: str = "train") -> dict[str, float]:
    """Span and compute seconds of the shards computed in ``output_dir`` (from ``done`` records).

    A ``done`` record is written last, so its mtime is the shard's end; its ``seconds`` is the
    shard's compute time, so ``mtime - seconds`` is (almost exactly) its start.
    """
    starts, ends, compute, items = [], [], 0.0, 0
    for done in (output_dir / split / "shards").glob("split.*/done"):
        rec = json.loads(done.read_text())
        end = done.stat().st_mtime
        starts.append(end - float(rec["seconds"]))
        ends.append(end)
        compute += float(rec["seconds"])
        items += int(rec["num_items"])
    if not ends:
        return {"span": 0.0, "compute": 0.0, "shards": 0, "items": 0}
    return {"span": max(ends) - min(starts), "compute": compute, "shards": len(ends), "items": items,
            "first_start": min(starts), "last_end": max(ends)}


# ---- tables and results -------------------------------------------------------------------
def markdown_table(header: Sequence[str], lines: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one character per column (``l`` or ``r``)."""
    align = align or "l" + "r" * (len(header) - 1)
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def targets_table(targets: Sequence[dict[str, Any]]) -> str:
    """The targets of a result as a markdown table."""
    lines = []
    for t in targets:
        m = t["measured"]
        lines.append([t["name"], t["target"], f"{m:.3g}" if isinstance(m, float) else m,
                      "**met**" if t["met"] else "**missed**"])
    return markdown_table(["target", "goal", "measured", ""], lines, "llrl")


_MACHINE: dict[str, Any] | None = None


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, load, library versions, commit."""
    global _MACHINE
    if _MACHINE is not None:
        return _MACHINE
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = round(int(line.split()[1]) / 1024 ** 2, 1)
    versions = {}
    for pkg in ("torch", "lhotse", "prefect", "prefect-dask", "distributed", "numpy", "speechbrain"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    _MACHINE = {
        "cpu": cpu,
        "arch": platform.machine(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": mem_gb,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions,
        "commit": commit,
    }
    return _MACHINE


def describe_machine(m: dict[str, Any] | None = None) -> str:
    """One line for tables and the README."""
    m = m or machine()
    v = m["versions"]
    return (f"{m['cpu']}, {m['usable_cores']} cores, {m['memory_gb']} GB RAM, {m['os']}, Python {m['python']}; "
            f"torch {v.get('torch')}, lhotse {v.get('lhotse')}, prefect {v.get('prefect')}, "
            f"distributed {v.get('distributed')}; load average at start {m['load_average_at_start']}")


def command(name: str, quick: bool) -> str:
    """The command line that reproduces a benchmark."""
    return f"python benchmarks/run.py --only {name}" + (" --quick" if quick else "")


def write_result(name: str, quick: bool, rows: list[dict[str, Any]], targets: list[dict[str, Any]],
                 notes: list[str] | str, plot: Callable[[Path], None] | None = None,
                 **extra: Any) -> dict[str, Any]:
    """Write ``RESULTS/<name>.json`` (and ``<name>.png`` with ``plot``); return the result dict."""
    result = {"name": name, "machine": machine(), "command": command(name, quick), "quick": bool(quick),
              "rows": rows, "targets": targets, "notes": notes if isinstance(notes, list) else [notes], **extra}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2, default=_json_default) + "\n")
    if plot is not None:
        figure_path = RESULTS / f"{name}.png"
        try:
            plot(figure_path)
        except Exception as exc:  # noqa: BLE001 - a broken plot must not lose the numbers
            print(f"[bench] {name}: plot failed: {type(exc).__name__}: {exc}")
    return result


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON-able: {type(obj).__name__}")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Lay out, write and close a benchmark figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# ---- monitored subprocess runs: wall time and peak RSS of a process tree ------------------
#: Marks of a Dask worker process in its command line (spawned: ``multiprocessing.spawn``
#: ``spawn_main``; forked from the forkserver: the server's ``multiprocessing.forkserver`` line).
WORKER_MARKERS = ("distributed", "forkserver", "spawn_main", "multiprocessing.spawn", "multiprocessing-fork")
#: Default memory guard of :func:`run_monitored`: the summed RSS of a run's process tree above this
#: kills the run (recorded as ``killed: memory``) before the kernel's OOM killer picks a victim on
#: a machine shared with others. ``$ESPNET3_BENCH_MEM_LIMIT_MB`` overrides it (0: no guard).
MEM_LIMIT_BYTES = int(float(os.environ.get("ESPNET3_BENCH_MEM_LIMIT_MB") or 10_000) * 1024 ** 2)
FLOW_SCRIPTS = {"collect_stats": REPO / "flows" / "collect_stats.py",
                "extract_xvectors": REPO / "flows" / "extract_xvectors.py"}


def proc_memory(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (the kernel's exact peak RSS of the process image) in bytes, from /proc.

    Empty for a zombie (exited, not yet reaped). ``getrusage``'s ``ru_maxrss`` is not used: Linux
    carries the parent's RSS at fork over an ``exec``, so a child would report its parent's size.
    """
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def classify_process(cmdline: Sequence[str], parent_cmdline: Sequence[str] | None, is_root: bool) -> str:
    """``driver`` (the started process), ``worker``, ``forkserver``, ``server`` or ``other``.

    A worker forked from Python's forkserver keeps the server's command line, so a forkserver
    line is the server itself when its parent is not one too, a worker when it is.
    """
    if is_root:
        return "driver"
    cmd = " ".join(cmdline)
    if "resource_tracker" in cmd:
        return "other"
    if "multiprocessing.forkserver" in cmd:  # its argv lists preloaded modules: check before the others
        parent = " ".join(parent_cmdline or ())
        return "worker" if "multiprocessing.forkserver" in parent else "forkserver"
    if any(m in cmd for m in WORKER_MARKERS):
        return "worker"
    if "uvicorn" in cmd or "prefect server" in cmd or "prefect.server" in cmd:
        return "server"
    return "other"


class TreeMonitor:
    """Samples a process and its descendants in a thread: peak RSS per process, by kind.

    Every ``interval`` seconds: the tree (psutil), each process's ``VmRSS``/``VmHWM`` (/proc).
    ``progress`` (a callable returning a count, e.g. finished shards) is polled every
    ``progress_every`` seconds until it reaches ``mark``; the workers' memory at that moment is
    kept (``at_mark``) to compare with their peak at the end. ``mem_limit`` (bytes): the summed RSS
    of the tree above it calls ``on_limit`` once. A light time series (every ``series_every`` s)
    is kept for plots.
    """

    def __init__(self, pid: int, interval: float = 0.2, progress: Callable[[], int] | None = None,
                 mark: int | None = None, progress_every: float = 0.5, mem_limit: int | None = None,
                 on_limit: Callable[[], None] | None = None, series_every: float = 1.0):
        import threading

        import psutil

        self.root = psutil.Process(pid)
        self.interval, self.progress, self.mark = interval, progress, mark
        self.progress_every, self.series_every = progress_every, series_every
        self.mem_limit, self.on_limit = mem_limit, on_limit
        self.kind: dict[int, str] = {}
        self.peak: dict[int, int] = {}
        self.last_rss: dict[int, int] = {}
        self.workers_sum_peak = 0
        self.tree_sum_peak = 0
        self.at_mark: dict[str, Any] | None = None
        self.limit_hit = False
        self.series: list[list[float]] = []  # [t, driver RSS, largest worker RSS, workers' RSS summed]
        self._t0 = time.perf_counter()
        self._procs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tree-monitor")

    def __enter__(self) -> "TreeMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def alive_descendants(self) -> list[Any]:
        """Descendant processes seen so far that still run (psutil checks their start time)."""
        out = []
        for pid, proc in list(self._procs.items()):
            if pid != self.root.pid:
                with contextlib.suppress(Exception):
                    if proc.is_running():
                        out.append(proc)
        return out

    def _classify(self, proc: Any) -> str:
        import psutil

        try:
            cmd = proc.cmdline()
        except psutil.Error:
            return "other"
        parent_cmd = None
        with contextlib.suppress(psutil.Error, AttributeError):
            parent = proc.parent()
            if parent is not None and parent.pid != self.root.pid:
                parent_cmd = parent.cmdline()
        return classify_process(cmd, parent_cmd, proc.pid == self.root.pid)

    def _loop(self) -> None:
        import psutil

        next_progress = next_series = 0.0
        while not self._stop.is_set():
            now = time.perf_counter() - self._t0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            workers_sum = tree_sum = 0
            worker_max = driver = 0
            for proc in procs:
                try:
                    mem = proc_memory(proc.pid)
                except (OSError, ValueError):
                    continue
                if not mem:
                    continue
                if proc.pid not in self.kind:
                    self.kind[proc.pid] = self._classify(proc)
                    self._procs[proc.pid] = proc
                rss = mem.get("VmRSS", 0)
                self.peak[proc.pid] = max(self.peak.get(proc.pid, 0), mem.get("VmHWM", 0), rss)
                self.last_rss[proc.pid] = rss
                tree_sum += rss
                kind = self.kind[proc.pid]
                if kind == "worker":
                    workers_sum += rss
                    worker_max = max(worker_max, rss)
                elif kind == "driver":
                    driver = rss
            self.workers_sum_peak = max(self.workers_sum_peak, workers_sum)
            self.tree_sum_peak = max(self.tree_sum_peak, tree_sum)
            if self.mem_limit and tree_sum > self.mem_limit and not self.limit_hit:
                self.limit_hit = True
                if self.on_limit is not None:
                    self.on_limit()
            if self.progress is not None and self.mark and self.at_mark is None and now >= next_progress:
                next_progress = now + self.progress_every
                with contextlib.suppress(Exception):
                    count = self.progress()
                    if count >= self.mark:
                        w = self._pids("worker")
                        self.at_mark = {"count": count, "t": now,
                                        "worker_peak": max((self.peak[p] for p in w), default=0),
                                        "worker_rss": max((self.last_rss[p] for p in w), default=0),
                                        "driver_peak": self.peak.get(self.root.pid, 0)}
            if now >= next_series:
                next_series = now + self.series_every
                self.series.append([round(now, 2), driver, worker_max, workers_sum])
            self._stop.wait(self.interval)

    def _pids(self, kind: str) -> list[int]:
        return [pid for pid, k in self.kind.items() if k == kind and pid in self.peak]

    def summary(self) -> dict[str, Any]:
        """Peaks (bytes) of the driver, the largest worker, the forkserver; workers seen; the mark."""
        workers = self._pids("worker")
        return {"driver_peak": self.peak.get(self.root.pid, 0),
                "worker_peak": max((self.peak[p] for p in workers), default=0),
                "worker_peaks": sorted((self.peak[p] for p in workers), reverse=True),
                "worker_last_rss": max((self.last_rss[p] for p in workers), default=0),
                "workers_seen": len(workers), "workers_sum_peak": self.workers_sum_peak,
                "forkserver_peak": max((self.peak[p] for p in self._pids("forkserver")), default=0),
                "tree_sum_peak": self.tree_sum_peak, "at_mark": self.at_mark, "series": self.series}


def _kill_tree(proc: Any, targets: Sequence[Any], grace: float = 10.0) -> None:
    """SIGTERM the started process's group and the given descendants, SIGKILL what is left."""
    import signal

    import psutil

    left = list(targets)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # its own session (start_new_session): only what we started
        for child in left:
            with contextlib.suppress(psutil.Error):
                child.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        _, left = psutil.wait_procs(left, timeout=grace)
        if not left:
            return


def run_monitored(cmd: Sequence[str], log_path: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None,
                  timeout_s: float | None = None, mem_limit: int | None = None, interval: float = 0.2,
                  progress: Callable[[], int] | None = None, mark: int | None = None) -> dict[str, Any]:
    """Run ``cmd`` (its stdout and stderr to ``log_path``), sampling its process tree; never raises
    for a failed run.

    Returns ``rc`` (the exit code; negative: killed by that signal), ``killed`` (``None``,
    ``"timeout"`` or ``"memory"``), ``wall_s`` and :meth:`TreeMonitor.summary`'s peaks (bytes).
    ``mem_limit`` defaults to :data:`MEM_LIMIT_BYTES` (0: none).
    """
    import threading

    log_path.parent.mkdir(parents=True, exist_ok=True)
    limit = MEM_LIMIT_BYTES if mem_limit is None else mem_limit
    killed: list[str] = []
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), full_env.get("PYTHONPATH", "")] if p)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(str(c) for c in cmd) + "\n")
        log.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=str(cwd or REPO), env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        lock = threading.Lock()
        monitor: TreeMonitor | None = None

        def over_limit() -> None:
            with lock:
                if not killed:
                    killed.append("memory")
            threading.Thread(target=_kill_tree, args=(proc, monitor.alive_descendants()), daemon=True).start()

        monitor = TreeMonitor(proc.pid, interval=interval, progress=progress, mark=mark,
                              mem_limit=limit or None, on_limit=over_limit)
        with monitor:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with lock:
                    killed.append("timeout")
                _kill_tree(proc, monitor.alive_descendants())
                rc = proc.wait()
            except BaseException:  # Ctrl-C of the benchmark: take the run down with it
                _kill_tree(proc, monitor.alive_descendants())
                raise
            wall = time.perf_counter() - t0
        import psutil

        # descendants still running 10 s after the driver exited (e.g. workers orphaned by a killed
        # driver; a forkserver or resource tracker exits on its own within a moment)
        _, leftovers = psutil.wait_procs(monitor.alive_descendants(), timeout=10)
        stray = _group_alive(proc.pid)
        if leftovers or stray:
            _kill_tree(proc, leftovers, grace=5.0)
    summary = monitor.summary()
    return {"rc": rc, "killed": killed[0] if killed else None, "wall_s": wall, "log": str(log_path),
            "orphans_killed": len(leftovers) + bool(stray and not leftovers), **summary}


def _group_alive(pgid: int, wait: float = 5.0) -> bool:
    """Whether a process of group ``pgid`` (a run's own session) still runs after ``wait`` seconds."""
    deadline = time.perf_counter() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        if time.perf_counter() > deadline:
            return True
        time.sleep(0.1)


def flow_cli(job: str, *args: str) -> list[str]:
    """The command line of a flow's CLI: ``python flows/<job>.py ARGS``."""
    return [sys.executable, str(FLOW_SCRIPTS[job]), *args]


def flow_cli_help(job: str = "collect_stats") -> str:
    """The CLI's ``--help`` text ('' if it fails)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    try:
        return subprocess.run(flow_cli(job, "--help"), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def done_records(output_dir: Path, split: str = "train") -> list[Path]:
    """The shards' ``done`` records of a split (``shards/*/done``)."""
    return list((Path(output_dir) / split / "shards").glob("*/done"))


def count_done_since(output_dir: Path, since: float, split: str = "train") -> int:
    """How many ``done`` records were written at or after the epoch time ``since``."""
    n = 0
    for path in done_records(output_dir, split):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= since:
                n += 1
    return n


def fresh_summary(output_dir: Path, since: float, split: str = "train") -> dict[str, Any] | None:
    """The split's ``summary.json`` if it was written at or after ``since`` (else ``None``)."""
    path = Path(output_dir) / split / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_lines(path: Path, lines: Iterable[str]) -> Path:
    """Write text lines atomically (a temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.writelines(lines)
    tmp.replace(path)
    return path


def mb(value: float | None) -> float | None:
    """Bytes to MB (1024²), rounded; ``None`` stays ``None``."""
    return None if value is None else round(value / 1024 ** 2, 1)
