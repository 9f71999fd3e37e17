"""Shared benchmark helpers: data and result locations, repetition statistics, tables, JSON + PNG, machine."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

from benchmarks.charts import bar_chart, pyplot, save_figure  # noqa: F401 - common's names for the benchmarks
from benchmarks.machine import describe_machine, machine  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
# the benchmarks' own child processes (``python -m benchmarks.<module>``) find this package and
# the checkout wherever they run
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

#: Generated corpora, Prefect's database and scratch outputs live here, outside the checkout.
DATA = Path(os.environ.get("ESPNET3_BENCH_DATA") or Path.home() / ".cache" / "espnet3-flows" / "bench-data")
#: ``<name>.json`` and ``<name>.png`` go here (the repository's ``benchmarks/results`` by default).
RESULTS = Path(os.environ.get("ESPNET3_BENCH_RESULTS") or REPO / "benchmarks" / "results")

# before prefect is imported anywhere: a private database, no telemetry, quiet flow logs
os.environ.setdefault("PREFECT_HOME", str(DATA / "prefect-home"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

def module_command(module: str) -> list[str]:
    """The command line that runs the benchmark module ``module`` (``benchmarks.bench_x``) as a
    script in a child process."""
    return [sys.executable, "-m", module]


#: Shard size of the collect-stats runs unless a benchmark sweeps it: 2,000 utterances make 8 shards.
#: From bench_overhead's sweep (results/overhead.json, run before the per-shard fixes of "Prefect
#: around the one scheduler"): the flow's cold wall 11.1 s at 64, 10.2 s at 128, 9.7 s at 256, the
#: only size within 5 % of the best. A shard now costs the flow ~10 ms of wall time more than the
#: engine (``scale``, benchmarks/README.md) against ~1–2 s of compute at 256. The price is coarser
#: incremental work: a +10 % append recomputes the partial last shard too (20 % of the cold run's
#: utterances at 256 vs 10.8 % at 64).
SHARD_SIZE = 256
WORKERS = 2
SAMPLE_RATE = 16000


# ---- statistics over repetitions ---------------------------------------------------------
def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated measurements."""
    vals = sorted(float(v) for v in values)
    n = len(vals)
    mid = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return {"median": mid, "min": vals[0], "max": vals[-1], "n": n}


def fmt(s: dict[str, float] | float | int | str | None, digits: int = 2) -> str:
    """``median [min–max]`` for a spread, ``digits`` decimals for a float, "–" for ``None``, else ``str``."""
    if s is None:
        return "–"
    if isinstance(s, dict):
        if s["n"] == 1:
            return f"{s['median']:.{digits}f}"
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"
    return f"{s:.{digits}f}" if isinstance(s, float) else str(s)


class Stopwatch:
    """Wall and process-CPU seconds of a block: ``with Stopwatch() as sw: ...; sw.wall``."""

    def __enter__(self) -> Stopwatch:
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
def locked(path: Path) -> Iterator[None]:
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
    from espnet3_flows.inputs.demo import make_demo_corpus

    root = DATA / "corpus"
    manifest = root / f"train_{n}.tsv"
    if manifest.exists():
        return manifest
    with locked(root / ".lock"):
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


