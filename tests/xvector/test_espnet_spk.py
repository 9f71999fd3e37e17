"""ESPnet-SPK (``toolkit: espnet``) and recipe RawNet3 (``toolkit: rawnet``) embeddings against
ESPnet's own code, one utterance at a time and in padded batches, on random-weight models."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from espnet3_flows.xvector.espnet_spk import (
    espnet_embedder,
    import_speaker_task,
    load_espnet_spk_model,
    resolve_espnet_model,
)
from espnet3_flows.xvector.model import XVectorModelError, embed_waveforms
from espnet3_flows.xvector.random_spk import build_random_espnet_spk, build_random_rawnet3
from espnet3_flows.xvector.rawnet3 import load_recipe_rawnet3, rawnet_embedder

SR = 16000
ARCHITECTURES = ("rawnet3", "ecapa_tdnn")


def mixed_waves(n: int = 11, seed: int = 0, min_s: float = 0.2, max_s: float = 0.9) -> list[np.ndarray]:
    """Noisy tones of random lengths (no two equal), so a batch is padded."""
    rng = np.random.default_rng(seed)
    waves = []
    for _ in range(n):
        t = np.arange(int(rng.uniform(min_s, max_s) * SR)) / SR
        tones = sum(a * np.sin(2 * np.pi * f * t) for a, f in rng.uniform([0.05, 90], [0.3, 3000], (3, 2)))
        waves.append((tones + 0.02 * rng.standard_normal(t.size)).astype(np.float32))
    return waves


def worst(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max abs difference, worst cosine) over the rows."""
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    return float(np.abs(ours - ref).max()), float(cos.min())


@pytest.fixture(scope="module", params=ARCHITECTURES)
def spk_model(request, tmp_path_factory) -> tuple[str, Path]:
    torch.set_num_threads(1)
    return request.param, build_random_espnet_spk(tmp_path_factory.mktemp(request.param), request.param)


def speech2embedding(pth: Path, waves: list[np.ndarray]) -> np.ndarray:
    """ESPnet's own extractor, one utterance per call (``extract_spk_embed.py --toolkit espnet``)."""
    import_speaker_task()  # first: ESPnet's own import would try to download NLTK data
    from espnet2.bin.spk_inference import Speech2Embedding

    s2e = Speech2Embedding(train_config=None, model_file=str(pth))
    return np.stack([s2e(torch.from_numpy(w)).numpy().reshape(-1) for w in waves])


@pytest.mark.parametrize("batch_size", [1, 8])
def test_espnet_embeddings_equal_speech2embedding_alone(spk_model, batch_size):
    arch, pth = spk_model
    waves = mixed_waves()
    ref = speech2embedding(pth, waves)
    ours = embed_waveforms(espnet_embedder(load_espnet_spk_model(str(pth))), waves, batch_size)
    max_abs, cosine = worst(ours, ref)
    print(f"espnet {arch} batch {batch_size}: max abs diff {max_abs:.2e}, worst cosine {cosine:.8f}")
    assert ours.shape == ref.shape and max_abs <= 1e-5 and cosine >= 0.99999


def test_padded_batch_without_alignment_differs(spk_model):
    # Why the aligner exists: extract_spk_embed_parallel.py's padded batch changes embeddings.
    _, pth = spk_model
    waves = mixed_waves()
    model = load_espnet_spk_model(str(pth))
    padded = torch.zeros(len(waves), max(len(w) for w in waves))
    for i, w in enumerate(waves):
        padded[i, : len(w)] = torch.from_numpy(w)
    with torch.no_grad():
        plain = model(speech=padded, spk_labels=None, task_tokens=None, extract_embd=True).numpy()
    _, cosine = worst(plain, speech2embedding(pth, waves))
    assert cosine < 0.9999


