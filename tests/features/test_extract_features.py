"""extract-features, the job built only from the job contract: Kaldi ark/scp, a lhotse CutSet
that loads the same features, resume, incremental runs, bad items, a local Dask cluster."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.inputs.audio import AudioConfig, load_audio
from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.features.job import ExtractFeaturesConfig, FeatureRunner
from espnet3_flows.inputs.manifest import read_manifest
from espnet3_flows.orchestration.flows import run_job
from espnet3_flows.frontends.frontend import FrontendConfig, build_frontend
from tests.support.floats import assert_same_floats
from tests.support.servers import cli_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.prefect


def _cuts(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_features_equal_the_frontend_and_lhotse_loads_them(prefect_harness, demo_corpus, tmp_path):
    from lhotse import CutSet

    out = tmp_path / "out"
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(out), "shard_size": 5,
           "parallel": {"env": "serial"}}
    summary = run_job("extract_features", cfg, progress=False)["valid"]
    utts, _ = read_manifest(demo_corpus["valid"], "valid")
    assert summary["utterances"] == len(utts) and summary["shards_computed"] == summary["shards"] >= 2
    assert summary["feature_dim"] == 80 and summary["frame_shift"] == 0.01 and summary["skipped"] == 0
    assert set(summary["files"]) == {"feats.scp", "feats_shape", "cuts.jsonl.gz", "skipped.tsv", "summary.json"}

    feats = kaldiio.load_scp(str(out / "valid" / "feats.scp"))
    assert list(feats.keys()) == sorted(u.utt_id for u in utts)  # sorted by id, as Kaldi keeps an scp
    frontend, fe = build_frontend(FrontendConfig()), FrontendConfig()
    audio = AudioConfig(fe.sampling_rate, fe.channel, fe.max_duration)
    for u in utts[:3]:  # exactly what the frontend computes on the utterance alone
        wave, _ = load_audio(u, audio)
        np.testing.assert_array_equal(feats[u.utt_id], frontend([wave], {})[0].astype(np.float32))
    shapes = dict(line.split() for line in (out / "valid" / "feats_shape").read_text().splitlines())
    assert shapes == {k: f"{v.shape[0]},{v.shape[1]}" for k, v in feats.items()}

    cuts = CutSet.from_file(out / "valid" / "cuts.jsonl.gz")
    assert [c.id for c in cuts] == sorted(u.utt_id for u in utts)
    for cut, u in zip(cuts, sorted(utts, key=lambda u: u.utt_id), strict=True):
        np.testing.assert_array_equal(cut.load_features(), feats[u.utt_id])
        assert cut.num_frames == feats[u.utt_id].shape[0] and cut.num_features == 80
        assert cut.supervisions[0].speaker == u.speaker and cut.supervisions[0].text == u.text


def test_resume_and_incremental_runs_on_a_local_cluster(prefect_harness, demo_corpus, tmp_path):
    manifest = tmp_path / "train.tsv"
    lines = Path(demo_corpus["train"]).read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:40]))
    cfg = {"manifests": {"train": str(manifest)}, "output_dir": str(tmp_path / "out"), "shard_size": 8,
           "parallel": {"env": "local", "n_workers": 2}}
    first = run_job("extract_features", cfg, progress=False)["train"]
    assert first["utterances"] == 40 and first["shards_computed"] == first["shards"]
    again = run_job("extract_features", cfg, progress=False)["train"]  # nothing changed: nothing computed
    assert again["shards_computed"] == 0 and again["utterances"] == 40

    manifest.write_text("".join(lines))  # 8 lines appended: the last (partial) shard and new ones recompute
    grown = run_job("extract_features", cfg | {"parallel": {"env": "serial"}}, progress=False)["train"]
    assert grown["utterances"] == 48 and grown["shards_cached"] >= first["shards"] - 1
    assert grown["shards_computed"] == grown["shards"] - grown["shards_cached"] <= 3
    full = run_job("extract_features", cfg | {"manifests": {"train": demo_corpus["train"]},
                                              "output_dir": str(tmp_path / "full"), "parallel": {"env": "serial"}},
                   progress=False)["train"]
    assert full["utterances"] == 48
    a = kaldiio.load_scp(str(tmp_path / "out" / "train" / "feats.scp"))
    b = kaldiio.load_scp(str(tmp_path / "full" / "train" / "feats.scp"))
    assert list(a.keys()) == list(b.keys())
    for key in a:
        assert_same_floats(a[key], b[key])  # shards of workers and of this process
    assert len(_cuts(tmp_path / "out" / "train" / "cuts.jsonl.gz")) == 48


@pytest.mark.parametrize("threads", [{}, {"decode_threads": 2, "batch_size": 2}], ids=["serial", "decoded ahead"])
def test_bad_items_are_skipped_or_fail_the_run(prefect_harness, demo_corpus, tmp_path, threads):
    """Also with the next call's files decoded ahead (``decode_threads``): the missing file is
    read during the call before its own, and is still that call's bad item."""
    lines = Path(demo_corpus["valid"]).read_text().splitlines(keepends=True)
    manifest = tmp_path / "valid.tsv"
    manifest.write_text("".join(lines[:3]) + "zz-missing\t/nonexistent/audio.wav\n" + "".join(lines[3:6]))
    cfg = {"manifests": {"valid": str(manifest)}, "output_dir": str(tmp_path / "skip"), "shard_size": 4,
           "on_error": "skip", "parallel": {"env": "serial"}, **threads}
    summary = run_job("extract_features", cfg, progress=False)["valid"]
    assert summary["utterances"] == 6 and summary["skipped"] == 1
    assert "zz-missing" in (tmp_path / "skip" / "valid" / "skipped.tsv").read_text()
    assert "zz-missing" not in {c["id"] for c in _cuts(tmp_path / "skip" / "valid" / "cuts.jsonl.gz")}
    with pytest.raises(Exception, match="zz-missing"):
        run_job("extract_features", cfg | {"on_error": "fail", "output_dir": str(tmp_path / "fail")}, progress=False)
    assert not (tmp_path / "fail" / "valid" / "summary.json").exists()


