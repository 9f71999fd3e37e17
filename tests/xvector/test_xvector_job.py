"""The x-vector job end to end on a random-weight ECAPA model directory (on Dask:
tests/orchestration/test_xvector_flow.py)."""

from __future__ import annotations

from pathlib import Path

import kaldiio
import numpy as np
import pytest
import torch

from espnet3_flows.inputs.audio import AudioConfig, read_audio
from espnet3_flows.config import ConfigError, load_config, to_plain
from espnet3_flows.inputs.manifest import read_manifest
from espnet3_flows.xvector.job import XVectorJobConfig, XVectorRunner
from espnet3_flows.xvector.model import load_speechbrain_encoder
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir


@pytest.fixture(scope="module")
def ecapa_dir(tmp_path_factory) -> Path:
    return build_random_ecapa_dir(tmp_path_factory.mktemp("ecapa") / "model")


def _cfg(ecapa_dir, manifest, out, *extra) -> XVectorJobConfig:
    return load_config(XVectorJobConfig, overrides=[
        f"xvector.pretrained_model={ecapa_dir}", f"xvector.manifest_paths.valid={manifest}",
        f"xvector.save_path={out}", "xvector.batch_size=4", "shard_size=5", "parallel.env=serial", *extra])


def _run(cfg, client=None):
    runner = XVectorRunner(cfg, "valid")
    return runner.run(client=client, progress=False)


def test_outputs_match_single_utterance_encoding(ecapa_dir, demo_corpus, tmp_path):
    out = tmp_path / "xv"
    outcome = _run(_cfg(ecapa_dir, demo_corpus["valid"], out))
    summary = outcome.merged
    assert summary["utterances"] == 12 and summary["speakers"] == 3 and summary["embedding_dim"] == 192
    utts, _ = read_manifest(demo_corpus["valid"], "valid")
    split_dir = out / "xvector" / "valid"
    encoder = load_speechbrain_encoder(ecapa_dir, tmp_path / "sb")
    scp = kaldiio.load_scp(str(split_dir / "xvector.scp"))
    assert sorted(scp) == sorted(u.utt_id for u in utts)
    # merged per-utterance outputs follow the manifest, shard by shard
    scp_keys = [line.split(" ", 1)[0] for line in (split_dir / "xvector.scp").read_text().splitlines()]
    assert scp_keys == [u.utt_id for u in utts]
    utt2spk = [tuple(line.split(" ")) for line in (split_dir / "utt2spk").read_text().splitlines()]
    assert utt2spk == [(u.utt_id, u.speaker) for u in utts]
    for u in utts:
        emb = torch.load(split_dir / f"{u.utt_id}.pt", weights_only=True)
        assert emb.dtype == torch.float32 and emb.shape == (192,)
        np.testing.assert_array_equal(scp[u.utt_id], emb.numpy())
        wave = torch.from_numpy(read_audio(u, AudioConfig()))[None]
        alone = encoder.encode_batch(wave, torch.ones(1))[0, 0]
        cos = torch.nn.functional.cosine_similarity(alone, emb, dim=0).item()
        assert cos >= 0.9999, (u.utt_id, cos)
    spk = kaldiio.load_scp(str(split_dir / "spk_xvector.scp"))
    for speaker in {u.speaker for u in utts}:
        members = [torch.load(split_dir / f"{u.utt_id}.pt", weights_only=True).double().numpy()
                   for u in utts if u.speaker == speaker]
        np.testing.assert_allclose(spk[speaker], np.mean(members, axis=0), rtol=1e-6, atol=1e-7)
    assert (split_dir / "summary.json").is_file() and (split_dir / "skipped.tsv").is_file()

    n_shards = len(outcome.plan.shards)
    assert n_shards > 1 and outcome.computed == n_shards and summary["shards"] == n_shards
    again = _run(_cfg(ecapa_dir, demo_corpus["valid"], out))
    assert (again.computed, again.cached) == (0, n_shards)


def test_new_utterances_only_are_computed(ecapa_dir, demo_corpus, tmp_path):
    """Appended lines compute only the shards they change (which shards is planning, the same on
    any executor; that Dask's x-vectors equal serial ones: test_xvector_flow_on_local_cluster)."""
    manifest = tmp_path / "valid.tsv"
    lines = Path(demo_corpus["valid"]).read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:10]))
    first = _run(_cfg(ecapa_dir, manifest, tmp_path / "out"))
    n_first = len(first.plan.shards)
    assert n_first > 1 and (first.computed, first.cached) == (n_first, 0)
    manifest.write_text("".join(lines))
    grown = _run(_cfg(ecapa_dir, manifest, tmp_path / "out"))
    # appended lines: every closed shard but the first run's last is kept; only that last shard
    # (when the new lines join it) and the new shards are computed
    kept = n_first - 1
    assert [s.hash for s in grown.plan.shards[:kept]] == [s.hash for s in first.plan.shards[:kept]]
    # True when line 10 ended a shard by content: then that shard is unchanged too
    last_unchanged = grown.plan.shards[kept].hash == first.plan.shards[-1].hash
    n_cached = kept + last_unchanged
    assert [s.cached for s in grown.shards] == [True] * n_cached + [False] * (len(grown.plan.shards) - n_cached)
    assert grown.plan.shards[-1].stop == 12 and first.plan.num_items == 10
    assert grown.merged["utterances"] == 12
    assert len(kaldiio.load_scp(str(tmp_path / "out/xvector/valid/xvector.scp"))) == 12


