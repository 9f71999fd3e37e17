"""Shard plans: fixed-size content-addressed shards, stable under appends, JSON round trip, file fingerprints."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import numpy as np
import pytest

from espnet3_flows.sharding import (
    Shard,
    ShardPlan,
    canonical_json,
    code_salt,
    digest,
    fingerprint_files,
    plan_shards,
)


def _keys(n: int, start: int = 0) -> list[str]:
    return [f"utt{i:04d}\t/data/{i}.wav\t{1000 + i}:1700000000.5" for i in range(start, start + n)]


def test_fixed_size_shards_in_input_order():
    plan = plan_shards(_keys(10), 4, {"a": 1})
    assert [(s.index, s.start, s.stop, s.num_items, s.name) for s in plan.shards] == [
        (0, 0, 4, 4, "split.0"), (1, 4, 8, 4, "split.1"), (2, 8, 10, 2, "split.2")]
    assert [s.indices for s in plan.shards] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert plan.num_items == 10 and plan.shard_size == 4
    assert plan.config_hash == digest({"a": 1}) and plan.salt == code_salt()
    assert len({s.hash for s in plan.shards}) == 3 and all(len(s.hash) == 64 for s in plan.shards)
    assert plan_shards([], 4).shards == () and plan_shards([], 4).num_items == 0
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        plan_shards(_keys(3), 0)
    with pytest.raises(ValueError, match="same length"):
        plan_shards(_keys(3), 2, indices=[0, 1])


def test_plans_are_deterministic_and_do_not_depend_on_config_key_order():
    a = plan_shards(_keys(9), 4, {"x": 1, "y": {"b": 2, "a": 3}})
    b = plan_shards(list(_keys(9)), 4, {"y": {"a": 3, "b": 2}, "x": 1})
    assert a == b
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'


def test_appending_items_keeps_earlier_full_shards():
    before = plan_shards(_keys(10), 4, {"cfg": 1})
    after = plan_shards(_keys(15), 4, {"cfg": 1})
    assert [s.hash for s in after.shards[:2]] == [s.hash for s in before.shards[:2]]
    assert after.shards[2].hash != before.shards[2].hash  # the partial shard grew
    assert len(after.shards) == 4
    exactly_full = plan_shards(_keys(8), 4, {"cfg": 1})
    assert [s.hash for s in exactly_full.shards] == [s.hash for s in after.shards[:2]]


def test_config_and_salt_changes_change_every_hash():
    base = plan_shards(_keys(10), 4, {"num_mel_bins": 80})
    other_cfg = plan_shards(_keys(10), 4, {"num_mel_bins": 40})
    other_salt = plan_shards(_keys(10), 4, {"num_mel_bins": 80}, salt=code_salt("v2"))
    for other in (other_cfg, other_salt):
        assert all(a.hash != b.hash for a, b in zip(base.shards, other.shards))


def test_a_changed_item_changes_only_its_shard():
    keys = _keys(12)
    base = plan_shards(keys, 4)
    keys[5] = keys[5].replace("1005:", "2005:")  # new size: the file changed
    changed = plan_shards(keys, 4)
    assert [a.hash == b.hash for a, b in zip(base.shards, changed.shards)] == [True, False, True]


def test_the_hash_covers_contents_not_position():
    keys = _keys(4) * 2
    plan = plan_shards(keys, 4)
    assert plan.shards[0].hash == plan.shards[1].hash


def test_json_round_trip_with_numpy_indices():
    plan = plan_shards(_keys(7), 3, {"k": [1, 2]}, indices=np.arange(100, 107))
    text = json.dumps(plan.to_dict())  # fails on numpy ints
    back = ShardPlan.from_dict(json.loads(text))
    assert back == plan
    assert all(isinstance(s, Shard) and isinstance(s.indices, tuple) for s in back.shards)
    assert all(type(i) is int for s in back.shards for i in s.indices)
    assert back.shards[2].indices == (106,)

    contiguous = plan_shards(_keys(5), 2)
    d = contiguous.to_dict()
    assert all("indices" not in s for s in d["shards"])  # the common case is stored compactly
    assert d["num_items"] == 5
    assert ShardPlan.from_dict(json.loads(json.dumps(d))) == contiguous
    shuffled = plan_shards(_keys(4), 4, indices=[3, 1, 2, 0])
    assert ShardPlan.from_dict(json.loads(json.dumps(shuffled.to_dict()))).shards[0].indices == (3, 1, 2, 0)


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