def test_config_refuses_a_frontend_without_features():
    with pytest.raises(ConfigError, match="frontend.type=none"):
        load_config(ExtractFeaturesConfig, overrides=["frontend.type=none"])


def test_command_line_demo_and_help(tmp_path, session_api_url):
    env = cli_env(tmp_path / "prefect-home", api_url=session_api_url)
    out = tmp_path / "exp" / "features"
    proc = subprocess.run([sys.executable, "flows/extract_features.py", f"output_dir={out}", "demo_utterances=20",
                           "shard_size=10", "parallel.env=serial"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "extract_features finished" in proc.stdout
    assert (out / "train" / "cuts.jsonl.gz").is_file() and (out / "train" / "feats.scp").is_file()
    helped = subprocess.run([sys.executable, "-m", "espnet3_flows", "extract_features", "--help"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "frontend.type=" in helped.stdout and "allow_pipes=" in helped.stdout


def test_native_rates_are_recorded_and_mostly_low_rate_input_warns(tmp_path, caplog):
    rows = []
    for i, rate in enumerate([8000, 8000, 8000, 16000]):
        path = tmp_path / f"u{i}.wav"
        sf.write(path, 0.1 * np.sin(np.arange(rate // 2) * (0.05 + 0.01 * i)).astype(np.float32), rate)
        rows.append(f"u{i}\t{path}\n")
    manifest = tmp_path / "train.tsv"
    manifest.write_text("".join(rows))

    def run(out: str, *overrides: str) -> dict:
        cfg = load_config(ExtractFeaturesConfig, overrides=[f"manifests.train={manifest}", f"output_dir={out}",
                                                            "parallel.env=serial", "shard_size=2", *overrides])
        return FeatureRunner(cfg, "train").run(progress=False).merged

    with caplog.at_level("WARNING", logger="espnet3_flows"):
        summary = run(str(tmp_path / "out"))
    assert summary["native_sampling_rates"] == {"8000": 3, "16000": 1}
    [warning] = summary["warnings"]
    assert "3 of 4 utterances" in warning and "frontend.sampling_rate=8000" in warning and warning in caplog.text
    written = json.loads((tmp_path / "out" / "train" / "summary.json").read_text())
    assert written["native_sampling_rates"] == {"8000": 3, "16000": 1} and written["warnings"] == [warning]

    again = run(str(tmp_path / "out8"), "frontend.sampling_rate=8000")  # at the data's own rate: no warning
    assert "warnings" not in again and again["native_sampling_rates"] == {"8000": 3, "16000": 1}
