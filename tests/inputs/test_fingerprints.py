"""Input fingerprints: local stat (adaptive thread pool), object-store listings with a bounded cache."""

from __future__ import annotations

import os
import subprocess
import uuid

import fsspec
import pytest

from espnet3_flows.inputs.fingerprints import Fingerprinter, fingerprint_files


def test_fingerprint_files_local(tmp_path):
    a, b = tmp_path / "a.wav", tmp_path / "sub" / "b.wav"
    b.parent.mkdir()
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"y" * 20)
    missing = tmp_path / "gone.wav"
    paths = [str(a), str(b), str(missing), str(tmp_path / "nodir" / "c.wav")]
    first = fingerprint_files(paths)
    assert set(first) == set(paths)
    assert first[str(a)].startswith("10:") and first[str(b)].startswith("20:")
    assert first[str(missing)] == "missing" and first[str(tmp_path / "nodir" / "c.wav")] == "missing"
    assert fingerprint_files(paths) == first  # stable
    assert fingerprint_files([f"file://{a}"])[f"file://{a}"] == first[str(a)]  # a URL is the same file

    a.write_bytes(b"x" * 11)  # size change
    st = os.stat(a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fingerprint_files([str(a)])[str(a)].startswith("11:")
    st = os.stat(b)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # mtime change only
    again = fingerprint_files(paths)
    assert again[str(b)] != first[str(b)] and again[str(b)].startswith("20:")
    missing.write_bytes(b"")
    assert fingerprint_files([str(missing)])[str(missing)].startswith("0:")


def test_fingerprint_files_relative_and_remote_paths(tmp_path, monkeypatch):
    (tmp_path / "r.wav").write_bytes(b"abc")
    monkeypatch.chdir(tmp_path)
    assert fingerprint_files(["r.wav"])["r.wav"].startswith("3:")
    base = f"memory://fp-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{base}/x.wav", b"12345")
    prints = fingerprint_files([f"{base}/x.wav", f"{base}/y.wav"])
    assert prints[f"{base}/x.wav"].startswith("5:") and prints[f"{base}/y.wav"] == "missing"
    fs.pipe_file(f"{base}/x.wav", b"123456")
    assert fingerprint_files([f"{base}/x.wav"])[f"{base}/x.wav"].startswith("6:")


def test_manifest_mode_touches_no_file(tmp_path):
    with Fingerprinter("manifest") as fp:
        assert fp.fingerprints([str(tmp_path / "nope.wav"), "s3://no/such"]) == ["", ""]


def test_many_local_files_in_order_and_the_slow_path(tmp_path, monkeypatch):
    paths = []
    for i in range(3000):
        p = tmp_path / f"d{i % 7}" / f"{i}.wav"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"x" * (i % 13))
        paths.append(str(p))
    paths.insert(1500, str(tmp_path / "missing.wav"))
    expected = [f"{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" if os.path.exists(p) else "missing" for p in paths]
    with Fingerprinter("stat") as fp:
        assert fp.fingerprints(paths) == expected
    import espnet3_flows.inputs.fingerprints as mod

    monkeypatch.setattr(mod, "_SLOW_STAT_S", -1.0)  # every stat "slow": the thread pool path
    with Fingerprinter("stat", threads=4) as fp:
        assert fp.fingerprints(paths) == expected
        assert fp._slow_stat and fp._pool is not None


def test_remote_listing_cache_is_bounded(tmp_path):
    base = f"memory://fpc-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    paths = []
    for d in range(20):
        for i in range(50):
            fs.pipe_file(f"{base}/d{d}/{i}.wav", b"x" * i)
            paths.append(f"{base}/d{d}/{i}.wav")
    with Fingerprinter("stat", cache_entries=120) as fp:
        prints = fp.fingerprints(paths + [f"{base}/d3/none.wav"])
        assert [p.split(":")[0] for p in prints[:-1]] == [str(i) for _ in range(20) for i in range(50)]
        assert prints[-1] == "missing"
        assert fp._cached <= 120 + 50 and len(fp._listings) <= 3  # at most ~cache_entries kept


