"""A benchmark's child processes: run a command in its own session, sample its process tree's memory, stop it.

Starting and stopping is ``tests.support.servers.ManagedProcess`` (the tests' servers use it too):
the child runs in its own session with a token in its environment, and stopping signals its whole
family (group, descendants, token carriers), escalating to SIGKILL.

The memory figures of every benchmark (bytes here, MB in result rows), read by :class:`TreeSampler`
from ``/proc/<pid>/status`` every ``interval`` seconds for every process of the tree (psutil):

- a process's **peak** is the largest of its ``VmHWM`` (the kernel's exact high-water mark of its
  RSS) and its sampled ``VmRSS``: exact up to its last sample, missed for a process that lives
  less than one interval;
- **driver peak**: the peak of the started process (the CLI, or a benchmark's child);
- **worker peak**: the largest peak of a Dask worker process (spawned, or forked from the
  forkserver); the forkserver itself is not a worker and has its own **forkserver peak**;
- **workers together**: the largest sampled sum of the workers' RSS; **workers and forkserver
  together**: the same sum with the forkserver's RSS added. Sums of samples can miss spikes
  shorter than the interval, and count pages shared between processes (the libraries the
  forkserver preloaded) once per process;
- **tree**: the sampled sum over the whole tree (driver, workers, forkserver, a private Prefect
  server): the measure of the memory guard.

The CPU figures: **tree CPU** and **server CPU** are exact (:mod:`benchmarks.cpu_time`); **driver
CPU** is the started process's own user + system time at its last sample (up to one interval
short).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from benchmarks import common
from benchmarks.cpu_time import adopting_orphans, children_cpu_s, process_cpu_s, reap

#: Marks of a Dask worker process in its command line (spawned: ``multiprocessing.spawn``
#: ``spawn_main``; forked from the forkserver: the server's ``multiprocessing.forkserver`` line).
WORKER_MARKERS = ("distributed", "forkserver", "spawn_main", "multiprocessing.spawn", "multiprocessing-fork")
#: Default memory guard of :func:`run_monitored`: the summed RSS of a run's process tree above this
#: kills the run (recorded as ``killed: memory``) before the kernel's OOM killer picks a victim on
#: a machine shared with others. ``$ESPNET3_BENCH_MEM_LIMIT_MB`` overrides it (0: no guard).
MEM_LIMIT_BYTES = int(float(os.environ.get("ESPNET3_BENCH_MEM_LIMIT_MB") or 10_000) * 1024 ** 2)
#: How long descendants may outlive the started process (a forkserver or resource tracker exits
#: on its own within a moment) before they count as orphans and are killed.
ORPHAN_GRACE_S = 10.0
#: The notes' sentence on memory, for every benchmark that reports it.
MEMORY_NOTE = ("Memory: driver and worker peaks as benchmarks/process_tree.py defines them (VmHWM of each process, "
               "read every {interval:g} s while it lives; workers are Dask worker processes, not their forkserver). "
               "RSS counts the pages shared with the forkserver (torch, lhotse) in every process.")


def proc_memory(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a process in bytes, from /proc; empty for a zombie.

    ``getrusage``'s ``ru_maxrss`` is not used: Linux carries the parent's RSS at fork over an
    ``exec``, so a child would report its parent's size.
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


class TreeSampler:
    """Samples a process and its descendants in a thread (see the module's docstring for the figures).

    ``progress`` (a callable returning a count, e.g. finished shards) is polled every
    ``progress_every`` seconds until it reaches ``mark``; the workers' memory at that moment is
    kept (``at_mark``) to compare with their peak at the end. ``mem_limit`` (bytes): the tree's
    summed RSS above it calls ``on_limit`` once. A light time series (every ``series_every`` s)
    is kept for plots.
    """

    def __init__(self, pid: int, interval: float = 0.2, progress: Callable[[], int] | None = None,
                 mark: int | None = None, progress_every: float = 0.5, mem_limit: int | None = None,
                 on_limit: Callable[[], None] | None = None, series_every: float = 1.0):
        import psutil

        self.root = psutil.Process(pid)
        self.interval, self.progress, self.mark = interval, progress, mark
        self.progress_every, self.series_every = progress_every, series_every
        self.mem_limit, self.on_limit = mem_limit, on_limit
        self.kind: dict[int, str] = {}
        self.peak: dict[int, int] = {}
        self.last_rss: dict[int, int] = {}
        self.sum_peak = {"workers": 0, "workers_and_forkserver": 0, "tree": 0}
        self.at_mark: dict[str, Any] | None = None
        self.limit_hit = False
        self.series: list[list[float]] = []  # [t, driver RSS, largest worker RSS, workers' RSS summed]
        self.driver_cpu = 0.0  # the started process's own user + system seconds, at its last sample
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tree-sampler")

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

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
            sums = dict.fromkeys(self.sum_peak, 0)
            worker_max = driver = 0
            for proc in procs:
                try:
                    mem = proc_memory(proc.pid)
                except (OSError, ValueError):
                    continue
                if not mem:
                    continue
                kind = self.kind.get(proc.pid)
                if kind in (None, "other"):  # between fork and exec a child still shows its parent's command line
                    kind = self.kind[proc.pid] = self._classify(proc)
                rss = mem.get("VmRSS", 0)
                if proc.pid == self.root.pid:
                    with contextlib.suppress(psutil.Error):
                        times = proc.cpu_times()
                        self.driver_cpu = max(self.driver_cpu, times.user + times.system)
                self.peak[proc.pid] = max(self.peak.get(proc.pid, 0), mem.get("VmHWM", 0), rss)
                self.last_rss[proc.pid] = rss
                sums["tree"] += rss
                if kind in ("worker", "forkserver"):
                    sums["workers_and_forkserver"] += rss
                if kind == "worker":
                    sums["workers"] += rss
                    worker_max = max(worker_max, rss)
                elif kind == "driver":
                    driver = rss
            for key, value in sums.items():
                self.sum_peak[key] = max(self.sum_peak[key], value)
            if self.mem_limit and sums["tree"] > self.mem_limit and not self.limit_hit:
                self.limit_hit = True
                if self.on_limit is not None:
                    self.on_limit()
            if self.progress is not None and self.mark and self.at_mark is None and now >= next_progress:
                next_progress = now + self.progress_every
                with contextlib.suppress(Exception):
                    count = self.progress()
                    if count >= self.mark:
                        self.at_mark = {"count": count, "t": now, "worker_peak": self._largest(self.peak),
                                        "worker_rss": self._largest(self.last_rss),
                                        "driver_peak": self.peak.get(self.root.pid, 0)}
            if now >= next_series:
                next_series = now + self.series_every
                self.series.append([round(now, 2), driver, worker_max, sums["workers"]])
            self._stop.wait(self.interval)

    def _pids(self, kind: str) -> list[int]:
        return [pid for pid, k in self.kind.items() if k == kind and pid in self.peak]

    def _largest(self, values: dict[int, int], kind: str = "worker") -> int:
        return max((values[p] for p in self._pids(kind)), default=0)

    def summary(self) -> dict[str, Any]:
        """The figures of the module's docstring (bytes), the workers seen, the mark and the series."""
        return {"driver_peak": self.peak.get(self.root.pid, 0), "worker_peak": self._largest(self.peak),
                "worker_peaks": sorted((self.peak[p] for p in self._pids("worker")), reverse=True),
                "worker_last_rss": self._largest(self.last_rss), "workers_seen": len(self._pids("worker")),
                "forkserver_peak": self._largest(self.peak, "forkserver"),
                "workers_sum_peak": self.sum_peak["workers"],
                "workers_and_forkserver_sum_peak": self.sum_peak["workers_and_forkserver"],
                "tree_sum_peak": self.sum_peak["tree"], "at_mark": self.at_mark, "series": self.series,
                "driver_cpu_s": self.driver_cpu}


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``extra`` and the checkout importable: a child's environment."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(common.REPO), env.get("PYTHONPATH", "")] if p)
    return env


def run_monitored(cmd: Sequence[str], log_path: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None,
                  timeout_s: float | None = None, mem_limit: int | None = None, interval: float = 0.2,
                  progress: Callable[[], int] | None = None, mark: int | None = None,
                  server_pid: int | None = None) -> dict[str, Any]:
    """Run ``cmd`` (its stdout and stderr to ``log_path``), sampling its process tree; never raises
    for a failed run.

    Returns ``rc`` (the exit code; negative: killed by that signal), ``killed`` (``None``,
    ``"timeout"`` or ``"memory"``), ``wall_s``, ``orphans_killed`` (processes of the run still
    alive :data:`ORPHAN_GRACE_S` after it exited), ``cpu_s`` (the tree's CPU, see the module's
    docstring; ``None`` where orphans cannot be adopted), ``server_cpu_s`` (the CPU the process
    ``server_pid`` used meanwhile, ``None`` without one) and :meth:`TreeSampler.summary`.
    ``mem_limit`` defaults to :data:`MEM_LIMIT_BYTES` (0: none).
    """
    # imported here: a child that reads its own memory with proc_memory stays as light as before
    from tests.support.servers import ManagedProcess

    log_path.unlink(missing_ok=True)  # one run's output per log
    limit = MEM_LIMIT_BYTES if mem_limit is None else mem_limit
    killed: list[str] = []
    proc = ManagedProcess([str(c) for c in cmd], name=log_path.stem, log_path=log_path, env=child_env(env),
                          cwd=str(cwd or common.REPO))
    lock = threading.Lock()

    def over_limit() -> None:
        with lock:
            if not killed:
                killed.append("memory")
        threading.Thread(target=proc.stop, daemon=True).start()

    import psutil

    with adopting_orphans() as adopted:
        before = {c.pid for c in psutil.Process().children()}  # not the run's: never waited for here
        cpu0, server0 = children_cpu_s(), process_cpu_s(server_pid)
        t0 = time.perf_counter()
        proc.start()
        with TreeSampler(proc.pid, interval=interval, progress=progress, mark=mark, mem_limit=limit or None,
                         on_limit=over_limit) as sampler:
            try:
                rc = proc.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with lock:
                    killed.append("timeout")
                proc.stop()
                rc = proc.popen.wait()
            except BaseException:  # Ctrl-C of the benchmark: take the run down with it
                proc.stop()
                raise
            wall = time.perf_counter() - t0
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while (left := proc.family()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            proc.stop(((signal.SIGTERM, 5.0),))
        server1 = process_cpu_s(server_pid)
        deadline = time.monotonic() + ORPHAN_GRACE_S  # the run's processes adopted here: waited for
        while (reap(c.pid for c in psutil.Process().children() if c.pid not in before)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        cpu = children_cpu_s() - cpu0
    return {"rc": rc, "killed": killed[0] if killed else None, "wall_s": wall, "log": str(log_path),
            "orphans_killed": len(left), "cpu_s": cpu if adopted else None,
            "server_cpu_s": None if server0 is None or server1 is None else server1 - server0, **sampler.summary()}


def run_checked(cmd: Sequence[str], log_path: Path, **kwargs: Any) -> dict[str, Any]:
    """:func:`run_monitored`, raising with the log's tail when the run failed or left processes behind."""
    res = run_monitored(cmd, log_path, **kwargs)
    if res["rc"] != 0 or res["killed"] or res["orphans_killed"]:
        tail = "\n".join(Path(res["log"]).read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit code {res['rc']}, killed {res['killed']}, "
                           f"{res['orphans_killed']} process(es) left behind; log {res['log']}:\n{tail}")
    return res


def flow_cli(job: str, *args: str) -> list[str]:
    """The command line of a flow's CLI: ``python flows/<job>.py ARGS``."""
    return [sys.executable, str(common.REPO / "flows" / f"{job}.py"), *args]


def flow_cli_help(job: str = "collect_stats") -> str:
    """The CLI's ``--help`` text ('' if it fails)."""
    try:
        return subprocess.run(flow_cli(job, "--help"), cwd=common.REPO, env=child_env(), capture_output=True,
                              text=True, timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def run_timeout_s(quick: bool) -> float:
    """How long one CLI run of ``scale`` or ``corpus`` may take (``$ESPNET3_BENCH_RUN_TIMEOUT_S``)."""
    return float(os.environ.get("ESPNET3_BENCH_RUN_TIMEOUT_S") or (600 if quick else 2400))


def measured_run(bench: str, label: str, cmd: list[str], out: Path, quick: bool,
                 mark: int | None = None) -> dict[str, Any]:
    """One monitored CLI run writing into ``out``: a result row (memory in MB, shards computed from
    the run's ``summary.json``, else from the ``done`` records it wrote); its log goes to
    ``$ESPNET3_BENCH_DATA/logs/<bench>/``. ``mark``: see :class:`TreeSampler`."""
    since = time.time()
    log = common.DATA / "logs" / bench / f"{label.replace('%', 'pct').replace('+', 'plus')}.log".replace(" ", "_")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {bench}: {label} ...", flush=True)
    res = run_monitored(cmd, log, timeout_s=run_timeout_s(quick), mark=mark,
                        progress=lambda: len(common.done_results(out, since)), server_pid=common.PREFECT["pid"])
    summary = common.fresh_summary(out, since) or {}
    new_done = len(common.done_results(out, since))
    at_mark = res["at_mark"] or {}
    mb = common.mb
    row = {
        "run": label, "rc": res["rc"], "killed": res["killed"], "ok": res["rc"] == 0 and not res["killed"],
        "wall_s": round(res["wall_s"], 2), "log": res["log"], "orphans_killed": res["orphans_killed"],
        "shards_computed": summary.get("shards_computed", new_done), "shards_cached": summary.get("shards_cached"),
        "done_records_written": new_done, "summary_utterances": summary.get("utterances"),
        "driver_peak_mb": mb(res["driver_peak"]), "driver_peak_bytes": res["driver_peak"],
        "worker_peak_mb": mb(res["worker_peak"]), "worker_peaks_mb": [mb(v) for v in res["worker_peaks"]],
        "workers_seen": res["workers_seen"], "forkserver_peak_mb": mb(res["forkserver_peak"]),
        "workers_sum_peak_mb": mb(res["workers_sum_peak"]), "worker_mark": mark,
        "worker_peak_at_mark_mb": mb(at_mark.get("worker_peak")),
        "worker_rss_at_mark_mb": mb(at_mark.get("worker_rss")),
        "worker_rss_end_mb": mb(res["worker_last_rss"]),
        "mark_reached_s": round(at_mark["t"], 2) if at_mark else None, "series": res["series"],
        "cpu_s": _rounded(res["cpu_s"]), "server_cpu_s": _rounded(res["server_cpu_s"]),
        "driver_cpu_s": _rounded(res["driver_cpu_s"]),
    }
    state = "ok" if row["ok"] else f"FAILED rc={res['rc']} killed={res['killed']} (log {log})"
    print(f"[bench] {bench}: {label}: {row['wall_s']:.1f} s, computed {row['shards_computed']}, "
          f"driver {row['driver_peak_mb']} MB, worker {row['worker_peak_mb']} MB, {state}", flush=True)
    return row


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def cli_runs_note(bench: str, quick: bool) -> str:
    """The notes' sentence on :func:`measured_run`'s memory figures, limits and logs."""
    return (MEMORY_NOTE.format(interval=0.2) + f" A run whose process tree passes {MEM_LIMIT_BYTES / 1024 ** 3:.1f} GB "
            f"is killed (ESPNET3_BENCH_MEM_LIMIT_MB) and recorded, as is one past {run_timeout_s(quick):.0f} s "
            f"(ESPNET3_BENCH_RUN_TIMEOUT_S). Logs of every run: {common.DATA / 'logs' / bench}.")


def run_failed(row: dict[str, Any] | None) -> str | None:
    """Why a measured run's row cannot back a target (``None``: it can)."""
    if row is None:
        return "not run"
    if row.get("skipped"):
        return f"not measured ({row['skipped']})"
    if not row.get("ok"):
        return f"failed (rc {row.get('rc')}{', killed: ' + row['killed'] if row.get('killed') else ''})"
    return None


def run_status(row: dict[str, Any]) -> str:
    """A measured run's status cell."""
    if row.get("skipped"):
        return f"not measured: {row['skipped']}"
    if row.get("ok"):
        return "ok"
    return f"rc {row.get('rc')}" + (f", killed: {row['killed']}" if row.get("killed") else "")
