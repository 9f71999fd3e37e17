"""Output storage: atomic writes and publishing (no partial file is ever visible), errors, secrets."""

from __future__ import annotations

import json
import os
import pickle
import threading
import uuid
from pathlib import Path

import fsspec
import pytest

from espnet3_flows.storage import Storage, StorageError, redact


def _leftovers(root) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name]


def test_local_round_trip(tmp_path):
    store = Storage(tmp_path / "out")
    assert store.is_local and store.uri("a", "b.txt") == str(tmp_path / "out" / "a" / "b.txt")
    assert store.write_bytes("x/data.bin", b"\x00\x01") == str(tmp_path / "out" / "x" / "data.bin")
    store.write_text("x/t.txt", "héllo")
    store.write_json("x/j.json", {"b": 1, "a": [1.5, None]})
    assert store.read_bytes("x/data.bin") == b"\x00\x01"
    assert store.read_bytes("x", "t.txt").decode() == "héllo"
    assert store.read_json("x/j.json") == {"a": [1.5, None], "b": 1}
    assert (tmp_path / "out" / "x" / "j.json").read_text().startswith('{\n  "a"')  # sorted, indented
    assert store.read_json("x/none.json") is None
    with pytest.raises(FileNotFoundError):
        store.read_bytes("x/none.bin")
    assert store.exists("x/data.bin") and not store.exists("x/none.bin")
    assert store.list_files("x") == ["data.bin", "j.json", "t.txt"]
    assert store.list_files("missing") == []
    assert store.child("x").read_bytes("data.bin") == b"\x00\x01"
    store.remove("x/t.txt")
    store.remove("x/t.txt")  # removing twice is fine
    assert store.list_files("x") == ["data.bin", "j.json"]
    store.remove_tree("x")
    assert not (tmp_path / "out" / "x").exists()
    store.remove_tree("x")
    assert _leftovers(tmp_path) == []


