"""What a benchmark's numbers were measured on (recorded in every result and its README line)."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
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


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[Callable[[], float]]:
    """``count`` processes that each spin one core at normal priority (``python -c "while True:
    pass"``: a busy machine, as a login node or a shared workstation is), each in a session of its
    own, as other people's jobs are (a kernel that shares CPU time between sessions,
    ``sched_autogroup``, gives each its part), started on entry and killed on exit. Yields a
    function that gives their CPU seconds so far (from ``/proc``), so that a result can show the
    share they took."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for _ in range(count)]
    tick = os.sysconf("SC_CLK_TCK")

    def cpu_seconds() -> float:
        total = 0.0
        for p in procs:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return total

    try:
        yield cpu_seconds
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
