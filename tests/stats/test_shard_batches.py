"""A frontend that makes its own batches gets a whole shard per ``forward`` call, so that its
padded batches are full and hold utterances of nearly one length (issue 62, part 2): here 36
batches of 177k samples on average (of 200k at most) with 1.4 % padding, where calls of
``batch_size`` utterances, as before, gave 86 batches of 74k with 7.3 % padding
(``TorchFrontend.batches``); the shard's padding is measured in ``summary.json``."""

from __future__ import annotations

import json

import pytest
import soundfile as sf

from espnet3_flows.config import load_config
from espnet3_flows.frontends.frontend import model_frontend
from espnet3_flows.frontends.wave_frontends import TorchFrontend
from espnet3_flows.inputs.demo import make_demo_corpus
from espnet3_flows.parallel.base_runner import WHOLE_SHARD
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from tests.stats.test_collect_stats import TinyFrontend

MAX_BATCH_SAMPLES = 200_000


def batches(lengths: list[int], per_call: int) -> tuple[int, float]:
    """``(batches, share of padding in the samples computed)`` of a TorchFrontend handed
    ``lengths`` ``per_call`` at a time (its own batches: length-sorted, at most MAX_BATCH_SAMPLES)."""
    frontend = model_frontend(TinyFrontend(), "cpu", MAX_BATCH_SAMPLES)
    count = computed = 0
    for start in range(0, len(lengths), per_call):
        call = lengths[start:start + per_call]
        groups = frontend.batches(call)
        count += len(groups)
        computed += sum(len(group) * max(call[i] for i in group) for group in groups)
    return count, 1.0 - sum(lengths) / computed


def test_a_batching_frontend_takes_a_whole_shard_and_pads_it_by_at_most_five_percent(tmp_path, monkeypatch):
    manifest = make_demo_corpus(tmp_path / "corpus", n_utts=300, n_speakers=3, min_seconds=0.5, max_seconds=2.0,
                                seed=4, splits={"train": 1.0})["train"]
    calls: list[int] = []
    moments = TorchFrontend.moments

    def counted(self, waves, kwargs):
        calls.append(len(waves))
        return moments(self, waves, kwargs)

    monkeypatch.setattr(TorchFrontend, "moments", counted)
    model = ["frontend.type=model", "frontend.model._target_=tests.stats.test_collect_stats.TinyFrontend",
             "frontend.model.hop=200", "frontend.model.dim=3", "collect_stats_kwargs.scale=1.0"]
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={manifest}", f"output_dir={tmp_path / 'out'}", "parallel.env=serial", "shard_size=1000",
        "batch_size=16", *model, f"frontend.max_batch_samples={MAX_BATCH_SAMPLES}"])
    runner = CollectStatsRunner(cfg, "train")
    assert runner.batch_size == WHOLE_SHARD
    runner.run(progress=False)
    assert calls == [300]  # one shard, one call
    summary = json.loads((tmp_path / "out" / "train" / "summary.json").read_text())
    lengths = [sf.info(line.split("\t")[1]).frames for line in manifest.read_text().splitlines()]
    whole, per_16 = batches(lengths, len(lengths)), batches(lengths, 16)
    assert abs(summary["padding_fraction"] - whole[1]) < 1e-6
    assert summary["padding_fraction"] <= 0.05 < per_16[1]
    assert sum(lengths) / whole[0] >= 0.8 * MAX_BATCH_SAMPLES  # full batches
    assert whole[0] * 2 < per_16[0]  # what 16 utterances per call gave: 2.4 times as many batches

    assert runner.hash_config()["batches"] == "per shard"  # (padded batches: their grouping is hashed)


@pytest.mark.parametrize(("overrides", "per_call"), [
    ([], 16),  # no batches of its own: batch_size utterances per call, as before
    (["write_collected_feats=true", f"frontend.max_batch_samples={MAX_BATCH_SAMPLES}"], 16),  # features kept
    ([f"frontend.max_batch_samples={MAX_BATCH_SAMPLES}"], WHOLE_SHARD),
])
def test_only_a_frontend_with_batches_of_its_own_whose_features_stay_takes_a_whole_shard(tmp_path, overrides,
                                                                                          per_call):
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={tmp_path / 'train.tsv'}", f"output_dir={tmp_path / 'out'}", "batch_size=16",
        "frontend.type=model", "frontend.model._target_=tests.stats.test_collect_stats.TinyFrontend", *overrides])
    runner = CollectStatsRunner(cfg, "train")
    assert runner.batch_size == per_call
    assert ("batches" in runner.hash_config()) == (per_call == WHOLE_SHARD)


def test_fbank_batches_of_its_own_on_a_gpu_only():
    from espnet3_flows.frontends.fbank_type import FbankType
    from espnet3_flows.frontends.frontend import FrontendConfig

    assert FbankType().own_batches(FrontendConfig()) == ""
    assert FbankType().own_batches(FrontendConfig(device="cuda")) == "gathered"  # (they never change features)
