"""`frontend.type: espnet2` against ESPnet2's own collect_stats, and model frontends on CPU/GPU.

ESPnet2's side runs its own code: ``espnet2.main_funcs.collect_stats.collect_stats`` (what
``asr_train.py --collect_stats true`` runs in ``asr.sh`` stage 10) with ESPnet2's
``DefaultFrontend``, reading ``wav.scp`` with ESPnet2's ``SoundScpReader``. The model it is given
is ``ESPnetASRModel.collect_feats`` for audio without text, restated in four lines
(:class:`FrontendOnlyModel`): importing ``ESPnetASRModel`` needs ESPnet's whole dependency list,
which pip cannot install (see constraints.txt).
"""

from __future__ import annotations

from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile as sf
import torch

from espnet3_flows.config import ConfigError, load_config
from espnet3_flows.stats import CollectStatsConfig, CollectStatsRunner
from espnet3_flows.frontends.frontend import TorchFrontend, model_frontend

SR = 16000
FRONTEND_CONF = {"n_fft": 512, "hop_length": 128, "n_mels": 80, "fs": "16k"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """40 utterances of 0.4-2.3 s (speech-like: harmonics with a moving pitch, and noise)."""
    root = tmp_path_factory.mktemp("espnet")
    rng = np.random.default_rng(0)
    d = root / "data" / "train"
    d.mkdir(parents=True)
    lines = []
    for i in range(40):
        n = int(rng.uniform(0.4, 2.3) * SR)
        t = np.arange(n) / SR
        f0 = 120 + 60 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t)
        x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / SR) / k for k in range(1, 8)) * 0.1
        x = x * (0.5 + 0.5 * np.sin(2 * np.pi * 2 * t)) + 0.01 * rng.standard_normal(n)
        wav = root / f"u{i:03d}.wav"
        sf.write(wav, x, SR, subtype="PCM_16")
        lines.append(f"utt{i:03d} {wav}\n")
    (d / "wav.scp").write_text("".join(lines))
    return d


class FrontendOnlyModel(torch.nn.Module):
    """``ESPnetASRModel.collect_feats`` → ``_extract_feats`` for audio without text."""

    def __init__(self, frontend):
        super().__init__()
        self.frontend = frontend

    def collect_feats(self, speech, speech_lengths, **kwargs):
        speech = speech[:, : speech_lengths.max()]
        feats, feats_lengths = self.frontend(speech, speech_lengths)
        return {"feats": feats, "feats_lengths": feats_lengths}


def _espnet2_collect_stats(data_dir: Path, out: Path, batch_size: int = 1) -> Path:
    from espnet2.asr.frontend.default import DefaultFrontend
    from espnet2.fileio.sound_scp import SoundScpReader
    from espnet2.main_funcs.collect_stats import collect_stats
    from espnet2.train.abs_espnet_model import AbsESPnetModel

    class Model(FrontendOnlyModel, AbsESPnetModel):
        def forward(self, **batch):
            raise NotImplementedError

    reader = SoundScpReader(str(data_dir / "wav.scp"), always_2d=False)
    keys = sorted(reader.keys())
    batches = []
    for i in range(0, len(keys), batch_size):
        group = keys[i:i + batch_size]
        waves = [np.asarray(reader[k][1], dtype=np.float32) for k in group]  # ESPnetDataset's float32 cast
        lengths = torch.tensor([len(w) for w in waves])
        speech = torch.zeros(len(waves), int(lengths.max()))
        for j, w in enumerate(waves):
            speech[j, : len(w)] = torch.from_numpy(w)
        batches.append((group, {"speech": speech, "speech_lengths": lengths}))
    model = Model(DefaultFrontend(**FRONTEND_CONF)).eval()
    collect_stats(model=model, train_iter=batches, valid_iter=batches[:1], output_dir=out, ngpu=0, log_interval=None,
                  write_collected_feats=False)
    return out / "train"


