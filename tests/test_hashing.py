"""The hashes users' reruns depend on stay what they were: a change here recomputes every shard
of every user, so it must come with a version bump (``FORMAT_VERSION``, a kind's version), never
by accident. The pinned values were computed by the code before hashing had its own module."""

from __future__ import annotations

from espnet3_flows.hashing import code_salt, config_digest, digest, id_hash64, item_key, runner_item_key, token
from espnet3_flows.sharding import ShardCutter, plan_shards


def test_shard_hashes_and_boundaries_are_pinned():
    keys = [f"utt{i}\t/data/{i}.wav\t{i}:0" for i in range(40)]
    plan = plan_shards(keys, 8, {"frontend": "fbank"}, salt="pinned")
    assert [s.num_items for s in plan.shards] == [6, 4, 13, 6, 4, 7]
    assert [s.hash[:16] for s in plan.shards][:3] == ["67709b996b337771", "2b9b4052e039c701", "d33629d9e52f80ca"]
    assert id_hash64("utt1") == 15657857204231060957
    assert digest({"a": [1, 2]})[:16] == "01530d164d479cf0"


def test_the_manifest_planner_and_plan_shards_hash_an_item_key_the_same_way():
    """The streaming planner feeds bytes (item_key), plan_shards strings: equal keys, equal hashes."""
    key = item_key(b"utt1\t/data/1.wav", "44:17")
    a, b = ShardCutter(4, config_digest({"x": 1}), "s"), ShardCutter(4, config_digest({"x": 1}), "s")
    a.add(id_hash64("utt1"), key)
    b.add(id_hash64("utt1"), key.decode())
    assert a.close() == b.close()


def test_named_hashes():
    assert config_digest(None) == config_digest({}) == digest({})
    assert runner_item_key(3) == "3" and runner_item_key({"b": 1}) == '{"b": 1}'
    assert token("kind/1", ["a", 1], 16) == digest(["kind/1", "a", 1])[:16]
    assert token(None, {"a": 1}) == digest({"a": 1})[:24]
    assert code_salt().startswith("espnet3_flows=") and ";format=2;" in code_salt()
