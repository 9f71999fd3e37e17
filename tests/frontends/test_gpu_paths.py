"""The GPU paths of the frontends, exact and batched: fbank's gathered batches, SSL models in padded
batches, reduced precision. Each runs on the CPU here; the tests marked ``gpu`` repeat them on a
CUDA GPU against the CPU's results (``--run-gpu``, ``benchmarks/gpu_check.sh`` on the device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lhotse import Fbank, FbankConfig

from espnet3_flows.config import ConfigError
from espnet3_flows.frontends.fbank import FastFbank, FbankTooShortError
from espnet3_flows.frontends.frontend import FbankFrontend, FrontendConfig, build_frontend, model_frontend
from espnet3_flows.frontends.ssl import SSLFeatures

SR = 16000
# measured 4.8e-7 on the CPU (the dense mel product's float32 rounding against the banded one)
FBANK_ATOL = 1e-5


def noise(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(n)).astype(np.float32) for n in lengths]


@pytest.fixture(scope="module")
def hubert() -> SSLFeatures:
    torch.manual_seed(0)
    return SSLFeatures("hubert_base")


@pytest.mark.filterwarnings("ignore:.*snip_edges")
@pytest.mark.parametrize("config", [{}, {"snip_edges": True}, {"frame_shift": 0.02, "frame_length": 0.05},
                                    {"remove_dc_offset": False, "preemph_coeff": 0.0}, {"num_mel_bins": 40}],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_gathered_fbank_batches_equal_each_utterance_alone(config):
    fbank = FastFbank(Fbank(FbankConfig(dither=0.0, **config)))
    lengths = [fbank.min_samples, 400, 401, 12345, 48007, 5 * SR]
    waves = noise(lengths)
    # batches of at most 60k samples: single utterances, pairs and one longer than the limit
    ours = fbank.batch(waves, "cpu", max_batch_samples=60_000, gather=True)
    for got, wave in zip(ours, waves, strict=True):
        alone = fbank(wave)
        assert got.shape == alone.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, alone, rtol=0, atol=FBANK_ATOL)


def test_fbank_batch_errors_and_cpu_default():
    fbank = FastFbank(Fbank(FbankConfig(dither=0.0)))
    with pytest.raises(FbankTooShortError, match="shorter than one fbank frame"):
        fbank.batch(noise([SR, fbank.min_samples - 1]), "cpu", gather=True)
    with pytest.raises(ValueError, match="mono"):
        fbank.batch([np.zeros((2, SR), np.float32)], "cpu")
    waves = noise([SR, 2 * SR])
    # on the CPU the default is one utterance at a time: the very arrays __call__ gives
    for got, wave in zip(fbank.batch(waves, "cpu"), waves, strict=True):
        np.testing.assert_array_equal(got, fbank(wave))


def test_frontend_config_device_and_precision():
    assert FrontendConfig(device="cuda:1").device == "cuda:1"  # fbank on a GPU is allowed
    with pytest.raises(ConfigError, match="frontend.device=cuda is for type=fbank, model or espnet2"):
        FrontendConfig(type="none", device="cuda")
    with pytest.raises(ConfigError, match="frontend.precision=bf16 is for type=model or espnet2"):
        FrontendConfig(precision="bf16")
    with pytest.raises(ConfigError, match="precision"):
        FrontendConfig(type="model", model={"_target_": "espnet3_flows.frontends.ssl.SSLFeatures"}, precision="int8")


def test_precision_recomputes_only_when_set():
    model = {"_target_": "espnet3_flows.frontends.ssl.SSLFeatures"}
    f32 = FrontendConfig(type="model", model=model).hashed()
    assert "precision" not in f32  # float32 shards keep the hashes they had before the option
    assert FrontendConfig(type="model", model=model, precision="bf16").hashed() == {
        **f32, "precision": "bf16", "reduced_precision": 2}
    # device is never hashed: fbank on a GPU continues a CPU run's shards
    assert FrontendConfig(device="cuda").hashed() == FrontendConfig().hashed()


def test_fbank_frontend_on_the_cpu_is_per_utterance():
    frontend = build_frontend(FrontendConfig())
    assert isinstance(frontend, FbankFrontend)
    waves = noise([SR, 3 * SR])
    for got, wave in zip(frontend(waves, {}), waves, strict=True):
        np.testing.assert_array_equal(got, frontend.fbank(wave))


@pytest.mark.parametrize("bucket_shapes", [False, True], ids=["as-is", "bucket-shapes"])
def test_ssl_features_in_padded_batches_equal_each_utterance_alone(hubert, bucket_shapes):
    waves = noise([SR, 23_456, 2 * SR + 7, 40_000], seed=1)
    alone = model_frontend(hubert)(waves, {})
    batched = model_frontend(hubert, max_batch_samples=10 ** 7, bucket_shapes=bucket_shapes)(waves, {})
    assert [a.shape for a in alone] == [b.shape for b in batched] == [(49, 768), (73, 768), (99, 768), (124, 768)]
    for a, b in zip(alone, batched, strict=True):
        # measured 1.3e-6 of the feature scale: padding no longer reaches the features
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_ssl_features_alone_equal_torchaudio(hubert):
    wave = noise([SR + 123], seed=2)[0]
    with torch.inference_mode():
        ref = hubert.model.extract_features(torch.from_numpy(wave)[None])[0][-1][0].numpy()
    ours = model_frontend(hubert)([wave], {})[0]
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_positional_convolution_as_products_equals_torchaudio(hubert):
    """On a GPU the positional convolution runs as matrix products (cuDNN is slow there)."""
    from espnet3_flows.frontends.ssl import positional_conv

    positional = hubert.model.encoder.transformer.pos_conv_embed
    x = torch.randn(3, 57, 768)
    with torch.inference_mode():
        ref = type(positional).forward(positional, x)  # torchaudio's own
        for chunk in (8192, 60, 1):  # all rows at once, two rows, one row per product
            ours = positional_conv(x, positional.conv, positional.num_remove, chunk_frames=chunk)
            assert ours.shape == ref.shape
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_plain_torchaudio_batches_are_not_padding_exact(hubert):
    """Why SSLFeatures normalises per utterance: torchaudio's GroupNorm sees the padding."""
    waves = noise([SR, 3 * SR], seed=3)
    speech = torch.zeros(2, 3 * SR)
    speech[0, :SR], speech[1] = torch.from_numpy(waves[0]), torch.from_numpy(waves[1])
    with torch.inference_mode():
        layers, lengths = hubert.model.extract_features(speech, torch.tensor([SR, 3 * SR]))
    alone = model_frontend(hubert)(waves[:1], {})[0]
    assert np.abs(layers[-1][0, : int(lengths[0])].numpy() - alone).max() > 1e-2 * np.abs(alone).max()


