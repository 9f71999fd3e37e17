"""Tests for x-vector model loading (offline), length-sorted batching and batched embedding."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from espnet3_flows.xvector import (
    XVectorModelError,
    embed_waveforms,
    length_sorted_batches,
    load_speechbrain_encoder,
    speechbrain_embedder,
    validate_device,
)
from espnet3_flows.xvector.random_ecapa import build_random_ecapa_dir

SR = 16000


def make_waves(n: int, seed: int = 0, min_s: float = 0.5, max_s: float = 3.0) -> list[np.ndarray]:
    """Sums of sinusoids plus noise, of random lengths between min_s and max_s seconds."""
    rng = np.random.default_rng(seed)
    waves = []
    for _ in range(n):
        t = np.arange(int(rng.uniform(min_s, max_s) * SR)) / SR
        tones = sum(a * np.sin(2 * np.pi * f * t + p) for a, f, p in rng.uniform([0.05, 80, 0], [0.3, 2000, 6], (4, 3)))
        waves.append((tones + 0.02 * rng.standard_normal(t.size)).astype(np.float32))
    return waves


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_ecapa_dir(tmp_path_factory.mktemp("ecapa") / "model")


@pytest.fixture(scope="module")
def encoder(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    torch.set_num_threads(1)
    return load_speechbrain_encoder(model_dir, savedir=tmp_path_factory.mktemp("savedir"))


def encode_alone(encoder, waves: list[np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        return np.stack([encoder.encode_batch(torch.from_numpy(w)[None])[0, 0].numpy() for w in waves])


# --- loading -------------------------------------------------------------------------------------


def test_local_dir_loads_offline_with_its_weights(encoder, model_dir: Path) -> None:
    out = encoder.encode_batch(torch.zeros(2, SR), torch.ones(2))
    assert tuple(out.shape) == (2, 1, 192)
    saved = torch.load(model_dir / "embedding_model.ckpt", weights_only=True)
    loaded = encoder.mods.embedding_model.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert len(encoder.hparams.label_encoder) == 4


def test_moved_dir_and_hub_style_pretrained_path_load(
    tmp_path: Path, encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory downloaded from the hub keeps `pretrained_path: <hub id>`: it must still load offline.
    def no_network(*args, **kwargs):
        raise AssertionError("network access while loading a local model")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    hub_style = build_random_ecapa_dir(tmp_path / "dl", pretrained_path="speechbrain/spkrec-ecapa-voxceleb")
    moved = tmp_path / "elsewhere"
    shutil.move(str(hub_style), moved)
    enc = load_speechbrain_encoder(str(moved), savedir=tmp_path / "save")
    wave = make_waves(1, seed=3)
    np.testing.assert_allclose(encode_alone(enc, wave), encode_alone(encoder, wave), rtol=0, atol=1e-6)


def test_reused_savedir_serves_the_new_model(tmp_path: Path) -> None:
    a = build_random_ecapa_dir(tmp_path / "a", seed=1)
    b = build_random_ecapa_dir(tmp_path / "b", seed=2)
    load_speechbrain_encoder(a, savedir=tmp_path / "save")
    enc_b = load_speechbrain_encoder(b, savedir=tmp_path / "save")
    saved = torch.load(b / "embedding_model.ckpt", weights_only=True)
    loaded = enc_b.mods.embedding_model.state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_uncached_hub_id_gives_clear_error_without_trying_the_hub(tmp_path: Path, monkeypatch) -> None:
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError(f"network attempt: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    hub_id = "espnet3-flows-tests/no-such-model"
    with pytest.raises(XVectorModelError) as info:
        load_speechbrain_encoder(hub_id, savedir=tmp_path / "save")
    message = str(info.value)
    assert hub_id in message and "local Hugging Face cache" in message and "never downloads" in message
    # the command huggingface_hub >= 1 installs (it no longer ships huggingface-cli)
    assert f"`hf download {hub_id} --local-dir DIR`" in message and "huggingface-cli" not in message


def test_local_path_problems_are_clear(tmp_path: Path) -> None:
    with pytest.raises(XVectorModelError, match="does not exist"):
        load_speechbrain_encoder(tmp_path / "missing", savedir=tmp_path / "save")
    (tmp_path / "empty").mkdir()
    with pytest.raises(XVectorModelError, match="hyperparams.yaml"):
        load_speechbrain_encoder(str(tmp_path / "empty"), savedir=tmp_path / "save")


@pytest.mark.parametrize("bad", [pytest.param("gpu", id="word-gpu"), "CPU", "cuda:", "cuda:01", "cuda:-1", "cuda:x", "", "mps"])
def test_malformed_device_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="device"):
        validate_device(bad)


def test_device_names() -> None:
    assert validate_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert validate_device("cuda:0") == "cuda:0"
        with pytest.raises(XVectorModelError, match="CUDA device"):
            validate_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(XVectorModelError, match="not available"):
            validate_device("cuda")


# --- batched embedding equals one-by-one ---------------------------------------------------------


def test_batched_embeddings_equal_one_by_one(encoder) -> None:
    waves = make_waves(10, seed=0)
    batched = embed_waveforms(speechbrain_embedder(encoder), waves, batch_size=4)
    alone = encode_alone(encoder, waves)
    assert batched.shape == (10, 192) and batched.dtype == np.float32
    assert cosine_rows(batched, alone).min() >= 0.99999
    np.testing.assert_allclose(batched, alone, rtol=0, atol=1e-4)


def test_plain_encode_batch_is_not_padding_invariant(encoder) -> None:
    # Why exact padding exists: speechbrain's own batching changes ECAPA embeddings.
    waves = make_waves(10, seed=0)
    plain = embed_waveforms(speechbrain_embedder(encoder, exact_padding=False), waves, batch_size=4)
    assert cosine_rows(plain, encode_alone(encoder, waves)).min() < 0.9999


def test_batched_embeddings_are_thread_safe(encoder) -> None:
    embed = speechbrain_embedder(encoder)
    waves = [make_waves(6, seed=s) for s in (10, 11)]
    results: dict[int, np.ndarray] = {}

    def work(k: int) -> None:
        results[k] = embed_waveforms(embed, waves[k], batch_size=3)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):
        assert cosine_rows(results[k], encode_alone(encoder, waves[k])).min() >= 0.9999


def test_exact_padding_refused_for_unsupported_encoder() -> None:
    class NotSpeechbrain:
        def encode_batch(self, wavs, wav_lens):
            return wavs[:, None, :3]

    with pytest.raises(ValueError, match="exact padding"):
        speechbrain_embedder(NotSpeechbrain(), exact_padding=True)
    embed = speechbrain_embedder(NotSpeechbrain())  # falls back to encode_batch as is
    assert tuple(embed(torch.ones(2, 5), torch.ones(2)).shape) == (2, 3)


# --- embed_waveforms with any callable -----------------------------------------------------------


def valid_sum_and_length(wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
    """Toy EmbeddingModel: [sum of the unpadded samples, unpadded length], from wav_lens."""
    n = torch.round(wav_lens * wavs.shape[1]).long()
    mask = torch.arange(wavs.shape[1])[None, :] < n[:, None]
    assert torch.all(wavs[~mask] == 0)
    return torch.stack([(wavs * mask).sum(1), n.float()], dim=1)


def test_embed_waveforms_keeps_input_order_and_limits() -> None:
    waves = [np.full(n, 0.5, dtype=np.float32) for n in (30, 5, 17, 17, 1, 44, 9)]
    shapes: list[tuple[int, int]] = []

    def recording(wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(wavs.shape))
        return valid_sum_and_length(wavs, wav_lens)

    out = embed_waveforms(recording, waves, batch_size=3, max_padded_samples=60)
    np.testing.assert_allclose(out[:, 1], [w.size for w in waves])
    np.testing.assert_allclose(out[:, 0], [0.5 * w.size for w in waves], rtol=1e-6)
    assert all(b <= 3 and (b * t <= 60 or b == 1) for b, t in shapes)
    assert sum(b for b, _ in shapes) == len(waves)


def test_embed_waveforms_names_bad_items() -> None:
    good = np.zeros(10, dtype=np.float32)
    cases = [
        (np.zeros(0, dtype=np.float32), "empty"),
        (np.zeros((2, 10), dtype=np.float32), "1-D"),
        (np.array([0.1, np.nan], dtype=np.float32), "NaN"),
        (np.zeros(10, dtype=np.int16), "float"),
    ]
    for bad, reason in cases:
        with pytest.raises(ValueError, match=rf"'utt-b'.*{reason}"):
            embed_waveforms(valid_sum_and_length, [good, bad], batch_size=2, ids=["utt-a", "utt-b"])
    with pytest.raises(XVectorModelError, match=r"expected \[B, D\]"):
        embed_waveforms(lambda w, n: w[:, None, :2], [good], batch_size=1)
    assert embed_waveforms(valid_sum_and_length, [], batch_size=2).shape == (0, 0)


# --- length_sorted_batches ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_length_sorted_batches_properties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(0, 1000, rng.integers(0, 60))]
    max_batch = int(rng.integers(1, 9))
    limit = None if seed % 3 == 0 else int(rng.integers(1, 4000))
    batches = length_sorted_batches(lengths, max_batch, limit)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    previous_shortest = None
    for b in batches:
        lens = [lengths[i] for i in b]
        assert 1 <= len(b) <= max_batch
        assert lens == sorted(lens, reverse=True)
        if limit is not None and len(b) > 1:
            assert len(b) * lens[0] <= limit
        if previous_shortest is not None:
            assert lens[0] <= previous_shortest
        previous_shortest = lens[-1]


def test_length_sorted_batches_argument_errors() -> None:
    assert length_sorted_batches([3, 1, 2], 2) == [[0, 2], [1]]
    assert length_sorted_batches([5, 5, 5], 3, max_padded_samples=10) == [[0, 1], [2]]
    for args in [([1], 0), ([1], 2, 0), ([-1], 2), ([1.5], 2), ([1], True)]:
        with pytest.raises(ValueError):
            length_sorted_batches(*args)


def test_exact_padding_for_tdnn_xvector_with_statistics_pooling() -> None:
    # speechbrain's Xvector pools with round(rel * T) instead of a mask; it must come out exact too.
    from speechbrain.inference.speaker import EncoderClassifier
    from speechbrain.lobes.features import Fbank
    from speechbrain.lobes.models.Xvector import Xvector
    from speechbrain.processing.features import InputNormalization

    torch.manual_seed(0)
    modules = {
        "compute_features": Fbank(n_mels=24),
        "mean_var_norm": InputNormalization(norm_type="sentence", std_norm=False),
        "embedding_model": Xvector(in_channels=24, tdnn_channels=[32, 32, 32, 32, 96], lin_neurons=16),
        "classifier": torch.nn.Identity(),
    }
    encoder = EncoderClassifier(modules=modules, hparams={}, run_opts={"device": "cpu"})
    waves = make_waves(7, seed=5)
    batched = embed_waveforms(speechbrain_embedder(encoder, exact_padding=True), waves, batch_size=4)
    assert cosine_rows(batched, encode_alone(encoder, waves)).min() >= 0.9999


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "zeros"])
def test_one_gather_pads_each_utterance_as_its_convolution_alone(mode: str) -> None:
    """What the aligned convolutions compute on (``exact_padding.padded_past_ends``): each
    utterance's frames and ``halo`` frames either side equal ``F.pad`` of the utterance alone."""
    from espnet3_flows.xvector.exact_padding import padded_past_ends

    torch.manual_seed(0)
    halo, frames = 4, torch.tensor([30, 9, 17, 5])
    x = torch.randn(4, 3, 30 + halo)
    out = padded_past_ends(x, frames, halo, mode)
    assert out.shape == (4, 3, 30 + 3 * halo)
    for b, n in enumerate(frames.tolist()):
        alone = torch.nn.functional.pad(x[b:b + 1, :, :n], (halo, halo), mode="constant" if mode == "zeros" else mode)
        assert torch.equal(out[b:b + 1, :, : n + 2 * halo], alone), b


def test_a_model_that_takes_host_batches_is_not_staged_on_its_gpu() -> None:
    """RawNet3 cuts its windows on the host (``host_input``): its batches stay there whatever its
    device (here a CUDA device this machine lacks: staging would need one, and fail without it)."""
    def embed(wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        assert wavs.device.type == "cpu"
        return wavs[:, :2] * 1.0

    embed.device = "cuda"  # type: ignore[attr-defined]
    embed.host_input = True  # type: ignore[attr-defined]
    out = embed_waveforms(embed, make_waves(3, seed=1), batch_size=2)
    assert out.shape == (3, 2)
