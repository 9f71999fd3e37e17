"""Benchmark: fingerprinting s3:// inputs on a local S3 endpoint (moto's server on loopback).

N objects (100,000; 1,000 with ``--quick``), 100 per prefix (one prefix per speaker or
recording session, as corpora are laid out), every one named by the manifest. Two ways of
fingerprinting them, each in a fresh process (wall time and peak RSS of that process), run
alternately, two repetitions each:

- **before** (the planner up to commit 81b04c8, kept here as the reference): group the paths by
  parent, list each parent one after another with an s3fs filesystem whose listings cache keeps
  every listing for the life of the process;
- **now**: :class:`espnet3_flows.inputs.fingerprints.Fingerprinter` as the planner calls it (blocks of
  4,096 paths, the parents of a block listed by 8 threads, fsspec's listings cache off, our own
  cache bounded at 200,000 entries).

Both must give the same fingerprint (size and ETag) for every object. Targets (issue "Corpus
scale"): now ≥ 5× faster than before, and the driver's memory bounded (its growth over the
imports does not grow with N beyond the bounded cache).

Run ``python -m benchmarks --only s3 [--quick]``.
"""

from __future__ import annotations

import json
import posixpath
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from benchmarks import common
from benchmarks import process_tree

NAME = "s3"
PER_PREFIX = 100
BUCKET = "bench-fingerprints"


def fingerprints_before(paths: Sequence[str], storage_options: dict[str, Any]) -> dict[str, str]:
    """The reference: the planner's fingerprinting of s3:// paths before commit 81b04c8."""
    import fsspec

    by_dir: dict[str, list[str]] = defaultdict(list)
    for p in set(paths):
        by_dir[posixpath.dirname(p)].append(p)
    fs = fsspec.filesystem("s3", **storage_options)
    out: dict[str, str] = {}
    for parent, members in by_dir.items():
        try:
            listing = {fs._strip_protocol(e["name"]).rstrip("/"): e for e in fs.ls(parent, detail=True)}
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            listing = {}
        for p in members:
            e = listing.get(fs._strip_protocol(p).rstrip("/"))
            out[p] = f"{e['size']}:{str(e.get('ETag')).strip(chr(34))}" if e else "missing"
    return out


def fingerprints_now(paths: Sequence[str], storage_options: dict[str, Any]) -> dict[str, str]:
    """The planner's way: :class:`Fingerprinter` over blocks of the manifest's paths."""
    return dict(zip(paths, common.fingerprint_as_planner(paths, storage_options), strict=True))


def _child(method: str, paths_file: str, options_json: str, out_file: str) -> None:
    """In a fresh process: import, fingerprint every path, report time and memory."""
    import importlib

    for module in ("fsspec", "s3fs", "espnet3_flows.inputs.fingerprints", "espnet3_flows.inputs.planner"):
        importlib.import_module(module)  # imported before the baseline RSS

    paths = Path(paths_file).read_text().split("\n")
    options = json.loads(options_json)
    rss0 = process_tree.proc_memory()["VmRSS"]
    t0 = time.perf_counter()
    result = (fingerprints_before if method == "before" else fingerprints_now)(paths, options)
    seconds = time.perf_counter() - t0
    peak = process_tree.proc_memory()["VmHWM"]
    digest = sorted(result.items())
    Path(out_file).write_text(json.dumps({"seconds": seconds, "rss_after_imports": rss0, "peak_rss": peak,
                                          "missing": sum(v == "missing" for v in result.values()),
                                          "fingerprints": digest}))


def _populate(server: Any, n: int) -> list[str]:
    import boto3
    from botocore.config import Config

    server.make_bucket(BUCKET)
    client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          config=Config(max_pool_connections=16))
    keys = [f"corpus/spk{i // PER_PREFIX:05d}/utt{i:07d}.wav" for i in range(n)]

    def put(key: str) -> None:
        client.put_object(Bucket=BUCKET, Key=key, Body=key.encode())  # sizes differ with the name

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))
    return [f"s3://{BUCKET}/{k}" for k in keys]