@pytest.mark.slow
def test_s3_key_streams_equal_per_directory_listings(moto_server):
    """On a real S3 endpoint: the grouped key streams give what one listing per parent gives,
    for nested wanted parents, a wanted parent's sub-directory, directory markers, missing files
    and parents, and a 2,500-key directory between wanted ones, which the stream jumps over."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    bucket = f"fp-{uuid.uuid4().hex[:12]}"
    moto_server.make_bucket(bucket)
    client = boto3.client("s3", endpoint_url=moto_server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = [f"c/spk{d:03d}/u{i}.wav" for d in range(40) for i in range(30)]
    keys += [f"c/spk005/sub/x{i}.wav" for i in range(5)]  # in a wanted parent's sub-directory
    keys += [f"c/spk020-noise/n{i:05d}.wav" for i in range(2500)]  # between wanted parents
    keys += ["c/spk007/", "c/a.wav", "c/zz.wav", "d/top.wav"]  # a directory marker; files beside

    def put(key: str) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=b"" if key.endswith("/") else key.encode() * 2)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))
    wanted = [f"s3://{bucket}/{k}" for k in keys if "noise" not in k and not k.endswith("/")]
    wanted += [f"s3://{bucket}/c/spk003/gone.wav", f"s3://{bucket}/nodir/gone.wav"]
    options = moto_server.storage_options()
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **options)
    expected, listings = {}, {}
    for p in wanted:
        parent = p.rsplit("/", 1)[0]
        if parent not in listings:  # one listing per parent (not per key: 1,200 requests to moto)
            try:
                listings[parent] = {e["name"]: e for e in fs.ls(parent, detail=True)}
            except FileNotFoundError:
                listings[parent] = {}
        e = listings[parent].get(p[len("s3://"):])
        expected[p] = f"{e['size']}:{e['ETag'].strip(chr(34))}" if e and e["type"] == "file" else "missing"
    assert sum(v == "missing" for v in expected.values()) == 2

    with Fingerprinter("stat", options, threads=4) as fp:
        calls = []
        real = fp._filesystem("s3").call_s3
        fp._filesystem("s3").call_s3 = lambda *a, **k: calls.append(k) or real(*a, **k)
        got = dict(zip(wanted, fp.fingerprints(wanted), strict=True))
    assert got == expected
    # 43 wanted parents as key streams: ~1,200 wanted keys in pages of 1,000, plus a jump over
    # the 2,500 keys of spk020-noise, instead of 43 listings
    assert len(calls) <= 8, calls
    assert all(k.get("MaxKeys") == 1000 for k in calls)


def _cp_p_same_size(path, tmp_path) -> None:
    """Replace the wav at ``path`` by other samples of the same length with ``cp -p`` from a copy
    whose mtime is the original's: the same size and mtime, other content."""
    import soundfile as sf

    data, rate = sf.read(path, dtype="int16")
    info = sf.info(path)
    other = tmp_path / "other.wav"
    sf.write(other, (data // 2 + 1).astype("int16"), rate, subtype=info.subtype)
    st = os.stat(path)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    subprocess.run(["cp", "-p", str(other), str(path)], check=True)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_strict_sees_a_same_size_copy_with_its_mtime_restored(tmp_path):
    from espnet3_flows.inputs.demo import make_demo_corpus

    manifest = make_demo_corpus(tmp_path / "c", n_utts=1, n_speakers=1, splits={"train": 1.0})["train"]
    wav = manifest.read_text().split("\t")[1].strip()
    with Fingerprinter("stat") as stat, Fingerprinter("strict") as strict:
        before = stat.fingerprints([wav]) + strict.fingerprints([wav])
        _cp_p_same_size(wav, tmp_path)
        after = stat.fingerprints([wav]) + strict.fingerprints([wav])
    assert after[0] == before[0]  # size and mtime: the replacement is not seen (why strict exists)
    assert after[1] != before[1] and after[1].startswith(before[0] + ":")


def test_under_strict_a_cp_p_replacement_recomputes_its_shard(tmp_path):
    from espnet3_flows.config import load_config
    from espnet3_flows.inputs.demo import make_demo_corpus
    from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner

    manifest = make_demo_corpus(tmp_path / "c", n_utts=6, n_speakers=2, min_seconds=0.3, max_seconds=0.5,
                                splits={"train": 1.0})["train"]
    cfg = load_config(CollectStatsConfig, overrides=[f"manifests.train={manifest}", f"output_dir={tmp_path / 'out'}",
                                                     "parallel.env=serial", "shard_size=3", "fingerprint=strict"])
    first = CollectStatsRunner(cfg, "train").run(progress=False)
    assert first.computed == len(first.plan.shards) > 1
    _cp_p_same_size(manifest.read_text().splitlines()[0].split("\t")[1], tmp_path)
    again = CollectStatsRunner(cfg, "train").run(progress=False)
    assert (again.computed, again.cached) == (1, len(first.plan.shards) - 1)
