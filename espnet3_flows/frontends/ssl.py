"""Self-supervised speech models (HuBERT, wav2vec 2.0, WavLM) as collect-stats frontends.

:class:`SSLFeatures` is a torch module with ESPnet's ``collect_feats(speech, speech_lengths)``, so
``frontend.type: model`` runs it (on a GPU with ``frontend.device: cuda``, in padded batches with
``frontend.max_batch_samples``, in reduced precision with ``frontend.precision``)::

    frontend:
      type: model
      model: {_target_: espnet3_flows.frontends.ssl.SSLFeatures, arch: hubert_base,
              checkpoint: /models/hubert_base.pt, layer: 9}
      device: cuda
      max_batch_samples: 4000000
      precision: bf16

The network is torchaudio's (``torchaudio.models.<arch>()``), built from its configuration; its
weights come from ``checkpoint`` (a torchaudio state dict, or a dict holding one under
``model``/``state_dict``), never from a download. With no checkpoint its weights are random: the
benchmarks and tests use that (features then carry no speech information).

Padded batches give each utterance the features it gets alone (float32 rounding aside): the
base models normalise their first convolution's output over time (a GroupNorm per channel, as in
fairseq), which torchaudio computes over the padded batch; :class:`SSLFeatures` computes it over
each utterance's own frames. Everything after it already is exact under padding: the
convolutions have no padding of their own, the transformer's input is zeroed past each
utterance's end before the positional convolution and its attention is masked. The ``gpu``
benchmark states the remaining batched and reduced-precision errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: torchaudio model builders this frontend knows (each ``torchaudio.models.<name>()``)
ARCHS = ("hubert_base", "hubert_large", "hubert_xlarge", "wav2vec2_base", "wav2vec2_large",
         "wavlm_base", "wavlm_large")


class SSLFeatures(torch.nn.Module):
    """One transformer layer's output of a torchaudio SSL model, per frame (20 ms at 16 kHz).

    Args:
        arch: A torchaudio builder in :data:`ARCHS`.
        checkpoint: Path of the weights (a torchaudio state dict); empty: random weights.
        layer: Which transformer layer's output (1-based; ``None``: the last).
    """

    def __init__(self, arch: str = "hubert_base", checkpoint: str | None = None, layer: int | None = None):
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
        try:
            import torchaudio.models as models
        except ImportError as exc:  # pragma: no cover - torchaudio is a dependency
            raise ImportError(f"SSLFeatures needs torchaudio's models ({exc})") from exc
        self.model = getattr(models, arch)()
        layers = len(self.model.encoder.transformer.layers)
        if layer is not None and not 1 <= layer <= layers:
            raise ValueError(f"layer must be in 1..{layers} for {arch}, got {layer}")
        self.layer = layer or layers
        if checkpoint:
            state = torch.load(Path(checkpoint), map_location="cpu", weights_only=True)
            for key in ("model", "state_dict"):
                if isinstance(state, dict) and isinstance(state.get(key), dict):
                    state = state[key]
            self.model.load_state_dict(state)
        self.model.eval()
        positional = self.model.encoder.transformer.pos_conv_embed
        cudnn_forward = positional.forward  # on a CPU the convolution is faster (oneDNN) than the products

        def forward(x: torch.Tensor) -> torch.Tensor:
            return positional_conv(x, positional.conv, positional.num_remove) if x.is_cuda else cudnn_forward(x)

        positional.forward = forward

    @property
    def output_size(self) -> int:
        """Feature dimension."""
        return int(self.model.encoder.transformer.layers[0].final_layer_norm.normalized_shape[0])

    @torch.no_grad()
    def collect_feats(self, speech: torch.Tensor, speech_lengths: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        """``{"feats": [B, frames, D], "feats_lengths": [B]}`` of padded ``speech [B, samples]``
        (no gradients: features for statistics)."""
        x, lengths = self.conv_features(speech, speech_lengths)
        feats = self.model.encoder.extract_features(x, lengths, self.layer)[-1]
        return {"feats": feats, "feats_lengths": lengths}

    def conv_features(self, speech: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """torchaudio's ``FeatureExtractor`` computed channels-last, each convolution as one matrix
        product over strided frames, each GroupNorm over the utterance's own frames:
        ``([B, frames, C], frames per utterance)``.

        The convolutions have stride >= 2 and no padding; as products of ``[frames, k x C_in]``
        windows with the ``[k x C_in, C_out]`` weights they run on a GPU's tensor cores under
        autocast, where cuDNN picks slow non-tensor-core kernels for these shapes (52 % of
        HuBERT-base's time in bf16 on an H100: the ``gpu`` benchmark's profile).
        """
        x = speech.unsqueeze(-1)  # [B, T, C=1]
        for block in self.model.feature_extractor.conv_layers:
            x = strided_conv(x, block.conv)
            lengths = torch.clamp(torch.div(lengths - block.kernel_size, block.stride, rounding_mode="floor") + 1,
                                  min=0)
            norm = block.layer_norm
            if isinstance(norm, torch.nn.GroupNorm) and norm.num_groups == norm.num_channels:
                x = per_utterance_channel_norm(x, lengths, norm)
            elif norm is not None:
                x = norm(x)  # a LayerNorm over channels (the large models)
            x = torch.nn.functional.gelu(x)
        return x, lengths


def strided_conv(x: torch.Tensor, conv: torch.nn.Conv1d) -> torch.Tensor:
    """``conv`` (no padding, no dilation, one group) of channels-last ``x [B, T, C_in]`` as a matrix
    product: ``[B, T_out, C_out]``."""
    k, s = int(conv.kernel_size[0]), int(conv.stride[0])
    x = x.contiguous()
    batch, frames, channels = x.shape
    out_frames = max((frames - k) // s + 1, 0)
    windows = x.as_strided((batch, out_frames, k * channels), (frames * channels, s * channels, 1))
    weight = conv.weight.permute(2, 1, 0).reshape(k * channels, -1)  # [k x C_in, C_out], k-major as windows
    y = torch.matmul(windows, weight)
    return y if conv.bias is None else y + conv.bias


def positional_conv(x: torch.Tensor, conv: torch.nn.Conv1d, num_remove: int,
                    chunk_frames: int = 8192) -> torch.Tensor:
    """torchaudio's ``ConvolutionalPositionalEmbedding`` (a grouped "same" convolution of kernel 128
    over time, its last frame dropped for an even kernel, then GELU) of ``x [B, T, C]`` as
    batched matrix products over materialised windows, ``chunk_frames`` output frames at a time.

    cuDNN runs this grouped, wide convolution on slow non-tensor-core kernels on an H100 (~70 ms
    per 16M-sample batch in bf16, half of HuBERT-base's time); as products it is a few ms.
    """
    k, pad, groups = int(conv.kernel_size[0]), int(conv.padding[0]), int(conv.groups)
    batch, frames, channels = x.shape
    per_group = channels // groups
    weight = conv.weight  # [C_out, C_in / groups, k] (weight norm applied on access)
    out_per_group = weight.shape[0] // groups
    # [groups, k x C_in/groups, C_out/groups], k-major as the windows below
    w = weight.view(groups, out_per_group, per_group, k).permute(0, 3, 2, 1).reshape(groups, k * per_group,
                                                                                       out_per_group)
    padded = torch.nn.functional.pad(x, (0, 0, pad, pad)).contiguous()
    out_frames = frames + 2 * pad - k + 1 - num_remove
    out = torch.empty(batch, out_frames, weight.shape[0], dtype=torch.promote_types(x.dtype, w.dtype)
                      if not torch.is_autocast_enabled() else torch.get_autocast_dtype(x.device.type),
                      device=x.device)
    rows = max(1, chunk_frames // max(out_frames, 1))
    for b0 in range(0, batch, rows):
        part = padded[b0:b0 + rows]
        n = part.shape[0]
        windows = part.as_strided((n, out_frames, k, groups, per_group),
                                  (part.stride(0), channels, channels, per_group, 1))
        windows = windows.permute(3, 0, 1, 2, 4).reshape(groups, n * out_frames, k * per_group)
        y = torch.bmm(windows, w)  # [groups, n x frames, C_out/groups]
        out[b0:b0 + n] = y.view(groups, n, out_frames, out_per_group).permute(1, 2, 0, 3).reshape(
            n, out_frames, -1)
    if conv.bias is not None:
        out += conv.bias
    return torch.nn.functional.gelu(out)


def per_utterance_channel_norm(x: torch.Tensor, lengths: torch.Tensor, norm: torch.nn.GroupNorm) -> torch.Tensor:
    """``norm`` (a GroupNorm of one channel per group) of channels-last ``x [B, T, C]`` over the
    first ``lengths[b]`` frames of each utterance; frames past an utterance's end are left as they
    are in float32, and normalised with their utterance's statistics in reduced precision (later
    layers never read them into that utterance's valid frames).

    float32 ``x`` is normalised in float32, as torch computes a GroupNorm. Reduced-precision ``x``
    (bf16 or fp16: a product's output under autocast) stays in its dtype
    (:func:`_reduced_precision_channel_norm`)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return _reduced_precision_channel_norm(x, lengths, norm)
    out = x.float()
    for b, n in enumerate(lengths.tolist()):
        if n > 0:
            frames = out[b, :n]
            var, mean = torch.var_mean(frames, dim=0, unbiased=False)
            scale = torch.rsqrt(var + norm.eps)
            if norm.affine:
                scale = scale * norm.weight
            shift = (norm.bias if norm.affine else 0) - mean * scale
            torch.addcmul(shift, frames, scale, out=frames)
    return out


def _reduced_precision_channel_norm(x: torch.Tensor, lengths: torch.Tensor, norm: torch.nn.GroupNorm) -> torch.Tensor:
    """:func:`per_utterance_channel_norm` of bf16 or fp16 ``x``, written in ``x``'s dtype.

    Each utterance's per-channel sum and sum of squares are accumulated in float32 from ``x``'s
    own values (a GPU's reductions cast on the fly: no float32 copy of ``x``); the batch is then
    centred and scaled in ``x``'s dtype. Torch's GroupNorm under autocast, and the float32 path
    above, instead write a float32 copy of this, the model's largest activation (102 values per
    audio sample in HuBERT-base), then the GELU's float32 output, which the next convolution casts
    back: on an H200 in bf16, casts were 32 % of HuBERT-base's GPU time and this norm 14 %
    (``benchmarks/results/gpu.json``). What it costs: the normalised values are rounded to ``x``'s
    dtype before the GELU. Centring first keeps that rounding relative to the output, also for a
    channel far from zero or constant (scaling first would cancel two large rounded terms).
    """
    batch, _, channels = x.shape
    frames_of = lengths.tolist()  # (one wait per batch, as the float32 path's)
    sums = torch.zeros(batch, channels, dtype=torch.float32, device=x.device)
    squares = torch.zeros_like(sums)
    for b, n in enumerate(frames_of):
        if n > 0:
            frames = x[b, :n]
            sums[b] = frames.sum(0, dtype=torch.float32)
            squares[b] = torch.linalg.vector_norm(frames, 2, dim=0, dtype=torch.float32).square()
    lengths = lengths.to(x.device)
    valid = (lengths > 0)[:, None]  # an utterance shorter than the first window: its row left as it is
    counts = lengths.to(torch.float32).clamp_min(1)[:, None]
    mean = sums / counts
    var = (squares / counts - mean.square()).clamp_min(0)
    scale = torch.rsqrt(var + norm.eps)
    if norm.affine:
        scale = scale * norm.weight.float()
    shift = norm.bias.float().expand(batch, channels) if norm.affine else torch.zeros_like(sums)
    mean, scale, shift = torch.where(valid, mean, 0.0), torch.where(valid, scale, 1.0), torch.where(valid, shift, 0.0)
    centred = x - mean[:, None].to(x.dtype)
    return torch.addcmul(shift[:, None].to(x.dtype), centred, scale[:, None].to(x.dtype), out=centred)
