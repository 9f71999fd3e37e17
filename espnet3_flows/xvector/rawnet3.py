"""RawNet3 as ESPnet's recipes run it (``extract_spk_embed.py --toolkit rawnet``), batched across utterances.

The recipe builds Jung et al.'s RawNet3 (``tools/RawNet/python/RawNet3``: Res2Net ``Bottle2neck``
blocks with AFMS, a learnable sinc filterbank of stride 10 on pre-emphasised, instance-normalised
audio, log and mean-normalised; summed skip connections, channel- and context-dependent
attentive statistics pooling, ``bn5`` and ``fc6`` to 256 dimensions, no output batch norm) and
loads ``{"model": state_dict}`` from its weights file. :class:`RecipeRawNet3` is that network
with the same parameter names, written here on ESPnet's ``Bottle2neck`` (the same block, ported
to ESPnet by RawNet3's author) and asteroid's ``ParamSincFB``; its sizes (channels, scale,
embedding dimension) are read from the weights, so the recipe's file gives the recipe's model.

The recipe embeds an utterance at 16 kHz by wrapping it to at least 3 s, cutting ten 3-s
windows at evenly spaced starts and averaging the network's outputs over them
(:func:`recipe_windows`). The windows all have the same length, so :func:`rawnet_embedder` runs
the windows of many utterances in one batch, with each utterance's embedding equal to the
recipe's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from espnet3_flows.xvector.model import XVectorModelError, validate_device

WINDOW_SAMPLES = 48000  # 3 s at 16 kHz: what RawNet3 was trained on
N_WINDOWS = 10
SINC_KERNEL = 251
SINC_STRIDE = 10


def recipe_windows(audio: np.ndarray, n_samples: int = WINDOW_SAMPLES, n_windows: int = N_WINDOWS) -> np.ndarray:
    """The recipe's ``n_windows`` windows of ``n_samples`` [n_windows, n_samples] of a 1-D ``audio``.

    Shorter audio is first wrapped around (``np.pad(..., "wrap")``) to ``n_samples + 1``
    samples; window starts are ``int`` of ``n_windows`` evenly spaced points from 0 to
    ``len - n_samples``.
    """
    if audio.ndim != 1:
        raise ValueError(f"RawNet3 takes mono audio, got shape {audio.shape}")
    if len(audio) < n_samples:
        audio = np.pad(audio, (0, n_samples - len(audio) + 1), "wrap")
    starts = np.linspace(0, len(audio) - n_samples, num=n_windows)
    return np.stack([audio[int(s): int(s) + n_samples] for s in starts]).astype(np.float32)


class _PreEmphasis(torch.nn.Module):
    """``y[t] = x[t] - 0.97 x[t-1]`` with the first sample reflected ([B, T] -> [B, 1, T])."""

    def __init__(self, coef: float = 0.97) -> None:
        super().__init__()
        self.register_buffer("flipped_filter", torch.tensor([[[-coef, 1.0]]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv1d(torch.nn.functional.pad(x[:, None], (1, 0), "reflect"), self.flipped_filter)


class RecipeRawNet3(torch.nn.Module):
    """The recipe's RawNet3 (see the module docstring); ``forward``: [B, samples] at 16 kHz -> [B, embed_dim].

    Args:
        channels: ``C`` of the blocks (the recipe: 1024; the sinc filterbank has ``C // 4`` filters).
        scale: Res2Net scale of the blocks (the recipe: 8).
        frame_dim: Channels of the last frame-level layer (the recipe: 1536).
        embed_dim: Embedding dimension (the recipe's ``nOut``: 256).
    """

    def __init__(self, channels: int = 1024, scale: int = 8, frame_dim: int = 1536, embed_dim: int = 256) -> None:
        super().__init__()
        from asteroid_filterbanks import Encoder, ParamSincFB
        from espnet2.spk.layers.rawnet_block import Bottle2neck

        c = channels
        self.preprocess = torch.nn.Sequential(_PreEmphasis(), torch.nn.InstanceNorm1d(1, eps=1e-4, affine=True))
        self.conv1 = Encoder(ParamSincFB(c // 4, SINC_KERNEL, stride=SINC_STRIDE))
        self.relu = torch.nn.ReLU()
        self.bn1 = torch.nn.BatchNorm1d(c // 4)  # in the recipe's weights, unused by its forward
        self.layer1 = Bottle2neck(c // 4, c, kernel_size=3, dilation=2, scale=scale, pool=5)
        self.layer2 = Bottle2neck(c, c, kernel_size=3, dilation=3, scale=scale, pool=3)
        self.layer3 = Bottle2neck(c, c, kernel_size=3, dilation=4, scale=scale)
        self.layer4 = torch.nn.Conv1d(3 * c, frame_dim, kernel_size=1)
        self.attention = torch.nn.Sequential(
            torch.nn.Conv1d(3 * frame_dim, 128, kernel_size=1), torch.nn.ReLU(), torch.nn.BatchNorm1d(128),
            torch.nn.Conv1d(128, frame_dim, kernel_size=1), torch.nn.Softmax(dim=2))
        self.bn5 = torch.nn.BatchNorm1d(2 * frame_dim)
        self.fc6 = torch.nn.Linear(2 * frame_dim, embed_dim)
        self.bn6 = torch.nn.BatchNorm1d(embed_dim)  # in the weights; the recipe runs out_bn=False
        self.mp3 = torch.nn.MaxPool1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x = self.preprocess(x)
            x = torch.log(torch.abs(self.conv1(x)) + 1e-6)
            x = x - x.mean(dim=-1, keepdim=True)
        x1 = self.layer1(x)
        x2 = self.layer2(x1)
        x3 = self.layer3(self.mp3(x1) + x2)
        x = self.relu(self.layer4(torch.cat((self.mp3(x1), x2, x3), dim=1)))
        t = x.shape[-1]
        context = torch.cat((x, x.mean(dim=2, keepdim=True).repeat(1, 1, t),
                             torch.sqrt(x.var(dim=2, keepdim=True).clamp(min=1e-4, max=1e4)).repeat(1, 1, t)), dim=1)
        w = self.attention(context)
        mu = (x * w).sum(dim=2)
        sg = torch.sqrt(((x ** 2) * w).sum(dim=2).sub(mu ** 2).clamp(min=1e-4, max=1e4))
        return self.fc6(self.bn5(torch.cat((mu, sg), dim=1)))


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The weights of a RawNet3 file: the recipe's ``{"model": state_dict}`` or a bare state dict."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a file that is not its own
        raise XVectorModelError(f"cannot read RawNet3 weights {str(path)!r}: {type(exc).__name__}: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or "fc6.weight" not in state or "layer2.conv1.weight" not in state:
        raise XVectorModelError(f"{str(path)!r} holds no RawNet3 weights (no fc6 / layer2 in its state dict)")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_recipe_rawnet3(path: str | Path, device: str = "cpu") -> RecipeRawNet3:
    """The recipe's RawNet3 with the weights in ``path`` (sizes read from them), in eval mode on ``device``."""
    device = validate_device(device)
    path = Path(path).expanduser()
    if not path.is_file():
        raise XVectorModelError(f"RawNet3 weights file {str(path)!r} does not exist (the recipe's "
                                "tools/RawNet/python/RawNet3/models/weights/model.pt)")
    state = _state_dict(path)
    channels = int(state["layer2.conv1.weight"].shape[1])
    scale = 1 + sum(1 for k in state if k.startswith("layer1.convs.") and k.endswith(".weight"))
    model = RecipeRawNet3(channels, scale, int(state["layer4.weight"].shape[0]), int(state["fc6.weight"].shape[0]))
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise XVectorModelError(f"{str(path)!r} does not fit the recipe's RawNet3: {exc}") from None
    return model.to(device).eval()


def rawnet_embedder(model: RecipeRawNet3) -> Any:
    """An `~espnet3_flows.xvector.model.EmbeddingModel`: each utterance of a padded batch embedded
    as the recipe embeds it (its :func:`recipe_windows`, the mean of the model's outputs), all
    windows of the batch in one model call."""
    device = next(model.parameters()).device

    def embed(wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        n = wavs.shape[1]
        samples = torch.round(wav_lens.double().cpu() * n).long().clamp(1, n).tolist()
        rows = wavs.detach().cpu().numpy()
        windows = np.concatenate([recipe_windows(row[:k]) for row, k in zip(rows, samples, strict=True)])
        with torch.inference_mode():
            out = model(torch.from_numpy(windows).to(device))
        return out.view(len(samples), N_WINDOWS, -1).mean(dim=1)

    embed.model = model  # type: ignore[attr-defined]
    embed.host_input = True  # type: ignore[attr-defined]  # (it cuts its windows on the host: no GPU staging)
    return embed