def run(quick: bool = False) -> dict[str, Any]:
    from tests.support.servers import MotoServer

    n = 1_000 if quick else 100_000
    reps = 1 if quick else 2
    work = common.scratch(NAME)
    rows: list[dict[str, Any]] = []
    try:
        with MotoServer() as server:
            t0 = time.perf_counter()
            paths = _populate(server, n)
            populate_s = time.perf_counter() - t0
            print(f"[s3] {n} objects in {n // PER_PREFIX} prefixes put in {populate_s:.0f} s", flush=True)
            paths_file = work / "paths.txt"
            paths_file.write_text("\n".join(paths))
            options = json.dumps(server.storage_options())
            digests: dict[str, Any] = {}
            for rep in range(reps):
                for method in ("before", "now"):
                    out = work / f"{method}-{rep}.json"
                    child = [*common.module_command(__spec__.name), "--child", method, paths_file, options, out]
                    process_tree.run_checked(child, work / f"{method}-{rep}.log")
                    r = json.loads(out.read_text())
                    digests[method] = r.pop("fingerprints")
                    row = {"method": method, "rep": rep, "objects": n, "prefixes": n // PER_PREFIX,
                           "seconds": round(r["seconds"], 2), "objects_per_s": round(n / r["seconds"]),
                           "rss_after_imports_mb": round(r["rss_after_imports"] / 2**20, 1),
                           "peak_rss_mb": round(r["peak_rss"] / 2**20, 1),
                           "growth_mb": round((r["peak_rss"] - r["rss_after_imports"]) / 2**20, 1),
                           "missing": r["missing"]}
                    rows.append(row)
                    print(f"[s3] {method} rep {rep}: {row['seconds']} s, peak {row['peak_rss_mb']} MB "
                          f"(+{row['growth_mb']} MB)", flush=True)
    finally:  # a failed child's log tail is in the exception
        common.clean_scratch(work)
    same = digests["before"] == digests["now"] and not any(r["missing"] for r in rows)
    best = {m: min(r["seconds"] for r in rows if r["method"] == m) for m in ("before", "now")}
    growth = {m: max(r["growth_mb"] for r in rows if r["method"] == m) for m in ("before", "now")}
    speedup = best["before"] / best["now"]
    targets = [
        common.target(f"{n:,} objects: now vs before (best of {reps}, side by side)", "≥ 5×",
                      f"{speedup:.2f}×", speedup >= 5),
        common.target("same fingerprint for every object, none missing", "identical", "identical" if same else
                      "DIFFERENT", same),
        common.target("driver memory growth while fingerprinting (MB), now vs before", "bounded (cache ≤ 200,000 entries)",
                      f"{growth['now']} vs {growth['before']}", growth["now"] <= growth["before"]),
    ]
    notes = [f"{n:,} objects of 30-40 bytes, {PER_PREFIX} per prefix, in moto's in-memory S3 server on loopback "
             f"(put in {populate_s:.0f} s, 16 threads); each method a fresh process; rows alternate.",
             "Loopback has no network latency: each LIST costs the server's CPU (moto, Python) and the client's "
             "XML parsing, on the same 2 cores. On a real object store a LIST takes 20-100 ms of round trip, "
             "which the 8 concurrent listings overlap; here they overlap only the server's and the client's CPU.",
             "before = the planner's code up to 81b04c8, kept in this file as the reference."]
    return common.write_result(NAME, quick, rows, targets, notes, plot=lambda path: _plot(rows, path),
                               speedup=speedup)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    common.bar_chart(path, [f"{r['method']} #{r['rep']}" for r in rows], [r["seconds"] for r in rows],
                     "fingerprinting, s", height=2.6)


def table(result: dict[str, Any]) -> str:
    """The README table of a result."""
    return common.markdown_table(
        ["method", "rep", "objects", "prefixes", "s", "objects/s", "RSS after imports MB", "peak RSS MB", "growth MB"],
        [[r["method"], r["rep"], f"{r['objects']:,}", r["prefixes"], r["seconds"], f"{r['objects_per_s']:,}",
          r["rss_after_imports_mb"], r["peak_rss_mb"], r["growth_mb"]] for r in result["rows"]])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # --child METHOD PATHS_FILE OPTIONS_JSON OUT_FILE
        _child(*sys.argv[2:])
    else:
        common.script_main(NAME)
