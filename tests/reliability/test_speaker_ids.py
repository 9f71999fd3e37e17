"""Speaker ids through real runs: an x-vector run, whose ``utt2spk`` and ``spk_xvector.scp`` are
keyed by speaker id, refuses a speaker id ESPnet's readers would split at planning (the CLI's exit
status 2, one line naming file, line and id) and publishes nothing; collect-stats, which keys no
file by speaker, accepts the same manifest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from espnet3_flows.config import load_config
from espnet3_flows.inputs.records import ManifestError
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from espnet3_flows.xvector.job import XVectorJobConfig, XVectorRunner
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

SR = 16000


def _manifest(root: Path, speaker: str) -> Path:
    """Four utterances; the third one's speaker is ``speaker``."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(4):
        wav = root / f"{i}.wav"
        sf.write(wav, (0.1 * rng.standard_normal(int(SR * 0.3))).astype(np.float32), SR)
        lines.append(f"u{i}\t{wav}\t\t{speaker if i == 2 else f'spk{i % 2}'}\n")
    path = root / "train.tsv"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("speaker", ["John Smith", "a\u3000b"])
def test_an_xvector_run_refuses_a_speaker_id_the_readers_would_split_at_planning(tmp_path, speaker):
    manifest, out = _manifest(tmp_path, speaker), tmp_path / "out"
    runner = XVectorRunner(load_config(XVectorJobConfig, overrides=[
        f"manifests.train={manifest}", "parallel.env=serial", "shard_size=2", f"output_dir={out}",
        f"xvector.pretrained_model={build_random_ecapa_dir(tmp_path / 'ecapa')}"]), "train")
    with pytest.raises(ManifestError) as err:  # the CLI's exit status 2
        runner.run(progress=False)
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert f"{manifest}:3:" in message and "speaker id" in message and repr(speaker) in message
    assert not [p for p in out.rglob("*") if p.is_file() and "shards" not in p.parts
                and p.name != "owner.json"]  # nothing published


def test_collect_stats_accepts_a_speaker_id_with_a_space(tmp_path):
    manifest, out = _manifest(tmp_path, "John Smith"), tmp_path / "out"
    CollectStatsRunner(load_config(CollectStatsConfig, overrides=[
        f"manifests.train={manifest}", "parallel.env=serial", "shard_size=2", f"output_dir={out}"]), "train").run(
        progress=False)
    shapes = (out / "train" / "speech_shape").read_text(encoding="utf-8").splitlines()
    assert [line.split()[0] for line in shapes] == ["u0", "u1", "u2", "u3"]