def fingerprint_as_planner(paths: Sequence[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """The fingerprints of ``paths``, taken as the planner takes them: one
    :class:`~espnet3_flows.inputs.fingerprints.Fingerprinter`, blocks of the planner's size."""
    from espnet3_flows.inputs.fingerprints import Fingerprinter
    from espnet3_flows.inputs.planner import FINGERPRINT_BLOCK as block

    out: list[str] = []
    with Fingerprinter("stat", storage_options) as fp:
        for i in range(0, len(paths), block):
            out += fp.fingerprints(paths[i:i + block])
    return out


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
    ``enabled=True``) or no such variable (``enabled=False``), as the product's clusters do with
    ``parallel.options.trim_worker_memory`` (its ``worker_settings``): a plain ``LocalCluster``
    measured beside the product's."""
    import distributed  # noqa: F401 - loads its config defaults first, or leaving the block would drop them

    from espnet3_flows.parallel.backends.cluster_setup import worker_settings

    with preserved_environ(), worker_settings(enabled):
        yield


# ---- Prefect ------------------------------------------------------------------------------
#: This process's Prefect API: start time, URL, and a private server's pid (its CPU is counted)
PREFECT: dict[str, Any] = {"start_seconds": None, "url": None, "pid": None}


@contextlib.contextmanager
def prefect_session() -> Iterator[str | None]:
    """A Prefect API for flows and their Dask workers: ``PREFECT_API_URL`` if set, else a private
    local server started once (re-entering inside a session reuses it). Records its start time."""
    from espnet3_flows.orchestration.local_server import LocalPrefectServer, prefect_api

    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    t0 = time.perf_counter()
    server = LocalPrefectServer()
    with prefect_api(needs_server=True, server=server) as url:
        PREFECT.update(start_seconds=time.perf_counter() - t0, url=url,
                       pid=server.process.pid if server.process is not None else None)
        print(f"[bench] Prefect API server ready in {PREFECT['start_seconds']:.1f} s ({url})")
        try:
            yield url
        finally:
            PREFECT["pid"] = None


@contextlib.contextmanager
def running_server(quick: bool) -> Iterator[str]:
    """The API URL for a benchmark's "running server" rows: a private server started for them (the
    figures are this machine's alone), or with ``--quick`` (which checks that the benchmark runs,
    not its figures) ``PREFECT_API_URL`` when one is set: the test suite's server."""
    inherited = os.environ.get("PREFECT_API_URL")
    if quick and inherited:
        yield inherited
        return
    from espnet3_flows.orchestration.local_server import LocalPrefectServer

    server = LocalPrefectServer()
    server.start()
    try:
        yield server.api_url
    finally:
        server.stop()


# ---- a run's outputs: done records, summary, timeline --------------------------------------
def done_results(output_dir: Path, since: float | None = None, split: str = "train") -> list[tuple[float, Any]]:
    """(mtime, :class:`~espnet3_flows.parallel.results.ShardResult`) of each ``done`` record of a split
    written at or after the epoch time ``since`` (every one without it); unreadable ones are skipped."""
    from espnet3_flows.parallel.results import ShardResult

    out = []
    for path in (Path(output_dir) / split / "shards").glob("split.*/done"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            mtime = path.stat().st_mtime
            if since is None or mtime >= since:
                out.append((mtime, ShardResult.from_dict(json.loads(path.read_text()))))
    return out


def shard_phase(output_dir: Path, split: str = "train") -> dict[str, float]:
    """Span and compute seconds of the shards computed in ``output_dir`` (from ``done`` records).

    A ``done`` record is written last, so its mtime is the shard's end; its ``seconds`` is the
    shard's compute time, so ``mtime - seconds`` is (almost exactly) its start.
    """
    done = done_results(output_dir, split=split)
    if not done:
        return {"span": 0.0, "compute": 0.0, "shards": 0, "items": 0}
    first, last = min(end - r.seconds for end, r in done), max(end for end, _ in done)
    return {"span": last - first, "compute": sum(r.seconds for _, r in done), "shards": len(done),
            "items": sum(r.shard.num_items for _, r in done), "first_start": first, "last_end": last}


def fresh_summary(output_dir: Path, since: float, split: str = "train") -> dict[str, Any] | None:
    """The split's ``summary.json`` if it was written at or after ``since`` (else ``None``)."""
    path = Path(output_dir) / split / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def timeline_events(path: Path, t0: float, **more: float) -> dict[str, float]:
    """Seconds since the epoch time ``t0`` of the first of each event a driver wrote to ``path``
    (:mod:`espnet3_flows.timeline`), and of the ``more`` events (epoch times)."""
    events = {name: t - t0 for name, t in more.items()}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            events.setdefault(e["event"], e["time"] - t0)
    return events


def phases(events: dict[str, float], spans: Sequence[tuple[str, Sequence[str], str]]) -> dict[str, float]:
    """Seconds of each span ``(name, from events, to event)`` whose ends ``events`` has (from the
    first of the from events it has)."""
    out = {}
    for name, starts, end in spans:
        start = next((e for e in starts if e in events), None)
        if start is not None and end in events:
            out[name] = max(0.0, events[end] - events[start])
    return out


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


def command(name: str, quick: bool) -> str:
    """The command line that reproduces a benchmark."""
    return f"python -m benchmarks --only {name}" + (" --quick" if quick else "")


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


def script_main(name: str) -> None:
    """``python -m benchmarks.bench_<name> [--quick]``: ``python -m benchmarks --only <name>``, the
    README left alone."""
    from benchmarks import run

    sys.exit(run.main(["--only", name, "--no-readme", *sys.argv[1:]]))
