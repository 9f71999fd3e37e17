"""S3-compatible stores that keep no upload checksums, and objects without one (multipart), against
a real endpoint (moto behind an HTTP proxy that rejects or drops checksum headers): a run there
completes exact and resumes; a published file's content check compares its recorded ETag with
the HEAD's, reading nothing while the file is unchanged, and still catches a same-size edit."""

from __future__ import annotations

import posixpath

import pytest
import s3fs

from espnet3_flows import s3_objects
from espnet3_flows.config import load_config
from espnet3_flows.orchestration.job_run import plan_job
from espnet3_flows.parallel.scheduler import InProcessExecutor, recheck_done, run_planned
from espnet3_flows.published_files import mismatch, publish_recorded
from espnet3_flows.stats import CollectStatsConfig
from espnet3_flows.storage import Storage
from tests.support.s3_http_proxy import S3HttpProxy

pytestmark = [pytest.mark.s3]
#: files a rerun reads in any case: its records (plan, done records, owner, summary)
_RECORDS = (".json", "/done")


def _plan(manifest: str, url: str, options: dict):
    cfg = load_config(CollectStatsConfig, base={"storage_options": options},
                      overrides=[f"manifests.train={manifest}", f"output_dir={url}", "shard_size=4",
                                 "parallel.env=serial"])
    return plan_job("collect_stats", cfg)


def _run(manifest: str, url: str, options: dict):
    run = _plan(manifest, url, options)
    if run.unchanged_summaries is None:
        run_planned(run.runners, InProcessExecutor(), progress=False)
    return run


def _outputs(fs: s3fs.S3FileSystem, root: str) -> dict[str, bytes]:
    """The merged outputs of the split ``train`` below ``root`` (its records left out)."""
    return {posixpath.basename(p): fs.cat_file(p) for p in fs.ls(f"{root}/train", detail=False)
            if fs.isfile(p) and not p.endswith(".json")}


def _data_reads(proxy: S3HttpProxy) -> list[str]:
    """Paths of published files other than records the proxy forwarded a GET of."""
    with proxy._lock:
        return sorted(p for (m, p) in proxy.requests  # ("/bucket": a listing)
                      if m == "GET" and p.count("/") > 1 and not p.endswith(_RECORDS))


def test_a_store_that_rejects_checksum_headers_runs_exact_and_resumes(demo_corpus, moto_server, s3_output, caplog):
    url, options = s3_output
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    root = url.removeprefix("s3://")
    _run(demo_corpus["valid"], f"{url}/direct", options)
    with S3HttpProxy(moto_server.port, checksums="reject") as proxy:
        far = {**options, "client_kwargs": {"endpoint_url": proxy.url}}
        _run(demo_corpus["valid"], f"{url}/far", far)
        assert proxy.rejected >= 1 and not s3_objects.keeps_checksums(proxy.url)
        said = [r.getMessage() for r in caplog.records if "refuses upload checksums" in r.getMessage()]
        assert len(said) == 1 and proxy.url in said[0], said  # once per endpoint, not per upload
        outputs = _outputs(fs, f"{root}/direct")
        assert {"feats_shape", "feats_stats.npz"} <= set(outputs)
        assert _outputs(fs, f"{root}/far") == outputs  # scp-free outputs: byte-equal
        summary = Storage(f"{url}/far", far).read_json("train/summary.json")
        assert all(d.get("etag") for d in summary["digests"].values()), summary["digests"]
        rerun = _run(demo_corpus["valid"], f"{url}/far", far)
        assert rerun.pending_shards == 0 and rerun.unchanged_summaries is not None
        fs.rm_file(f"{root}/far/train/summary.json")  # merged again, from the shards done earlier
        rerun = _run(demo_corpus["valid"], f"{url}/far", far)
        assert rerun.pending_shards == 0 and not any(p.computed for p in rerun.runners)
        assert _outputs(fs, f"{root}/far") == outputs


def test_a_store_that_ignores_checksums_is_checked_by_etag_without_reading(demo_corpus, moto_server, s3_output):
    url, options = s3_output
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)  # as another tool would write it
    root = url.removeprefix("s3://")
    with S3HttpProxy(moto_server.port, checksums="ignore") as proxy:
        far = {**options, "client_kwargs": {"endpoint_url": proxy.url}}
        _run(demo_corpus["valid"], url, far)
        clean = fs.cat_file(f"{root}/train/feats_shape")
        proxy.requests.clear()
        run = _plan(demo_corpus["valid"], url, far)  # nothing to compute: every file checked
        assert run.unchanged_summaries is not None
        for planned in run.runners:  # the check of the shards' files before a merge
            recheck_done(planned)
            assert len(planned.done) == len(planned.plan.shards)
        assert _data_reads(proxy) == [], "a file was read back to check it"
        assert proxy.count("HEAD", "/train/feats_shape") >= 1 and proxy.count("HEAD", "/shapes.tsv") >= 1
        shapes = sorted(fs.glob(f"{root}/train/shards/*/shapes.tsv"))[0]
        assert Storage(url, options).stored(shapes.removeprefix(f"{root}/")).sha256 is None  # none kept
        original = fs.cat_file(shapes)
        at = next(i for i in range(original.index(b"\t"), len(original)) if original[i:i + 1].isdigit())
        edited = original[:at] + (b"2" if original[at:at + 1] == b"1" else b"1") + original[at + 1:]
        fs.pipe_file(shapes, edited)  # other content, the same size
        fs.rm_file(f"{root}/train/summary.json")
        _run(demo_corpus["valid"], url, far)
        assert fs.cat_file(shapes) == original and fs.cat_file(f"{root}/train/feats_shape") == clean


def test_a_multipart_object_is_checked_by_its_etag(moto_server, s3_output, tmp_path, monkeypatch):
    url, options = s3_output
    monkeypatch.setattr(s3_objects, "PART_BYTES", 5 * 2**20)  # S3's smallest part: 11 MiB in 3 parts
    local = tmp_path / "big.ark"
    local.write_bytes(bytes(range(256)) * (11 * 2**12))
    with S3HttpProxy(moto_server.port, checksums="pass") as proxy:
        store = Storage(url, {**options, "client_kwargs": {"endpoint_url": proxy.url}})
        record = publish_recorded(store, local, "big.ark")
        found = store.stored("big.ark")
        assert found.sha256 is None and record["etag"] == found.etag and found.etag.endswith("-3")
        assert proxy.count("POST", "/big.ark") >= 2  # (a multipart upload: created, completed)
        assert mismatch(store, "big.ark", record) is None and proxy.count("GET", "/big.ark") == 0
        older = {k: v for k, v in record.items() if k != "etag"}  # a record of an earlier version
        assert mismatch(store, "big.ark", older) is None and proxy.count("GET", "/big.ark") >= 1
        edited = bytearray(local.read_bytes())
        edited[5 * 2**20 + 7] ^= 1
        s3fs.S3FileSystem(**options, skip_instance_cache=True).pipe_file(f"{url}/big.ark", bytes(edited))
        assert mismatch(store, "big.ark", record) == "its content differs from its record (SHA-256)"
