"""The cuts' frame shift of every built-in frontend extract-features runs, against the audio: each
cut's duration (frames × frame shift) is its recording's, within a frame and a window. Where the
config does not decide the hop (ESPnet2's ``fused``, a model's), the built frontend's module
states it and the shards' ``done`` records carry it to the merge."""

from __future__ import annotations

import gzip
import json

import pytest
import soundfile as sf

from espnet3_flows.inputs.manifest import read_manifest
from espnet3_flows.orchestration.flows import run_job

pytestmark = pytest.mark.prefect

#: two ESPnet2 default frontends of other hops, fused: frames every gcd(128, 160) = 32 samples
FUSED = {"frontends": [{"frontend_type": "default", "n_fft": 512, "hop_length": 128},
                       {"frontend_type": "default", "n_fft": 400, "win_length": 400, "hop_length": 160}],
         "proj_dim": 8}


@pytest.mark.parametrize(("frontend", "shift"), [
    pytest.param({}, 0.01, id="fbank"),
    pytest.param({"frame_shift": 0.02, "frame_length": 0.04}, 0.02, id="fbank-20ms"),
    pytest.param({"type": "espnet2", "name": "default"}, 128 / 16000, id="espnet2-default"),
    pytest.param({"type": "espnet2", "name": "default", "espnet2_class": True, "conf": {"hop_length": 160}},
                 0.01, id="espnet2-default-class"),
    pytest.param({"type": "espnet2", "name": "fused", "conf": FUSED}, 32 / 16000, id="espnet2-fused"),
    pytest.param({"type": "model", "model": {"_target_": "tests.features.strided_model.StridedFrames"}},
                 0.02, id="model-with-a-hop"),
])
def test_each_cut_lasts_as_long_as_its_recording(prefect_harness, demo_corpus, tmp_path, frontend, shift):
    out = tmp_path / "out"
    cfg = {"manifests": {"valid": demo_corpus["valid"]}, "output_dir": str(out), "frontend": frontend,
           "parallel": {"env": "serial"}}
    summary = run_job("extract_features", cfg, progress=False)["valid"]
    assert summary["frame_shift"] == pytest.approx(shift)
    with gzip.open(out / "valid" / "cuts.jsonl.gz", "rt", encoding="utf-8") as f:
        cuts = {c["id"]: c for c in map(json.loads, f)}
    utts, _ = read_manifest(demo_corpus["valid"], "valid")
    assert sorted(cuts) == sorted(u.utt_id for u in utts)
    for utt in utts:
        cut, seconds = cuts[utt.utt_id], sf.info(utt.path).duration
        assert cut["features"]["frame_shift"] == pytest.approx(shift)
        assert abs(cut["duration"] - seconds) <= 2 * shift + 0.04, (utt.utt_id, cut["duration"], seconds)