def test_write_json_refuses_nan_and_writes_nothing(tmp_path):
    store = Storage(tmp_path)
    with pytest.raises(ValueError):
        store.write_json("bad.json", {"x": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_overwrite_keeps_old_content_until_the_rename(tmp_path, monkeypatch):
    store = Storage(tmp_path)
    dest = tmp_path / "f.txt"
    store.write_bytes("f.txt", b"old content")
    old_inode = dest.stat().st_ino
    reader = open(dest, "rb")  # noqa: SIM115 - a reader that opened the file before the write

    seen = []
    real_replace = os.replace

    def watching_replace(src, dst):
        # just before the rename, the destination is still complete and old; the new bytes are all in src
        seen.append((dest.read_bytes(), Path(src).read_bytes(), os.path.dirname(src) == str(tmp_path)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", watching_replace)
    store.write_bytes("f.txt", b"new content, longer")
    assert seen == [(b"old content", b"new content, longer", True)]
    assert dest.read_bytes() == b"new content, longer"
    assert dest.stat().st_ino != old_inode  # replaced by rename, not rewritten in place
    assert reader.read() == b"old content"
    reader.close()
    assert _leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    store = Storage(tmp_path)
    store.write_bytes("f.txt", b"old")
    with pytest.raises(StorageError, match=r"cannot write .*f\.txt"):
        store.write_bytes("f.txt", "not bytes")  # type: ignore[arg-type]
    assert (tmp_path / "f.txt").read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_concurrent_reader_never_sees_partial_content(tmp_path):
    store = Storage(tmp_path)
    size = 1 << 20
    payloads = [bytes([k]) * size for k in (65, 66)]
    store.write_bytes("big.bin", payloads[0])
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def read_loop():
        while not stop.is_set():
            data = (tmp_path / "big.bin").read_bytes()
            reads[0] += 1
            if data not in payloads:
                bad.append(f"read {len(data)} bytes, first {data[:1]!r} last {data[-1:]!r}")

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for k in range(30):
            store.write_bytes("big.bin", payloads[k % 2])
    finally:
        stop.set()
        thread.join()
    assert reads[0] > 0 and bad == []
    assert _leftovers(tmp_path) == []


def test_publish_file_and_dir(tmp_path, monkeypatch):
    src = tmp_path / "staging"
    (src / "sub").mkdir(parents=True)
    (src / "a.ark").write_bytes(b"A" * 3_000_000)
    (src / "sub" / "b.scp").write_text("u1 a.ark:0\n")
    store = Storage(tmp_path / "out")
    store.write_bytes("shard/a.ark", b"old")

    seen = []
    real_replace = os.replace

    def watching_replace(s, d):
        seen.append((os.path.basename(d), Path(d).read_bytes() if os.path.exists(d) else None, os.path.getsize(s)))
        return real_replace(s, d)

    monkeypatch.setattr(os, "replace", watching_replace)
    assert store.publish_file(src / "a.ark", "shard/a.ark") == str(tmp_path / "out" / "shard" / "a.ark")
    assert seen == [("a.ark", b"old", 3_000_000)]
    assert (tmp_path / "out" / "shard" / "a.ark").read_bytes() == (src / "a.ark").read_bytes()
    assert store.publish_dir(src, "pub") == ["a.ark", "sub/b.scp"]
    assert (tmp_path / "out" / "pub" / "sub" / "b.scp").read_text() == "u1 a.ark:0\n"
    with pytest.raises(StorageError, match=r"cannot publish .*x\.ark"):
        store.publish_file(src / "missing.ark", "x.ark")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("write", ["write_bytes", "publish_file"])
def test_a_symlinked_output_is_replaced_never_written_through(tmp_path, write):
    """ESPnet recipes link a pretrained model's feats_stats.npz into the stats directory
    (espnet/espnet PR #6507 overwrote the pretrained file through such a link)."""
    pretrained = tmp_path / "pretrained" / "feats_stats.npz"
    pretrained.parent.mkdir()
    pretrained.write_bytes(b"pretrained stats")
    out = tmp_path / "out" / "train"
    out.mkdir(parents=True)
    (out / "feats_stats.npz").symlink_to(pretrained)
    store = Storage(str(tmp_path / "out"))
    if write == "write_bytes":
        store.write_bytes("train/feats_stats.npz", b"new stats")
    else:
        local = tmp_path / "staged.npz"
        local.write_bytes(b"new stats")
        store.publish_file(local, "train/feats_stats.npz")
    assert pretrained.read_bytes() == b"pretrained stats"
    assert not (out / "feats_stats.npz").is_symlink()
    assert (out / "feats_stats.npz").read_bytes() == b"new stats"


def test_check_writable(tmp_path):
    Storage(tmp_path / "new" / "dir").check_writable()
    assert not (tmp_path / "new").exists()  # the probe and the directories made for it are removed
    (tmp_path / "old").mkdir()
    Storage(tmp_path / "old" / "dir").check_writable()
    assert list(tmp_path.joinpath("old").iterdir()) == []  # what existed stays
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file")
    target = blocker / "sub"
    with pytest.raises(StorageError, match=rf"output location {target} is not writable"):
        Storage(target).check_writable()
    with pytest.raises(StorageError, match=r"cannot write .*file\.txt/sub/x"):
        Storage(target).write_bytes("x", b"1")


def test_memory_storage_uses_urls():
    url = f"memory://store-{uuid.uuid4().hex}/out"
    store = Storage(url)
    assert not store.is_local
    uri = store.write_json("s/done", {"ok": True})
    assert uri.startswith("memory://") and uri.endswith("/out/s/done")
    assert json.loads(fsspec.open(uri).open().read()) == {"ok": True}
    assert store.list_files("s") == ["done"] and store.exists("s/done")
    store.remove_tree("s")
    assert not store.exists("s/done")


def test_redact_and_repr_hide_secrets():
    options = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value", "token": "tok-123", "anon": False,
               "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "aws_secret_access_key": "nested-secret",
                                 "region_name": "us-east-1"},
               "password": "pw-456", "session_token": "sess-789", "profile": "dev"}
    red = redact(options)
    assert red["key"] == red["secret"] == red["token"] == red["password"] == red["session_token"] == "***"
    assert red["client_kwargs"]["aws_secret_access_key"] == "***"
    assert red["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    assert red["client_kwargs"]["region_name"] == "us-east-1" and red["anon"] is False and red["profile"] == "dev"
    assert options["secret"] == "s3cr3t-value"  # a copy, not in place
    assert redact(None) == {}

    options.pop("password")  # s3fs takes secret or password, not both
    store = Storage("s3://bucket/prefix", options)
    text = repr(store)
    for secret in ("AKIAEXAMPLE", "s3cr3t-value", "tok-123", "nested-secret", "sess-789"):
        assert secret not in text
    assert "s3://bucket/prefix" in text and "127.0.0.1:9" in text
    assert store.uri("a.txt") == "s3://bucket/prefix/a.txt"


def test_storage_pickles_by_url_and_options(tmp_path):
    store = Storage(tmp_path, {"auto_mkdir": True})
    back = pickle.loads(pickle.dumps(store))
    assert (back.url, back.storage_options, back.root) == (store.url, store.storage_options, store.root)


def _write_with_storage_helper(dest, data: bytes) -> None:
    from espnet3_flows.storage import replace_atomically

    replace_atomically(dest, lambda f: [f.write(data[i:i + 4096]) for i in range(0, len(data), 4096)])


def _write_with_atomic_file(dest, data: bytes) -> None:
    from espnet3_flows.storage import atomic_local_file

    with atomic_local_file(dest) as f:
        f.write(data)


@pytest.mark.parametrize("write", [_write_with_storage_helper, _write_with_atomic_file],
                         ids=["replace_atomically", "atomic_local_file"])
def test_atomic_writes_with_concurrent_writers(tmp_path, write):
    """Writers of one file never share a temporary name (the old copies used a fixed '.tmp' and
    collided): every read sees one writer's whole file."""
    import threading

    dest = tmp_path / "sub" / "plan.txt"
    dest.parent.mkdir()
    payloads = [bytes([65 + i]) * 200_000 for i in range(4)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(20):
                write(dest, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    seen = set()
    while any(t.is_alive() for t in threads):
        if dest.exists():
            seen.add(dest.read_bytes())
    for t in threads:
        t.join()
    assert not errors
    assert seen and seen <= set(payloads)
    assert dest.read_bytes() in payloads and [p.name for p in dest.parent.iterdir()] == ["plan.txt"]


@pytest.mark.parametrize("url", ["local", "memory"])
def test_atomic_writer_publishes_on_success_only(tmp_path, url):
    root = str(tmp_path / "out") if url == "local" else f"memory://atomic-{uuid.uuid4().hex}"
    store = Storage(root)
    store.write_bytes("a/joined.tsv", b"old")
    with store.atomic_writer("a/joined.tsv") as f:
        f.write(b"new, being written")
        f.seek(0)  # seekable: a writer may restart (the Kaldi-dir join does)
        f.truncate()
        f.write(b"new")
        assert store.read_bytes("a/joined.tsv") == b"old"  # nothing visible before the block ends
    assert store.read_bytes("a/joined.tsv") == b"new"
    with pytest.raises(ZeroDivisionError), store.atomic_writer("a/joined.tsv") as f:
        f.write(b"partial")
        raise ZeroDivisionError("the block fails after a partial write")
    assert store.read_bytes("a/joined.tsv") == b"new"
    if url == "local":
        assert sorted(p.name for p in (tmp_path / "out" / "a").iterdir()) == ["joined.tsv"]  # no temp left