def _ours(data_dir: Path, out: Path, *extra: str):
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={data_dir}", f"output_dir={out}", "parallel.env=serial", "frontend.type=espnet2",
        *[f"frontend.conf.{k}={v}" for k, v in FRONTEND_CONF.items()], "write_collected_feats=true", *extra])
    return CollectStatsRunner(cfg, "train").run(progress=False)


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _mean_std(stats: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    count = float(stats["count"])
    mean = stats["sum"] / count
    return mean, np.sqrt(np.maximum(stats["sum_square"] / count - mean ** 2, 0))


def test_parity_with_espnet2_collect_stats(data_dir, tmp_path):
    ref_dir = _espnet2_collect_stats(data_dir, tmp_path / "espnet2")
    out = tmp_path / "ours"
    # batch_size 16: several utterances per forward call, each still run alone through the frontend
    outcome = _ours(data_dir, out, "batch_size=16", "shard_size=15")
    assert outcome.merged["utterances"] == 40 and len(outcome.shards) > 1
    ref, ours = _npz(ref_dir / "feats_stats.npz"), _npz(out / "train/feats_stats.npz")
    assert int(ours["count"]) == int(ref["count"])
    assert sorted((out / "train/speech_shape").read_text().splitlines()) == \
        sorted((ref_dir / "speech_shape").read_text().splitlines())
    (ref_mean, ref_std), (mean, std) = _mean_std(ref), _mean_std(ours)
    mean_err = float(np.max(np.abs(mean - ref_mean) / np.abs(ref_mean)))
    std_err = float(np.max(np.abs(std - ref_std) / ref_std))
    # measured: mean 3e-7, std 1.0e-4: ESPnet2 sums squares in float32, so its std cancels
    assert mean_err < 1e-5 and std_err < 1e-3, (mean_err, std_err)
    assert (out / "train/stats_keys").read_text() == (ref_dir / "stats_keys").read_text()
    assert (out / "train/batch_keys").read_text() == (ref_dir / "batch_keys").read_text()
    lengths, ref_lengths = _npz(out / "train/feats_lengths_stats.npz"), _npz(ref_dir / "feats_lengths_stats.npz")
    assert {k: (v.dtype, int(v)) for k, v in lengths.items()} == {k: (v.dtype, int(v)) for k, v in ref_lengths.items()}
    # ours are the exact statistics of the features (float64 over every frame)
    feats = dict(kaldiio.load_scp(str(out / "train/collect_feats/feats.scp")))
    frames = np.concatenate(list(feats.values())).astype(np.float64)
    np.testing.assert_allclose(mean, frames.mean(0), rtol=1e-9)
    np.testing.assert_allclose(std, frames.std(0), rtol=1e-7)

    # ESPnet2's GlobalMVN with our stats file normalizes our features to mean 0, std 1
    from espnet2.layers.global_mvn import GlobalMVN

    mvn = GlobalMVN(stats_file=str(out / "train/feats_stats.npz"))
    normed = [mvn(torch.from_numpy(np.array(f))[None], torch.tensor([len(f)]))[0][0].numpy() for f in feats.values()]
    allf = np.concatenate(normed).astype(np.float64)
    assert np.abs(allf.mean(0)).max() < 1e-3 and np.abs(allf.std(0) - 1).max() < 1e-3


def test_features_do_not_depend_on_batch_padding(data_dir, tmp_path):
    """ESPnet2's padded batches change the last frames of shorter utterances (center=True STFT);
    ours equal ESPnet2's frontend on each utterance alone, whatever the batch size: to the bit
    with ESPnet2's class (``frontend.espnet2_class``), to float32 rounding with the fast path."""
    from espnet2.asr.frontend.default import DefaultFrontend

    out, out_class = tmp_path / "ours", tmp_path / "class"
    _ours(data_dir, out, "batch_size=8")
    _ours(data_dir, out_class, "batch_size=8", "frontend.espnet2_class=true")
    feats = dict(kaldiio.load_scp(str(out / "train/collect_feats/feats.scp")))
    feats_class = dict(kaldiio.load_scp(str(out_class / "train/collect_feats/feats.scp")))
    frontend = DefaultFrontend(**FRONTEND_CONF).eval()
    for line in (data_dir / "wav.scp").read_text().splitlines()[:10]:
        utt, wav = line.split()
        x = torch.from_numpy(sf.read(wav, dtype="float32")[0])[None]
        with torch.inference_mode():
            alone = frontend(x, torch.tensor([x.shape[1]]))[0][0].numpy()
        np.testing.assert_array_equal(feats_class[utt], alone)
        np.testing.assert_allclose(feats[utt], alone, rtol=0, atol=5e-6)  # tests/frontends/test_espnet2_default.py
    # what ESPnet2's own padded batch of 8 does to them: the std of the statistics moves
    padded = _mean_std(_npz(_espnet2_collect_stats(data_dir, tmp_path / "padded", batch_size=8) / "feats_stats.npz"))
    exact = _mean_std(_npz(out / "train/feats_stats.npz"))
    assert np.max(np.abs(padded[1] - exact[1]) / exact[1]) > 1e-4
    exact_class = _mean_std(_npz(out_class / "train/feats_stats.npz"))
    np.testing.assert_allclose(exact[0], exact_class[0], rtol=1e-7)
    np.testing.assert_allclose(exact[1], exact_class[1], rtol=1e-6)


def test_espnet_config_gives_the_same_shards(data_dir, tmp_path):
    import yaml

    config = tmp_path / "exp/asr_train/config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(yaml.safe_dump({"frontend": "default", "frontend_conf": FRONTEND_CONF, "normalize": "global_mvn",
                                      "encoder": "conformer"}))
    out = tmp_path / "out"
    first = _ours(data_dir, out)
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={data_dir}", f"output_dir={out}", "parallel.env=serial", "frontend.type=espnet2",
        f"frontend.espnet_config={config}", "write_collected_feats=true"])
    assert cfg.frontend.name == "default" and cfg.frontend.sampling_rate == 16000
    again = CollectStatsRunner(cfg, "train").run(progress=False)
    assert again.computed == 0 and again.cached == len(first.shards)
    # fs in frontend_conf sets the sampling rate
    config.write_text(yaml.safe_dump({"frontend": "default", "frontend_conf": {**FRONTEND_CONF, "fs": "8k"}}))
    cfg8 = load_config(CollectStatsConfig, overrides=["frontend.type=espnet2", f"frontend.espnet_config={config}"])
    assert cfg8.frontend.sampling_rate == 8000


