"""Hostile sizes through a real CLI run: a manifest line over the 1 MiB bound (plain and in a
small ``.gz``), and a field under the bound that reaches a worker. What the run prints, saves and
keeps stays small: one clipped ``error:`` line, a small traceback file, no unbounded spool, memory
of the run's own size, and short Prefect state messages."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.servers import PrefectServer, cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.prefect]
HUGE = 20 << 20  # 20 MiB: twenty times the line bound
#: what a run may print to stderr, and save as its traceback, whatever its inputs (bytes)
STDERR_BOUND, TRACEBACK_BOUND = 4000, 64_000
#: peak RSS of a run that fails at planning: the CLI's imports and its private server, not the line
PLAN_FAIL_RSS_BOUND = 400 << 20
# the CLI under a parent that reports the peak RSS (KiB) of every process it waited for
_MEASURED = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
             "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(rc)")


def _cli(tmp_path: Path, *args: str, api_url: str | None = None, env: dict[str, str] | None = None) -> tuple[int, str, int]:
    """(exit status, stderr without the measurement line, peak RSS in bytes) of a run against the
    server ``api_url`` (the session's), or in ``env``."""
    env = env or cli_env(tmp_path / "prefect-home", HF_HUB_OFFLINE="1", api_url=api_url)
    proc = subprocess.run([sys.executable, "-c", _MEASURED, sys.executable, "flows/collect_stats.py", *args],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    rss = int(lines[-1].split()[1]) * 1024
    return proc.returncode, proc.stderr[: proc.stderr.rindex("maxrss_kib")], rss


def _lines(demo_corpus) -> list[str]:
    return Path(demo_corpus["valid"]).read_text().splitlines()


def _error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[:5000]
    return errors[0]


def _assert_saved_small(out: Path) -> None:
    for path in out.rglob("*.error.txt"):
        assert path.stat().st_size < TRACEBACK_BOUND, (path, path.stat().st_size)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_line_over_the_bound_is_named_never_held(tmp_path, demo_corpus, on_error, session_api_url):
    good = _lines(demo_corpus)
    manifest = tmp_path / "train.tsv"
    with open(manifest, "w") as f:
        f.write("\n".join(good[:3]) + "\n" + "x" * HUGE + "\t/a.wav\n" + "\n".join(good[3:]) + "\n")
    out = tmp_path / "out"
    code, err, rss = _cli(tmp_path, f"manifests.train={manifest}", f"output_dir={out}", f"on_error={on_error}",
                          api_url=session_api_url)
    print(f"on_error={on_error}: stderr {len(err.encode())} bytes, peak RSS {rss >> 20} MiB")
    assert len(err.encode()) < STDERR_BOUND, err[:5000]
    _assert_saved_small(out)
    if on_error == "fail":
        assert code == 2  # the manifest's error, found while planning: the user's (2)
        line = _error_line(err)
        assert f"{manifest}:4" in line and "1 MiB" in line and "more characters" in line, line
        assert rss < PLAN_FAIL_RSS_BOUND, rss
    else:
        assert code == 0, err
        skipped = (out / "train" / "skipped.tsv").read_text()
        assert "\t4\t" in skipped and "1 MiB" in skipped and len(skipped) < 2000, skipped


def _gzip_bomb(path: Path, good: list[str], size: int) -> None:
    """A small ``.gz`` whose 4th line decompresses to ``size`` bytes (written a piece at a time)."""
    with gzip.open(path, "wb", compresslevel=6) as f:
        f.write(("\n".join(good[:3]) + "\n").encode())
        piece = b"z" * (1 << 20)
        for _ in range(size >> 20):
            f.write(piece)
        f.write(("\n" + "\n".join(good[3:]) + "\n").encode())


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_gzip_bomb_leaves_no_unbounded_copy(tmp_path, demo_corpus, on_error, session_api_url):
    manifest = tmp_path / "train.tsv.gz"
    _gzip_bomb(manifest, _lines(demo_corpus), 200 << 20)  # ~200 KiB on disk
    assert manifest.stat().st_size < 1 << 20
    out = tmp_path / "out"
    code, err, rss = _cli(tmp_path, f"manifests.train={manifest}", f"output_dir={out}", f"on_error={on_error}",
                          api_url=session_api_url)
    spooled = sum(p.stat().st_size for p in (out / "train" / "shards" / "inputs").rglob("*") if p.is_file()) \
        if (out / "train" / "shards" / "inputs").exists() else 0
    print(f"gzip on_error={on_error}: stderr {len(err.encode())} bytes, peak RSS {rss >> 20} MiB, spool {spooled} bytes")
    assert len(err.encode()) < STDERR_BOUND, err[:5000]
    _assert_saved_small(out)
    if on_error == "fail":
        assert code == 2 and spooled == 0, (code, spooled)
        assert f"{manifest}:4" in _error_line(err)
        assert rss < PLAN_FAIL_RSS_BOUND, rss  # a 200 MB line held whole would cost ~1 GB here
    else:
        assert code == 0, err
        assert 0 < spooled < (1 << 20) + 4096, spooled  # the line's 1 MiB head, not its 200 MB


def test_a_long_field_reaching_a_worker_is_clipped_everywhere(tmp_path, demo_corpus):
    good = _lines(demo_corpus)
    manifest = tmp_path / "train.tsv"
    long_path = "/nonexistent/" + "p" * 900_000 + ".wav"  # under the line bound: planned, then read
    manifest.write_text("\n".join([*good[:3], f"utt-long\t{long_path}", *good[3:]]) + "\n")
    out = tmp_path / "out"
    with PrefectServer(tmp_path / "server") as server:  # its database outlives the run: read the states
        env = cli_env(tmp_path / "prefect-home", HF_HUB_OFFLINE="1", api_url=server.api_url)
        code, err, _ = _cli(tmp_path, f"manifests.train={manifest}", f"output_dir={out}", env=env)
        runs = []
        for kind in ("task_runs", "flow_runs"):
            request = urllib.request.Request(f"{server.api_url}/{kind}/filter", data=b"{}", method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                runs += json.loads(response.read())
    assert code == 1
    line = _error_line(err)
    assert "utt-long" in line and "more characters" in line and len(err.encode()) < STDERR_BOUND, line
    saved = sorted((out / "logs").glob("*.error.txt"))
    assert len(saved) == 1 and "utt-long" in saved[0].read_text()
    _assert_saved_small(out)
    messages = [r["state"]["message"] or "" for r in runs if r.get("state")]
    assert any("utt-long" in m for m in messages), messages
    assert max(len(m) for m in messages) < STDERR_BOUND, max(len(m) for m in messages)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_kaldi_data_dir_line_over_the_bound_is_named_never_held(tmp_path, demo_corpus, on_error, session_api_url):
    rows = [line.split("\t")[:2] for line in _lines(demo_corpus)]
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "wav.scp", "w") as f:  # sorted by id, as Kaldi keeps it; the huge line fourth
        f.write("".join(f"{u} {p}\n" for u, p in rows[:3]) + "u3" + "x" * HUGE + " /a.wav\n"
                + "".join(f"{u} {p}\n" for u, p in rows[3:]))
    out = tmp_path / "out"
    code, err, rss = _cli(tmp_path, f"manifests.train={data}", f"output_dir={out}", f"on_error={on_error}",
                          api_url=session_api_url)
    assert len(err.encode()) < STDERR_BOUND, err[:5000]
    _assert_saved_small(out)
    if on_error == "fail":
        assert code == 2  # the manifest's error, found while planning: the user's (2)
        line = _error_line(err)
        assert "wav.scp" in line and ":4" in line and "1 MiB" in line and "more characters" in line, line
        assert rss < PLAN_FAIL_RSS_BOUND, rss
    else:
        assert code == 0, err
        skipped = (out / "train" / "skipped.tsv").read_text()
        assert "1 MiB" in skipped and len(skipped) < 2000, skipped
