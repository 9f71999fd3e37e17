"""Shard plans: content-defined, content-addressed shards, stable under insertions and appends, JSON round trip."""

from __future__ import annotations

import json
import random
from itertools import pairwise

import numpy as np
import pytest

from espnet3_flows.hashing import canonical_json, code_salt, digest, id_hash64
from espnet3_flows.sharding import Shard, ShardCutter, ShardPlan, plan_shards, shard_size_bounds


def _keys(n: int, start: int = 0) -> list[str]:
    return [f"utt{i:06d}\t/data/{i}.wav\t{1000 + i}:1700000000" for i in range(start, start + n)]


def test_shards_cover_items_in_order_within_size_bounds():
    plan = plan_shards(_keys(5000), 100, {"a": 1})
    lo, hi, _ = shard_size_bounds(100)
    assert plan.shards[0].start == 0 and plan.num_items == 5000
    assert all(a.stop == b.start for a, b in pairwise(plan.shards))
    assert all(lo <= s.num_items <= hi for s in plan.shards[:-1]) and 1 <= plan.shards[-1].num_items <= hi
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    assert plan.shards[3].name == f"split.{plan.shards[3].hash[:16]}" and list(plan.shards[1].items) == list(range(plan.shards[1].start,
                                                                                          plan.shards[1].stop))
    assert 0.7 < 5000 / len(plan.shards) / 100 < 1.3  # about shard_size on average


def test_size_bounds():
    assert shard_size_bounds(1) == (1, 2, 1)  # every item ends a shard
    assert [s.num_items for s in plan_shards(_keys(7), 1).shards] == [1] * 7
    assert shard_size_bounds(1000) == (500, 2000, 501)
    with pytest.raises(ValueError):
        shard_size_bounds(0)
    assert plan_shards([], 4).shards == () and plan_shards([], 4).num_items == 0
    with pytest.raises(ValueError):
        plan_shards(_keys(3), 0)
    with pytest.raises(ValueError):
        plan_shards(_keys(3), 2, indices=[0, 1])


def test_insertions_and_deletions_change_only_the_shards_that_hold_them():
    rng = random.Random(0)
    keys = _keys(20000)
    base = plan_shards(keys, 200, {"c": 1})
    old = {s.hash for s in base.shards}
    inserted = sorted(keys + [k.replace("\t", "x\t", 1) for k in rng.sample(keys, 200)])  # 1 %, sorted in
    after = plan_shards(inserted, 200, {"c": 1})
    receiving = set()
    pos = {k: i for i, k in enumerate(inserted)}
    for k in inserted:
        if "x\t" in k:
            receiving.update(s.index for s in after.shards if s.start <= pos[k] < s.stop)
    changed = [s for s in after.shards if s.hash not in old]
    assert len(changed) <= len(receiving) + 2, (len(changed), len(receiving))
    removed = plan_shards(keys[:5000] + keys[5001:], 200, {"c": 1})
    assert sum(s.hash not in old for s in removed.shards) <= 2


def test_appending_keeps_every_closed_shard():
    before = plan_shards(_keys(3000), 100, {"cfg": 1})
    after = plan_shards(_keys(3300), 100, {"cfg": 1})
    assert [s.hash for s in after.shards[:len(before.shards) - 1]] == [s.hash for s in before.shards[:-1]]


def test_hash_is_content_addressed_and_config_sensitive():
    a = plan_shards(_keys(900), 40, {"x": 1, "y": {"b": 2, "a": 3}})
    b = plan_shards(list(_keys(900)), 40, {"y": {"a": 3, "b": 2}, "x": 1})
    assert [s.hash for s in a.shards] == [s.hash for s in b.shards] and a.digest == b.digest
    base = plan_shards(_keys(900), 40, {"num_mel_bins": 80})
    other_cfg = plan_shards(_keys(900), 40, {"num_mel_bins": 40})
    other_salt = plan_shards(_keys(900), 40, {"num_mel_bins": 80}, salt=code_salt("v2"))
    assert not {s.hash for s in base.shards} & {s.hash for s in other_cfg.shards}
    assert not {s.hash for s in base.shards} & {s.hash for s in other_salt.shards}
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}' and len(digest({})) == 64


def test_a_changed_fingerprint_changes_only_its_shard():
    keys = _keys(900)
    base = plan_shards(keys, 40)
    keys[450] = keys[450].replace(":1700000000", ":1700000099")
    cut_keys = [k.split("\t", 1)[0] for k in _keys(900)]
    changed = plan_shards(keys, 40, cut_keys=cut_keys)
    unchanged = plan_shards(_keys(900), 40, cut_keys=cut_keys)
    diff = [i for i, (x, y) in enumerate(zip(unchanged.shards, changed.shards, strict=True)) if x.hash != y.hash]
    assert len(diff) == 1 and changed.shards[diff[0]].start <= 450 < changed.shards[diff[0]].stop
    assert [(s.start, s.stop) for s in changed.shards] == [(s.start, s.stop) for s in unchanged.shards]
    assert base.digest != unchanged.digest  # boundaries by id only differ from boundaries by whole key


def test_cutter_streams_the_same_plan():
    keys = _keys(2000)
    plan = plan_shards(keys, 50, {"k": 1})
    cutter = ShardCutter(50, digest({"k": 1}), code_salt())

    hashes = []
    for i, key in enumerate(keys):
        if cutter.add(id_hash64(key), key) or i == len(keys) - 1:
            hashes.append(cutter.close()[0])
    assert hashes == [s.hash for s in plan.shards]


def test_plan_round_trips_through_json():
    plan = plan_shards(_keys(70), 6, {"k": [1, 2]}, indices=np.arange(100, 170))
    back = ShardPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    assert all(isinstance(s, Shard) and isinstance(s.indices, tuple) for s in back.shards)
    assert all(type(i) is int for s in back.shards for i in s.indices)
    assert list(back.shards[0].items)[0] == 100
    contiguous = plan_shards(_keys(50), 4)
    d = contiguous.to_dict()
    assert all("indices" not in s for s in d["shards"])  # the common case stays small
    assert ShardPlan.from_dict(json.loads(json.dumps(d))) == contiguous
    with_source = Shard(0, 0, 3, "h", {"path": "/m.tsv", "start": 0, "end": 9})
    assert Shard.from_dict(json.loads(json.dumps(with_source.to_dict()))).source == with_source.source