def test_espnet2_config_errors(tmp_path, monkeypatch):
    def cfg(*o):
        return load_config(CollectStatsConfig, overrides=list(o))

    with pytest.raises(ConfigError, match=r"frontend.name must be one of \('', 'default', .*got 'mystery'"):
        cfg("frontend.type=espnet2", "frontend.name=mystery")
    with pytest.raises(ConfigError, match="does not exist"):
        cfg("frontend.type=espnet2", f"frontend.espnet_config={tmp_path}/missing.yaml")
    nofe = tmp_path / "config.yaml"
    nofe.write_text("frontend: null\nnormalize: global_mvn\n")
    with pytest.raises(ConfigError, match="has no frontend"):
        cfg("frontend.type=espnet2", f"frontend.espnet_config={nofe}")
    from espnet3_flows.frontends.espnet2_frontend import build_espnet2_frontend

    with pytest.raises(ConfigError, match="frontend.conf does not fit ESPnet2's DefaultFrontend"):
        build_espnet2_frontend("default", {"n_ffft": 512})
    with pytest.raises(ConfigError, match=r"does not fit ESPnet2's DefaultFrontend: .*n_fft.* is not an instance"):
        build_espnet2_frontend("default", {"n_fft": 512.0})  # typeguard's TypeCheckError is no TypeError
    with pytest.raises(ConfigError, match="are for type=espnet2, not type=fbank"):
        cfg("frontend.name=default")
    with pytest.raises(ConfigError, match="frontend.device=cuda is for type=fbank, model or espnet2"):
        cfg("frontend.type=none", "frontend.device=cuda")
    import importlib.util

    from espnet3_flows.frontends import espnet2_frontend as espnet_frontend

    real = importlib.util.find_spec
    monkeypatch.setattr(espnet_frontend.importlib.util, "find_spec",
                        lambda name, *a: None if name == "espnet2" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs ESPnet2, which is not installed: pip install 'espnet3-flows\[espnet\]'"):
        cfg("frontend.type=espnet2")


# ---- model frontends: one utterance per call, or length-sorted padded batches ---------------
class TinyHubert(torch.nn.Module):
    """A randomly initialised, HuBERT-shaped model (conv feature extractor + transformer) from
    torchaudio's wav2vec2 builder: nothing is downloaded. ``collect_feats`` returns its last layer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        import torchaudio

        torch.manual_seed(seed)
        self.model = torchaudio.models.wav2vec2_model(
            extractor_mode="group_norm", extractor_conv_layer_config=[(32, 10, 5), (32, 3, 2), (32, 2, 2)],
            extractor_conv_bias=False, encoder_embed_dim=48, encoder_projection_dropout=0.0,
            encoder_pos_conv_kernel=16, encoder_pos_conv_groups=4, encoder_num_layers=2, encoder_num_heads=4,
            encoder_attention_dropout=0.0, encoder_ff_interm_features=96, encoder_ff_interm_dropout=0.0,
            encoder_dropout=0.0, encoder_layer_norm_first=False, encoder_layer_drop=0.0, aux_num_out=None)

    def collect_feats(self, speech, speech_lengths, **kwargs):
        feats, lengths = self.model.extract_features(speech, speech_lengths)
        return {"feats": feats[-1], "feats_lengths": lengths}


def test_model_frontend_alone_equals_one_by_one_and_batches_are_bounded():
    rng = np.random.default_rng(1)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (4800, 8000, 4900, 8100, 5000)]
    model = TinyHubert()
    alone = [model_frontend(model)([w], {})[0] for w in waves]
    exact = model_frontend(model)(waves, {})
    for a, b in zip(alone, exact, strict=True):
        np.testing.assert_array_equal(a, b)
    batched = model_frontend(model, max_batch_samples=24000)
    assert batched.batches([len(w) for w in waves]) == [[0, 2, 4], [1, 3]]  # 3 x 5000, then 2 x 8100
    got = batched(waves, {})
    assert [g.shape for g in got] == [a.shape for a in alone]
    np.testing.assert_allclose(got[3], alone[3], rtol=1e-5, atol=1e-5)  # the longest is not padded


def test_model_frontend_through_the_job_on_cpu(data_dir, tmp_path):
    out = tmp_path / "out"
    cfg = load_config(CollectStatsConfig, overrides=[
        f"manifests.train={data_dir}", f"output_dir={out}", "parallel.env=serial", "frontend.type=model",
        "frontend.model._target_=tests.frontends.test_espnet2_frontend.TinyHubert", "frontend.device=cpu"])
    summary = CollectStatsRunner(cfg, "train").run(progress=False).merged
    assert summary["utterances"] == 40
    stats = _npz(out / "train/feats_stats.npz")
    assert stats["sum"].shape == (48,) and int(stats["count"]) > 0


def test_cuda_device_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a worker without a GPU
    with pytest.raises(RuntimeError, match="frontend.device=cuda but this worker sees no CUDA GPU"):
        TorchFrontend(lambda s, n, k: (s, n), torch.nn.Identity(), "cuda")


@pytest.mark.gpu
def test_espnet2_and_model_frontends_on_gpu_equal_cpu(data_dir, tmp_path):
    from espnet2.asr.frontend.default import DefaultFrontend

    from espnet3_flows.frontends.frontend import espnet2_frontend

    waves = [sf.read(line.split()[1], dtype="float32")[0] for line in (data_dir / "wav.scp").read_text().splitlines()[:8]]
    cpu = espnet2_frontend(DefaultFrontend(**FRONTEND_CONF))(waves, {})
    gpu = espnet2_frontend(DefaultFrontend(**FRONTEND_CONF), "cuda")(waves, {})
    for a, b in zip(cpu, gpu, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    model_cpu = model_frontend(TinyHubert())(waves, {})
    model_gpu = model_frontend(TinyHubert(), "cuda", max_batch_samples=400_000)(waves, {})
    for a, b in zip(model_cpu, model_gpu, strict=True):
        assert a.shape == b.shape


def test_collected_feats_as_espnet2_npy(data_dir, tmp_path):
    """``collected_feats_format=npy``: the layout of ESPnet2's NpyScpWriter, read by its NpyScpReader."""
    from espnet2.fileio.npy_scp import NpyScpReader

    _ours(data_dir, tmp_path / "ark", "shard_size=15")
    outcome = _ours(data_dir, tmp_path / "npy", "shard_size=15", "collected_feats_format=npy")
    assert outcome.merged["utterances"] == 40
    scp = tmp_path / "npy/train/collect_feats/feats.scp"
    npy = NpyScpReader(str(scp))
    ark = dict(kaldiio.load_scp(str(tmp_path / "ark/train/collect_feats/feats.scp")))
    assert sorted(npy.keys()) == sorted(ark)
    for utt in ark:
        np.testing.assert_array_equal(npy[utt], ark[utt])
    assert len(list((tmp_path / "npy/train/collect_feats/data_feats").glob("*.npy"))) == 40
    assert not list((tmp_path / "npy/train/collect_feats").glob("*.ark"))
    with pytest.raises(ConfigError, match=r"collected_feats_format must be one of \('ark', 'npy'\), got 'hdf5'"):
        load_config(CollectStatsConfig, overrides=["collected_feats_format=hdf5"])