def test_bad_audio_is_skipped_and_listed(ecapa_dir, demo_corpus, tmp_path):
    manifest = tmp_path / "valid.tsv"
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF\x00\x00garbage" * 10)
    lines = Path(demo_corpus["valid"]).read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:6]) + f"bad-utt\t{broken}\t\tspkX\n")
    out = tmp_path / "xv"
    summary = _run(_cfg(ecapa_dir, manifest, out, "on_error=skip")).merged
    assert summary["utterances"] == 6 and summary["skipped"] == 1
    skipped = (out / "xvector/valid/skipped.tsv").read_text()
    assert "bad-utt" in skipped and "\t7\t" in skipped and "cannot decode audio" in skipped
    assert not (out / "xvector/valid/bad-utt.pt").exists()
    with pytest.raises(Exception, match=r"split valid, line 7, utt 'bad-utt'"):
        _run(_cfg(ecapa_dir, manifest, tmp_path / "fail"))


def test_config_errors_before_work(ecapa_dir, demo_corpus, tmp_path):
    with pytest.raises(ConfigError, match="pretrained_model"):
        load_config(XVectorJobConfig, overrides=[f"xvector.manifest_paths.valid={demo_corpus['valid']}"])
    with pytest.raises(ConfigError, match="splits"):
        _cfg(ecapa_dir, demo_corpus["valid"], tmp_path, "xvector.splits=[train]")
    with pytest.raises(ConfigError, match="device"):
        _cfg(ecapa_dir, demo_corpus["valid"], tmp_path, "xvector.device=gpu0")
    with pytest.raises(ConfigError, match="spk_embed_tag"):
        _cfg(ecapa_dir, demo_corpus["valid"], tmp_path, "xvector.spk_embed_tag=../x")


def test_espnet3_names_are_aliases_of_manifests_and_output_dir(ecapa_dir, demo_corpus, tmp_path):
    model = f"xvector.pretrained_model={ecapa_dir}"
    seed = load_config(XVectorJobConfig, overrides=[model, f"xvector.manifest_paths.valid={demo_corpus['valid']}",
                                                    f"xvector.save_path={tmp_path / 'a'}"])
    common = load_config(XVectorJobConfig, overrides=[model, f"manifests.valid={demo_corpus['valid']}",
                                                      f"output_dir={tmp_path / 'a'}"])
    assert seed == common and seed.output_dir == str(tmp_path / "a") == seed.xvector.save_path
    assert seed.manifests == {"valid": demo_corpus["valid"]} == seed.xvector.manifest_paths
    assert load_config(XVectorJobConfig, base=to_plain(seed)) == seed  # a dumped config loads back
    # a later source wins whichever name it uses; one source giving both, differently, is an error
    conf = tmp_path / "xv.yaml"
    conf.write_text(f"xvector:\n  pretrained_model: {ecapa_dir}\n  save_path: {tmp_path / 'file'}\n"
                    f"  manifest_paths:\n    valid: {demo_corpus['valid']}\n")
    assert load_config(XVectorJobConfig, conf, [f"output_dir={tmp_path / 'cli'}"]).output_dir == str(tmp_path / "cli")
    assert load_config(XVectorJobConfig, conf).output_dir == str(tmp_path / "file")
    with pytest.raises(ConfigError, match="output_dir and xvector.save_path are the same key"):
        load_config(XVectorJobConfig, conf, [f"output_dir={tmp_path / 'b'}", f"xvector.save_path={tmp_path / 'c'}"])
    with pytest.raises(ConfigError, match="manifests and xvector.manifest_paths"):
        load_config(XVectorJobConfig, conf, ["manifests.train=x.tsv", "xvector.manifest_paths.valid=y.tsv"])
    assert load_config(XVectorJobConfig, overrides=[model, "manifests.valid=v.tsv"]).output_dir == "exp/xvectors"


def test_files_are_named_after_the_tag_as_espnet2_names_them(ecapa_dir, demo_corpus, tmp_path):
    out = tmp_path / "xv"
    summary = _run(_cfg(ecapa_dir, demo_corpus["valid"], out, "xvector.spk_embed_tag=espnet_spk")).merged
    split = out / "espnet_spk" / "valid"
    assert {"espnet_spk.ark", "espnet_spk.scp", "spk_espnet_spk.ark", "spk_espnet_spk.scp"} <= set(summary["files"])
    assert not (split / "xvector.scp").exists() and not (split / "spk_xvector.scp").exists()
    utt = kaldiio.load_scp(str(split / "espnet_spk.scp"))
    spk = kaldiio.load_scp(str(split / "spk_espnet_spk.scp"))
    assert len(utt) == summary["utterances"] and len(spk) == summary["speakers"]
    with pytest.raises(ConfigError, match="must be a plain name"):
        _cfg(ecapa_dir, demo_corpus["valid"], tmp_path, "xvector.spk_embed_tag=x y")


def test_the_default_link_directory_is_removed_once_the_model_is_loaded(ecapa_dir, tmp_path, monkeypatch, demo_corpus):
    """Before: every load left an ``espnet3-speechbrain-*`` directory in the temporary folder (one
    per worker and run: thousands after months of nightly runs)."""
    import tempfile

    from espnet3_flows.xvector.toolkits.speechbrain import SpeechbrainToolkit

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = load_config(XVectorJobConfig, overrides=[f"manifests.valid={demo_corpus['valid']}",
                                                    f"xvector.pretrained_model={ecapa_dir}"])
    embed = SpeechbrainToolkit().embedder(cfg.xvector)
    assert list(tmp_path.iterdir()) == []
    wav = torch.zeros(1, 16000)
    assert embed(wav, torch.tensor([1.0])).shape[0] == 1  # the loaded model needs none of the links
