"""Input fingerprints: local stat (adaptive thread pool), object-store listings with a bounded cache."""

from __future__ import annotations

import os
import uuid

import fsspec

from espnet3_flows.fingerprints import Fingerprinter, fingerprint_files


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
    import espnet3_flows.fingerprints as mod

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