def test_equal_length_groups_when_not_aligned(spk_model):
    _, pth = spk_model
    waves = mixed_waves(6) + [w[: len(w) // 2].copy() for w in mixed_waves(2, seed=1)] * 2  # two pairs of twins
    ours = embed_waveforms(espnet_embedder(load_espnet_spk_model(str(pth)), exact_padding=False), waves, 4)
    assert worst(ours, speech2embedding(pth, waves))[0] <= 1e-5


def test_espnet_model_forms_and_errors(tmp_path):
    pth = build_random_espnet_spk(tmp_path / "exp", "rawnet3")
    by_file, by_dir = resolve_espnet_model(str(pth)), resolve_espnet_model(str(tmp_path / "exp"))
    assert by_file == by_dir and by_file.config == (tmp_path / "exp" / "config.yaml").resolve()
    torch.save({}, tmp_path / "exp" / "other.pth")
    with pytest.raises(XVectorModelError, match="one .pth"):
        resolve_espnet_model(str(tmp_path / "exp"))
    (tmp_path / "lone").mkdir()
    torch.save({}, tmp_path / "lone" / "model.pth")
    with pytest.raises(XVectorModelError, match="config.yaml .* does not exist"):
        resolve_espnet_model(str(tmp_path / "lone" / "model.pth"))
    (tmp_path / "lone" / "config.yaml").write_text((tmp_path / "exp" / "config.yaml").read_text())
    with pytest.raises(XVectorModelError, match="lacks .* weights"):
        load_espnet_spk_model(str(tmp_path / "lone" / "model.pth"))
    with pytest.raises(XVectorModelError, match="does not exist"):
        resolve_espnet_model(str(tmp_path / "missing.pth"))


def _hub_cache(root: Path, tag: str, pth: Path) -> Path:
    """``tag`` laid out in a Hugging Face cache as the hub's ESPnet model packages are (meta.yaml
    naming exp/.../config.yaml and the .pth), as huggingface_hub would have downloaded it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{tag.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    exp = snapshot / "exp" / "spk_train_rawnet3_raw_sp"
    exp.mkdir(parents=True)
    (exp / "config.yaml").write_bytes((pth.parent / "config.yaml").read_bytes())
    (exp / "valid.eer.best.pth").write_bytes(pth.read_bytes())
    (snapshot / "meta.yaml").write_text(
        "espnet: '202511'\nfiles:\n  model_file: exp/spk_train_rawnet3_raw_sp/valid.eer.best.pth\n"
        "yaml_files:\n  train_config: exp/spk_train_rawnet3_raw_sp/config.yaml\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_model_tag_from_the_local_hub_cache_without_network(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError(f"network attempt: {args}")

    pth = build_random_espnet_spk(tmp_path / "exp", "rawnet3")
    snapshot = _hub_cache(tmp_path / "hub", "espnet/voxcelebs12_rawnet3", pth)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    files = resolve_espnet_model("espnet/voxcelebs12_rawnet3")
    assert files.weights == (snapshot / "exp/spk_train_rawnet3_raw_sp/valid.eer.best.pth").resolve()
    waves = mixed_waves(3)
    ours = embed_waveforms(espnet_embedder(load_espnet_spk_model("espnet/voxcelebs12_rawnet3")), waves, 3)
    assert worst(ours, speech2embedding(pth, waves))[0] <= 1e-5
    with pytest.raises(XVectorModelError, match="never downloads"):
        resolve_espnet_model("espnet/not_in_the_cache")


# --- the recipe's RawNet3 -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def rawnet_weights(tmp_path_factory) -> Path:
    return build_random_rawnet3(tmp_path_factory.mktemp("rawnet") / "model.pt")


def recipe_rawnet(model: torch.nn.Module, audio: np.ndarray, n_samples: int = 48000, n_segments: int = 10):
    """``SpkEmbedExtractor._rawnet_extract_embd`` of ESPnet's extract_spk_embed.py, as it runs."""
    if len(audio) < n_samples:
        audio = np.pad(audio, (0, n_samples - len(audio) + 1), "wrap")
    starts = np.linspace(0, len(audio) - n_samples, num=n_segments)
    audios = torch.from_numpy(np.stack([audio[int(s): int(s) + n_samples] for s in starts]).astype(np.float32))
    with torch.no_grad():
        return model(audios).mean(0).numpy()


@pytest.mark.parametrize("batch_size", [1, 8])
def test_rawnet_embeddings_equal_the_recipes_windowing(rawnet_weights, batch_size):
    model = load_recipe_rawnet3(rawnet_weights)
    waves = mixed_waves(9, min_s=0.3, max_s=4.5)  # shorter and longer than the 3-s window
    ref = np.stack([recipe_rawnet(model, w) for w in waves])
    ours = embed_waveforms(rawnet_embedder(model), waves, batch_size)
    max_abs, cosine = worst(ours, ref)
    print(f"rawnet batch {batch_size}: max abs diff {max_abs:.2e}, worst cosine {cosine:.8f}")
    assert ours.shape == (9, 16) and max_abs <= 1e-5 and cosine >= 0.99999


def test_recipe_rawnet3_is_the_network_espnet_ported(rawnet_weights):
    # ESPnet's port of RawNet3 (its asteroid frontend at the recipe's stride 10 and its RawNet3
    # encoder) on the same weights gives the same frame-level features; the pooling and the head
    # are the recipe's, written out here as its paper's code has them.
    from espnet2.asr.frontend.asteroid_frontend import AsteroidFrontend
    from espnet2.spk.encoder.rawnet3_encoder import RawNet3Encoder

    ours = load_recipe_rawnet3(rawnet_weights)
    state = torch.load(rawnet_weights, weights_only=True)["model"]
    frontend = AsteroidFrontend(sinc_filters=8, sinc_kernel_size=251, sinc_stride=10).eval()
    frontend.load_state_dict({"flipped_filter": state["preprocess.0.flipped_filter"],
                              "norm.weight": state["preprocess.1.weight"], "norm.bias": state["preprocess.1.bias"],
                              **{f"conv.{k[6:]}": v for k, v in state.items() if k.startswith("conv1.")}})
    encoder = RawNet3Encoder(input_size=8, model_scale=4, ndim=32, output_size=48).eval()
    encoder.load_state_dict({k: v for k, v in state.items() if k.startswith(("layer1.", "layer2.", "layer3.",
                                                                             "layer4."))})
    x = torch.from_numpy(mixed_waves(1, min_s=3.0, max_s=3.0)[0][:48000])[None]
    with torch.no_grad():
        feats, _ = frontend(x, torch.tensor([x.shape[1]]))
        frames = encoder(feats)
        t = frames.shape[-1]
        context = torch.cat((frames, frames.mean(2, keepdim=True).repeat(1, 1, t),
                             torch.sqrt(torch.var(frames, dim=2, keepdim=True).clamp(1e-4, 1e4)).repeat(1, 1, t)), 1)
        w = ours.attention(context)
        mu = (frames * w).sum(2)
        sg = torch.sqrt(((frames ** 2) * w).sum(2).sub(mu ** 2).clamp(1e-4, 1e4))
        expected = ours.fc6(ours.bn5(torch.cat((mu, sg), 1)))
        np.testing.assert_allclose(ours(x).numpy(), expected.numpy(), rtol=0, atol=1e-5)


def test_rawnet_weights_errors(tmp_path):
    with pytest.raises(XVectorModelError, match="does not exist"):
        load_recipe_rawnet3(tmp_path / "model.pt")
    torch.save({"model": {"x": torch.zeros(1)}}, tmp_path / "bad.pt")
    with pytest.raises(XVectorModelError, match="no RawNet3 weights"):
        load_recipe_rawnet3(tmp_path / "bad.pt")