def test_ssl_layer_and_checkpoint(tmp_path, hubert):
    path = tmp_path / "hubert.pt"
    torch.save({"model": hubert.model.state_dict()}, path)
    loaded = SSLFeatures("hubert_base", checkpoint=str(path), layer=3)
    wave = noise([SR], seed=4)
    third = model_frontend(loaded)(wave, {})[0]
    with torch.inference_mode():
        ref = hubert.model.extract_features(torch.from_numpy(wave[0])[None], num_layers=3)[0][-1][0].numpy()
    np.testing.assert_allclose(third, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(ValueError, match="layer must be in 1..12"):
        SSLFeatures("hubert_base", layer=13)
    with pytest.raises(ValueError, match="arch must be one of"):
        SSLFeatures("hubert_tiny")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reduced_precision_channel_norm_equals_the_float32_norm_of_its_values(dtype):
    """HuBERT's first norm in bf16/fp16 stays in that dtype: it equals the float32 path on the same
    values within the dtype's rounding, never reads an utterance's padding, and leaves a row with
    no frames as it was."""
    from espnet3_flows.frontends.ssl import per_utterance_channel_norm

    torch.manual_seed(11)
    norm = torch.nn.GroupNorm(6, 6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.uniform_(-1.0, 1.0)
    offsets = torch.tensor([0.0, 0.5, -1.0, 2.0, 3.0, -0.2])  # channel means up to 3x their deviation
    x = torch.randn(3, 40, 6) + offsets
    x[:, :, 4] = 300.0  # a constant channel far from zero: the float32 path gives its bias exactly
    x = x.to(dtype)
    lengths = torch.tensor([40, 17, 0])
    with torch.inference_mode():
        ref = per_utterance_channel_norm(x.float(), lengths, norm)
        got = per_utterance_channel_norm(x, lengths, norm)
        garbage = x.clone()
        garbage[1, 17:] = 1000.0  # padding of any value: the statistics never read it
        got_garbage = per_utterance_channel_norm(garbage, lengths, norm)
    assert got.dtype == dtype and got.shape == x.shape and bool(torch.isfinite(got).all())
    ulp = torch.finfo(dtype).eps
    for b, n in enumerate(lengths.tolist()[:2]):
        err = (got[b, :n].float() - ref[b, :n]).abs().max().item()
        assert 0 < err <= 4 * ulp * ref[b, :n].abs().max().item(), (b, err)
        assert torch.equal(got_garbage[b, :n], got[b, :n])
    assert torch.equal(got[2], x[2])


def test_reduced_precision_error_is_bounded(hubert):
    waves = noise([SR, 2 * SR], seed=5)
    ref = model_frontend(hubert)(waves, {})
    bf16 = model_frontend(hubert, max_batch_samples=10 ** 7, precision="bf16")(waves, {})
    for a, b in zip(ref, bf16, strict=True):
        assert a.shape == b.shape and b.dtype == np.float32
        # bf16 keeps 8 mantissa bits: measured 2.3e-2 of the feature scale on random weights
        err = np.abs(a - b).max() / np.abs(a).max()
        assert 0 < err < 0.1, err
    alone = [model_frontend(hubert, precision="bf16")([w], {})[0] for w in waves]
    for a, b, r in zip(alone, bf16, ref, strict=True):
        # batched = alone within 12 layers of bf16 rounding: measured 8.6e-3 RMS of the features' RMS
        # (a first norm reading the padding gave 1.1e-2 here, too close to tell: the norm's own test
        # above is the one that catches it)
        assert np.sqrt(np.mean((a - b) ** 2)) <= 2e-2 * np.sqrt(np.mean(r ** 2))


# ---- on a CUDA GPU (--run-gpu) ---------------------------------------------------------------
@pytest.mark.gpu
def test_fbank_on_the_gpu_equals_the_cpu():
    cpu = build_frontend(FrontendConfig())
    gpu = build_frontend(FrontendConfig(device="cuda"))
    waves = noise([400, 401, SR, 12345, 5 * SR, 16 * SR], seed=6)
    got, ref = gpu(waves, {}), cpu(waves, {})
    assert [g.shape for g in got] == [r.shape for r in ref]
    got, ref = np.concatenate(got).astype(np.float64), np.concatenate(ref).astype(np.float64)
    # cuFFT and cuBLAS round differently from the CPU: on an H100 the log-mel values differed by
    # 8.5e-5 at most here (1.6e-3 over 5 h of audio, in bins of little energy, where log magnifies
    # it); the collect-stats sums by 3e-8
    assert np.abs(got - ref).max() < 5e-3 and np.abs(got - ref).mean() < 1e-5
    for power in (1, 2):
        sums = (got ** power).sum(0), (ref ** power).sum(0)
        assert np.abs(sums[0] - sums[1]).max() <= 1e-5 * np.abs(sums[1]).max()


@pytest.mark.gpu
def test_ssl_on_the_gpu_batched_equals_the_cpu_alone(hubert):
    waves = noise([SR, 23_456, 3 * SR], seed=7)
    cpu = model_frontend(hubert)(waves, {})
    gpu = model_frontend(hubert, "cuda", max_batch_samples=10 ** 7)(waves, {})
    hubert.to("cpu")
    for a, b in zip(cpu, gpu, strict=True):
        assert a.shape == b.shape
        # TF32 is off by default for matmuls in torch; cuDNN convolutions may use it
        assert np.abs(a - b).max() <= 1e-3 * np.abs(a).max()


@pytest.mark.gpu
def test_collect_stats_moments_on_the_gpu_equal_the_host_float64_accumulator():
    """What collect-stats keeps on the GPU: the moments of the features it computed there equal the
    host's float64 accumulator over the same features copied back (rel. <= 1e-6), for fbank's
    gathered frames and a model's padded batches; against the CPU's features, within fbank's
    GPU-vs-CPU feature tolerance above."""
    from espnet3_flows.stats.accumulator import StatsAccumulator

    def host(features):
        acc = StatsAccumulator()
        for f in features:
            acc.update(f)
        return acc

    def rel(moments, acc):
        count, mean, m2 = moments.to_host()
        assert count == acc.count
        return max(np.abs(mean - acc.mean).max() / np.abs(acc.mean).max(), np.abs(m2 - acc.m2).max() / np.abs(acc.m2).max())

    waves = noise([400, 401, SR, 12345, 5 * SR, 16 * SR], seed=8)
    gpu = build_frontend(FrontendConfig(device="cuda"))
    assert gpu.computes_moments
    got = gpu.moments(waves, {})
    assert rel(got.moments, host(gpu(waves, {}))) <= 1e-6
    assert rel(got.moments, host(build_frontend(FrontendConfig())(waves, {}))) <= 1e-5
    from espnet3_flows.frontends.wave_frontends import TorchFrontend

    torch.manual_seed(0)
    module = torch.nn.Conv1d(1, 8, 400, stride=160)
    model = TorchFrontend(lambda s, n, kw: (module(s[:, None]).transpose(1, 2), (n - 400) // 160 + 1), module,
                          "cuda", 10 ** 7)
    assert rel(model.moments(waves, {}).moments, host(model(waves, {}))) <= 1e-6


@pytest.mark.gpu
def test_ecapa_on_the_gpu_batched_equals_alone(tmp_path):
    from espnet3_flows.xvector import embed_waveforms, load_speechbrain_encoder, speechbrain_embedder
    from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

    encoder = load_speechbrain_encoder(build_random_ecapa_dir(tmp_path / "ecapa"), tmp_path / "save", device="cuda")
    embed = speechbrain_embedder(encoder, exact_padding=True)
    waves = noise([SR, 23_456, 3 * SR, 2 * SR + 1], seed=8)
    alone = embed_waveforms(embed, waves, 1)
    batched = embed_waveforms(embed, waves, 4)
    cos = (alone * batched).sum(1) / np.linalg.norm(alone, axis=1) / np.linalg.norm(batched, axis=1)
    assert cos.min() >= 0.99999, cos


@pytest.mark.gpu
def test_many_overlapped_batches_on_the_gpu_equal_the_cpu():
    """Batches assembled in two pinned buffers in turn, copied on a side stream while the previous
    batch computes, their features copied back on another while the next one computes
    (``frontends.pinned``): over many batches of changing sizes (the buffers grow), each
    utterance's features and NaN flag equal the CPU's, so no buffer was reused before its copy ended."""
    import copy

    from espnet3_flows.frontends.wave_frontends import TorchFrontend

    rng = np.random.default_rng(10)
    waves = noise([int(n) for n in rng.integers(400, 3 * SR, size=40)], seed=10)
    fbank = FastFbank(Fbank(FbankConfig(dither=0.0)))
    waves[5][100] = np.nan  # found on the device, beside the features, as on the CPU
    got, ref = fbank.batch(waves, "cuda", max_batch_samples=2 * SR), fbank.batch(waves, "cpu", gather=True)
    assert got.nonfinite == ref.nonfinite == [i == 5 for i in range(len(waves))]
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape and (i == 5 or np.abs(g - r).max() < 5e-3)
    torch.manual_seed(0)
    module = torch.nn.Conv1d(1, 8, 400, stride=160)

    def extract(s, n, kw):
        return module_on[s.device.type](s[:, None]).transpose(1, 2), (n - 400) // 160 + 1

    module_on = {"cpu": copy.deepcopy(module), "cuda": module}
    gpu = TorchFrontend(extract, module_on["cuda"], "cuda", 3 * SR)
    cpu = TorchFrontend(extract, module_on["cpu"], "cpu", 3 * SR)
    assert len(gpu.batches([len(w) for w in waves])) > 10
    got, ref = gpu(waves, {}), cpu(waves, {})
    assert got.nonfinite == ref.nonfinite == [i == 5 for i in range(len(waves))]
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.shape == r.shape and (i == 5 or np.abs(g - r).max() <= 1e-4 * np.abs(np.nan_to_num(r)).max())
