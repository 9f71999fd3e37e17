"""The x-vector job with ``toolkit: espnet`` and ``rawnet`` end to end: ESPnet's file names, speaker
means, 8 kHz and stereo audio resampled and averaged as ESPnet's extractor does, local and S3 output."""

from __future__ import annotations

from pathlib import Path

import kaldiio
import librosa
import numpy as np
import pytest
import soundfile as sf
import torch

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.xvector.job import XVectorJobConfig, XVectorRunner, preflight
from espnet3_flows.xvector.random_spk import build_random_espnet_spk, build_random_rawnet3
from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3
from tests.xvector.test_espnet_spk import mixed_waves, recipe_rawnet, speech2embedding

#: utt -> (speaker, rate, channels): mono 16 kHz mostly, one 8 kHz stereo and one 16 kHz stereo file
UTTS = {"a1": ("spkA", 16000, 1), "a2": ("spkA", 16000, 1), "a3": ("spkA", 8000, 2), "a4": ("spkA", 16000, 1),
        "b1": ("spkB", 16000, 1), "b2": ("spkB", 16000, 2), "b3": ("spkB", 16000, 1), "b4": ("spkB", 16000, 1)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("spk_corpus")
    waves = mixed_waves(2 * len(UTTS), seed=7, min_s=0.3, max_s=1.0)
    lines = []
    for i, (utt, (spk, rate, channels)) in enumerate(UTTS.items()):
        left, right = waves[2 * i], waves[2 * i + 1][: len(waves[2 * i])]
        right = np.pad(right, (0, len(left) - len(right)))
        audio = left if channels == 1 else np.stack([left, 0.5 * right], axis=1)
        if rate != 16000:
            audio = audio[::2]
        sf.write(root / f"{utt}.wav", audio, rate, subtype="FLOAT")
        lines.append(f"{utt}\t{root / f'{utt}.wav'}\t\t{spk}\n")
    (root / "valid.tsv").write_text("".join(lines))
    return root


def espnet_input(path: Path) -> np.ndarray:
    """The audio ESPnet's extract_spk_embed.py gives its model: channels averaged, librosa to 16 kHz."""
    audio, rate = sf.read(path, dtype="float32", always_2d=True)
    audio = audio.mean(axis=1, dtype=np.float32)
    return librosa.resample(audio, orig_sr=rate, target_sr=16000) if rate != 16000 else audio


def run(corpus: Path, out: str, toolkit: str, model: Path, *extra: str):
    cfg = load_config(XVectorJobConfig, overrides=[
        f"xvector.toolkit={toolkit}", f"xvector.pretrained_model={model}", f"manifests.valid={corpus / 'valid.tsv'}",
        f"output_dir={out}", "xvector.batch_size=8", "shard_size=4", "parallel.env=serial", *extra])
    preflight(cfg)
    return cfg, XVectorRunner(cfg, "valid").run(progress=False)


def check_outputs(split: Path, reference: dict[str, np.ndarray], tag: str = "espnet_spk") -> None:
    """.pt per utterance, {tag}.scp and spk_{tag}.scp as ESPnet names them, equal to ``reference``."""
    utt = kaldiio.load_scp(str(split / f"{tag}.scp"))
    assert sorted(utt) == sorted(UTTS)
    for key, want in reference.items():
        pt = torch.load(split / f"{key}.pt", weights_only=True).numpy()
        np.testing.assert_array_equal(pt, utt[key])
        np.testing.assert_allclose(pt, want, rtol=0, atol=1e-5)
    spk = kaldiio.load_scp(str(split / f"spk_{tag}.scp"))
    assert sorted(spk) == ["spkA", "spkB"]
    for speaker in spk:
        members = [utt[k].astype(np.float64) for k, (s, _, _) in UTTS.items() if s == speaker]
        np.testing.assert_allclose(spk[speaker], np.mean(members, axis=0), rtol=1e-6, atol=1e-7)


def test_espnet_toolkit_equals_speech2embedding_with_espnet_names(corpus, tmp_path):
    pth = build_random_espnet_spk(tmp_path / "exp", "rawnet3")
    cfg, outcome = run(corpus, str(tmp_path / "out"), "espnet", pth)
    assert (cfg.xvector.spk_embed_tag, cfg.xvector.resampler) == ("espnet_spk", "librosa")
    assert outcome.merged["utterances"] == 8 and outcome.merged["speakers"] == 2
    assert outcome.merged["embedding_dim"] == 16 and len(outcome.plan.shards) > 1
    keys = list(UTTS)
    ref = speech2embedding(pth, [espnet_input(corpus / f"{k}.wav") for k in keys])
    check_outputs(tmp_path / "out" / "espnet_spk" / "valid", dict(zip(keys, ref, strict=True)))
    again = XVectorRunner(cfg, "valid").run(progress=False)
    assert again.computed == 0  # the model's files are in the shard hashes, unchanged


@pytest.mark.s3
def test_rawnet_toolkit_equals_the_recipe_on_s3(corpus, tmp_path, s3_output):
    import s3fs

    url, options = s3_output
    weights = build_random_rawnet3(tmp_path / "rawnet" / "model.pt")
    _, outcome = run(corpus, url, "rawnet", weights, *(f"storage_options.{k}={v}" for k, v in options.items()
                                                        if k in ("key", "secret")),
                     f"storage_options.client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}")
    assert outcome.merged["utterances"] == 8
    fs = s3fs.S3FileSystem(**options)
    local = tmp_path / "fetched"
    fs.get(f"{url[len('s3://'):]}/espnet_spk/valid/", str(local), recursive=True)
    for name in ("espnet_spk", "spk_espnet_spk"):  # the scps name the arks by their S3 URLs
        line = (local / f"{name}.scp").read_text().splitlines()[0]
        assert line.split(" ", 1)[1].startswith(f"{url}/espnet_spk/valid/{name}.ark:")
        (local / f"{name}.scp").write_text((local / f"{name}.scp").read_text().replace(
            f"{url}/espnet_spk/valid", str(local)))
    model = load_recipe_rawnet3(weights)
    check_outputs(local, {k: recipe_rawnet(model, espnet_input(corpus / f"{k}.wav")) for k in UTTS})


def test_toolkit_settings_and_errors(corpus, tmp_path, monkeypatch):
    pth = build_random_espnet_spk(tmp_path / "exp", "ecapa_tdnn")
    base = [f"manifests.valid={corpus / 'valid.tsv'}", f"output_dir={tmp_path}"]
    sb = load_config(XVectorJobConfig, overrides=[*base, f"xvector.pretrained_model={tmp_path}"])
    assert (sb.xvector.toolkit, sb.xvector.spk_embed_tag, sb.xvector.resampler) == ("speechbrain", "xvector", "poly")
    mine = load_config(XVectorJobConfig, overrides=[*base, "xvector.toolkit=espnet", f"xvector.pretrained_model={pth}",
                                                    "xvector.spk_embed_tag=spk", "xvector.resampler=torchaudio"])
    assert (mine.xvector.spk_embed_tag, mine.xvector.resampler) == ("spk", "torchaudio")
    with pytest.raises(ConfigError, match="pretrained_model is required for toolkit espnet"):
        load_config(XVectorJobConfig, overrides=[*base, "xvector.toolkit=espnet"])
    with pytest.raises(ConfigError, match="sampling_rate must be 16000 for toolkit rawnet"):
        load_config(XVectorJobConfig, overrides=[*base, "xvector.toolkit=rawnet", "xvector.pretrained_model=m.pt",
                                                 "xvector.sampling_rate=8000"])
    with pytest.raises(ConfigError, match="resampler must be one of"):
        load_config(XVectorJobConfig, overrides=[*base, "xvector.resampler=sox"])
    missing = load_config(XVectorJobConfig, overrides=[*base, "xvector.toolkit=espnet",
                                                       f"xvector.pretrained_model={tmp_path / 'none.pth'}"])
    with pytest.raises(ConfigError, match=r"^xvector.pretrained_model: .*none.pth.* does not exist"):
        preflight(missing)
    # the extra's modules are looked for, not imported, on the driver: one not installed is named
    monkeypatch.setattr("espnet3_flows.xvector.espnet_spk.SPK_TASK_MODULES",
                        ("espnet2", "espnet3_flows_no_such_module"))
    with pytest.raises(ConfigError, match=r"needs ESPnet's speaker task, which is not installed "
                                          r"\(no espnet3_flows_no_such_module\): pip install 'espnet3-flows\[espnet\]'"):
        preflight(mine)
