"""Makes a speechbrain conv encoder give the same embedding for an utterance in a padded batch as alone.

Zero padding changes an ECAPA-TDNN embedding (cosine ~0.96 on random weights) for two reasons:
every "same" convolution pads each utterance by reflection when it runs alone, but sees the
padding's features when batched; and a relative length `len / max_len` can turn into one frame too
many in the masks of InputNormalization, SE blocks and attentive pooling (`arange < rel * T`
with rel * T = 254.05 for an utterance of 254 frames).
`PaddingAligner` fixes both: it gives encode_batch frame-exact relative lengths, and every
"same"-padded speechbrain Conv1d, while it encodes, pads its input and overwrites the frames just
past each utterance's end with what its own padding would have put there, in one gather.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SUPPORTED_PADDING_MODES = ("reflect", "replicate", "circular", "zeros", "constant")
# Layers that mix time steps in ways the aligned convolutions cannot follow; their presence disables exact padding.
_UNALIGNABLE_LAYERS = (
    torch.nn.RNNBase,
    torch.nn.MultiheadAttention,
    torch.nn.Conv2d,
    torch.nn.ConvTranspose1d,
    torch.nn.AvgPool1d,
    torch.nn.MaxPool1d,
)


class _FrameLengths(threading.local):
    """Per-thread valid frame counts of the batch being encoded; None outside a call."""

    frames: torch.Tensor | None = None


def _conv_halo(conv: Any) -> int:
    """Frames a "same" convolution pads on each side (stride 1)."""
    return int(conv.dilation) * (int(conv.kernel_size) - 1) // 2


def alignment_problem(encoder: Any) -> str | None:
    """Why padded batches of ``encoder`` cannot be made exact, or None when they can.

    Supported: a speechbrain ``Fbank``-like front end (centered STFT with zero padding, no deltas
    or context), sentence or global input normalization, and an embedding model whose only
    time-mixing layers are stride-1 speechbrain ``Conv1d`` (ECAPA-TDNN, x-vector TDNN with
    "same" padding) plus length-masked pooling.
    """
    from speechbrain.nnet.CNN import Conv1d as SbConv1d

    mods = getattr(encoder, "mods", None)
    if mods is None or not all(hasattr(mods, k) for k in ("compute_features", "embedding_model")):
        return "the encoder has no mods.compute_features / mods.embedding_model"
    features = mods.compute_features
    stft = getattr(features, "compute_STFT", None)
    if stft is None or not getattr(stft, "center", False) or getattr(stft, "pad_mode", "") != "constant":
        return "the feature extractor is not a centered, zero-padded STFT front end"
    if getattr(features, "deltas", False) or getattr(features, "context", False):
        return "the feature extractor uses deltas or a context window"
    norm = getattr(mods, "mean_var_norm", None)
    if norm is not None and getattr(norm, "norm_type", "sentence") not in ("sentence", "global"):
        return f"input normalization norm_type={norm.norm_type!r} depends on the batch"
    wrapped = set()
    for name, module in mods.embedding_model.named_modules():
        if isinstance(module, _UNALIGNABLE_LAYERS):
            return f"layer {name!r} ({type(module).__name__}) mixes time steps across padding"
        if isinstance(module, SbConv1d):
            wrapped.add(id(module.conv))
            if module.kernel_size == 1:
                continue
            if module.stride != 1 or module.padding != "same":
                return f"conv {name!r} has stride {module.stride}, padding {module.padding!r}"
            if module.padding_mode not in _SUPPORTED_PADDING_MODES:
                return f"conv {name!r} pads with unsupported mode {module.padding_mode!r}"
    for name, module in mods.embedding_model.named_modules():
        if isinstance(module, torch.nn.Conv1d) and id(module) not in wrapped and module.kernel_size[0] > 1:
            return f"conv {name!r} is a bare torch Conv1d with kernel {module.kernel_size[0]}"
    return None


def padded_past_ends(x: torch.Tensor, frames: torch.Tensor, halo: int, mode: str) -> torch.Tensor:
    """``x [B, C, T]`` padded by ``halo`` frames on each side, each utterance's frames (the first
    ``frames[b]``) bordered by what a "same" convolution pads that utterance with alone (``mode``,
    as ``F.pad``): one gather, the input of the convolution's own product (speechbrain's
    ``Conv1d`` pads by a copy of its own). Frames more than ``halo`` past an utterance's end
    hold any of its frames: its outputs there are cut off."""
    n_time = x.shape[2]
    t = torch.arange(-halo, n_time + halo, device=x.device).unsqueeze(0)  # [1, T + 2 halo]
    ends = frames.to(x.device).unsqueeze(1)  # [B, 1]
    if mode == "reflect":
        src = torch.where(t < 0, -t, torch.where(t < ends, t, 2 * (ends - 1) - t))
    elif mode == "replicate":
        src = torch.where(t < ends, t.clamp(min=0), ends - 1)
    elif mode == "circular":
        src = torch.remainder(t, ends)
    else:  # zeros, constant: masked below
        src = t.expand(ends.shape[0], -1)
    src = src.clamp(0, n_time - 1)
    out = torch.gather(x, 2, src.unsqueeze(1).expand(-1, x.shape[1], -1))
    if mode in ("zeros", "constant"):
        out = out * ((t >= 0) & (t < ends)).unsqueeze(1).to(out.dtype)
    return out


class PaddingAligner:
    """Encodes zero-padded waveform batches with a speechbrain encoder, frame-exactly.

    Built once per encoder (its convolutions' aligned forwards stay dormant outside ``encode``).
    ``encode`` is thread-safe: the frame lengths live in thread-local storage.
    """

    def __init__(self, encoder: Any) -> None:
        from speechbrain.nnet.CNN import Conv1d as SbConv1d

        problem = alignment_problem(encoder)
        if problem is not None:
            raise ValueError(f"exact padding is not possible for this encoder: {problem}")
        self._encoder = weakref.ref(encoder)  # the encoder owns the forwards; no cycle through the cache
        self.hop = int(encoder.mods.compute_features.compute_STFT.hop_length)
        self._lengths = _FrameLengths()
        self.halo = 0
        for module in encoder.mods.embedding_model.modules():
            if isinstance(module, SbConv1d) and module.kernel_size > 1:
                self.halo = max(self.halo, _conv_halo(module))
                module.forward = self._aligned_forward(module)

    def _aligned_forward(self, conv: Any):
        """``conv``'s forward while :meth:`encode` runs in this thread: its input padded and
        filled past each utterance's end in one gather (:func:`padded_past_ends`), then its
        product; otherwise speechbrain's own."""
        own, lengths = conv.forward, self._lengths
        halo, mode = _conv_halo(conv), conv.padding_mode

        def forward(x: torch.Tensor) -> torch.Tensor:
            frames = lengths.frames
            if frames is None or halo == 0 or x.dim() != 3 or x.shape[0] != frames.shape[0]:
                return own(x)
            channels_first = x if conv.skip_transpose else x.transpose(1, -1)  # [B, C, T]
            out = conv.conv(padded_past_ends(channels_first, frames, halo, mode))
            return out if conv.skip_transpose else out.transpose(1, -1)

        return forward

    def encode(self, wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        """``encoder.encode_batch`` on zero-padded ``wavs`` [B, T] with relative ``wav_lens`` [B].

        Returns [B, 1, D], equal (up to float rounding) to encoding each utterance alone.
        """
        encoder = self._encoder()
        if encoder is None:
            raise RuntimeError("the encoder of this PaddingAligner no longer exists")
        n_samples = wavs.shape[1]
        samples = torch.round(wav_lens.double().cpu() * n_samples).long().clamp(1, n_samples)
        if bool((samples == n_samples).all()):
            return encoder.encode_batch(wavs, torch.ones_like(wav_lens))  # no padding to align
        frames = samples // self.hop + 1  # frames of a centered STFT over each utterance alone
        # Extra zeros so that every utterance, the longest included, ends `halo` frames before the
        # tensor does: the aligned convolutions then fill each halo and the tensor's padding never matters.
        extra = self.halo * self.hop
        padded = torch.nn.functional.pad(wavs, (0, extra))
        n_frames = (n_samples + extra) // self.hop + 1
        # A quarter frame short of the end satisfies both conventions speechbrain layers use for
        # relative lengths, `arange < rel * T` (masks) and `round(rel * T)` (StatisticsPooling),
        # whatever the float rounding: both then keep exactly `frames` frames.
        rel = ((frames.double() - 0.25) / n_frames).to(torch.float32)
        self._lengths.frames = frames.to(encoder.device)
        try:
            return encoder.encode_batch(padded, rel)
        finally:
            self._lengths.frames = None


# One aligner (one set of aligned convolutions) per encoder, however many embedders wrap it.
_ALIGNERS: weakref.WeakKeyDictionary[Any, PaddingAligner] = weakref.WeakKeyDictionary()


def make_aligner(encoder: Any, exact_padding: bool | None) -> PaddingAligner | None:
    """A PaddingAligner for ``encoder``; None when not requested or (``exact_padding=None``) not possible."""
    if exact_padding is False:
        return None
    if encoder in _ALIGNERS:
        return _ALIGNERS[encoder]
    problem = alignment_problem(encoder)
    if problem is None:
        aligner = _ALIGNERS[encoder] = PaddingAligner(encoder)
        return aligner
    if exact_padding:
        raise ValueError(f"exact padding was requested but is not possible: {problem}")
    logger.warning("padded batches may change embeddings: %s", problem)
    return None

