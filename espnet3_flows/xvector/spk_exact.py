"""Makes an ESPnet-SPK model give each utterance of a zero-padded batch the embedding it gets alone.

ESPnet's ``ESPnetSpeakerModel`` is exact only one utterance at a time (``Speech2Embedding``):
in a padded batch, every layer that looks along time sees the padding. `SpkPaddingAligner`
runs ESPnet's own inference steps, split where it matters:

- features (``model.extract_feats``: frontend and normalization) are computed for each
  utterance alone, exactly as ``Speech2Embedding`` computes them: they are cheap, and RawNet3's
  log sinc filterbank amplifies float rounding of near-silent bands (a batched STFT or sinc
  convolution would differ by 1e-5 in the embedding, for an 8 kHz recording resampled);
- the encoder, where the work is, runs on the zero-padded batch of features, with hooks on exactly
  the layers that look along time (dormant outside `SpkPaddingAligner.embed`): every "same"
  convolution sees zeros past each utterance's end, as its own padding gives alone; max pooling
  shortens each utterance as it does alone (``floor(len / k)``); the time averages of AFMS
  (RawNet3) and of the SE blocks (ECAPA-TDNN) cover each utterance's frames;
- the attentive pooling gets the lengths ``Speech2Embedding`` gives it for that utterance alone
  (the frontend's frame count, which RawNet3's pooling also divides by) and attends only to the
  frames the utterance has alone; the projector maps each utterance's vector.

Lengths travel by tensor size: each padded time axis (frames, frames after each pooling) is
registered with the per-utterance lengths it carries. Encoders: ``rawnet3`` and ``ecapa_tdnn``
(ESPnet's VoxCeleb speaker models), pooling ``chn_attn_stat``. A model with any other layer on the
way (`alignment_problem` names it) is batched by equal lengths instead, which is exact too.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

#: Modules that act on each frame, or on each utterance's vector, alone.
_POINTWISE = (torch.nn.BatchNorm1d, torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.Sigmoid, torch.nn.Tanh,
              torch.nn.Linear, torch.nn.Identity, torch.nn.Sequential, torch.nn.ModuleList, torch.nn.Dropout)


class _Ambiguous(Exception):
    """Two time axes of one batch have the same padded size but different lengths."""


class _Lengths(threading.local):
    """Per thread: padded time size -> valid length per utterance, while a batch is embedded."""

    by_size: dict[int, torch.Tensor] | None = None
    pooled: torch.Tensor | None = None  # frames the pooling's input has per utterance
    feat_lengths: torch.Tensor | None = None  # what the pooling gets alone, per utterance


def _classes() -> dict[str, type]:
    """ESPnet's classes the aligner knows, imported on first use."""
    from espnet2.spk.encoder.ecapa_tdnn_encoder import EcapaTdnnEncoder
    from espnet2.spk.encoder.rawnet3_encoder import RawNet3Encoder
    from espnet2.spk.layers.ecapa_block import EcapaBlock, SEModule
    from espnet2.spk.layers.rawnet_block import AFMS, Bottle2neck
    from espnet2.spk.pooling.chn_attn_stat_pooling import ChnAttnStatPooling
    from espnet2.spk.projector.abs_projector import AbsProjector

    return {"EcapaTdnnEncoder": EcapaTdnnEncoder, "RawNet3Encoder": RawNet3Encoder, "EcapaBlock": EcapaBlock,
            "SEModule": SEModule, "AFMS": AFMS, "Bottle2neck": Bottle2neck, "ChnAttnStatPooling": ChnAttnStatPooling,
            "AbsProjector": AbsProjector}


def alignment_problem(model: Any) -> str | None:
    """Why padded batches of the ESPnet-SPK ``model`` cannot be made exact, or None when they can."""
    c = _classes()
    if not all(hasattr(model, k) for k in ("extract_feats", "encode_frame", "project_spk_embd", "encoder",
                                             "pooling")):
        return f"{type(model).__name__} is not an ESPnetSpeakerModel"
    if not isinstance(model.encoder, (c["RawNet3Encoder"], c["EcapaTdnnEncoder"])):
        return f"encoder {type(model.encoder).__name__} (exact batches know rawnet3 and ecapa_tdnn)"
    if not isinstance(model.pooling, c["ChnAttnStatPooling"]):
        return f"pooling {type(model.pooling).__name__} (exact batches know chn_attn_stat)"
    known = (*_POINTWISE, torch.nn.Conv1d, torch.nn.MaxPool1d, torch.nn.AdaptiveAvgPool1d, torch.nn.Softmax,
             c["RawNet3Encoder"], c["EcapaTdnnEncoder"], c["Bottle2neck"], c["EcapaBlock"], c["SEModule"], c["AFMS"],
             c["ChnAttnStatPooling"], c["AbsProjector"])  # a projector maps each utterance's vector
    for part in ("encoder", "pooling", "projector"):
        for name, module in getattr(model, part).named_modules(prefix=part):
            if not isinstance(module, known):
                return f"layer {name!r} ({type(module).__name__})"
            if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
                k, d = module.kernel_size[0], module.dilation[0]
                if module.stride[0] != 1 or module.padding_mode != "zeros" or module.padding[0] != d * (k - 1) // 2:
                    return f"conv {name!r} is not a stride-1, zero-padded 'same' convolution"
            if isinstance(module, torch.nn.MaxPool1d):
                k = module.kernel_size
                if module.stride != k or module.padding != 0 or module.dilation != 1 or module.ceil_mode:
                    return f"max pooling {name!r} is not kernel == stride without padding"
            if isinstance(module, torch.nn.AdaptiveAvgPool1d) and module.output_size not in (1, (1,)):
                return f"adaptive pooling {name!r} to {module.output_size} frames"
    return None


def _valid(lengths: torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    """[B, size] bool: the frames each utterance has."""
    return torch.arange(size, device=device)[None, :] < lengths.to(device)[:, None]


def _masked_mean(x: torch.Tensor, lengths: torch.Tensor, time_dim: int) -> torch.Tensor:
    """Mean over each utterance's own frames along ``time_dim`` of a [B, C, T] or [B, T, C] tensor."""
    valid = _valid(lengths, x.shape[time_dim], x.device)
    valid = valid[:, None, :] if time_dim == 2 else valid[:, :, None]
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(time_dim, keepdim=True)
    return total / lengths.to(x.device, x.dtype).reshape(-1, 1, 1)


class SpkPaddingAligner:
    """Embeds zero-padded waveform batches with an ESPnet-SPK model, as one utterance at a time.

    Built once per model (its hooks stay on it, dormant outside :meth:`embed`); thread-safe.
    Raises ValueError when `alignment_problem` names a problem.
    """

    def __init__(self, model: Any) -> None:
        problem = alignment_problem(model)
        if problem is not None:
            raise ValueError(f"exact padding is not possible for this model: {problem}")
        c = _classes()
        self.model = model
        self._ctx = _Lengths()
        for module in model.encoder.modules():
            if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
                module.register_forward_pre_hook(self._zero_past_end_hook)
            elif isinstance(module, torch.nn.MaxPool1d):
                module.register_forward_hook(self._max_pool_hook)
            elif isinstance(module, c["AFMS"]):
                module.register_forward_hook(self._afms_hook)
            elif isinstance(module, torch.nn.AdaptiveAvgPool1d):
                module.register_forward_hook(self._average_hook)
        model.pooling.register_forward_pre_hook(self._pooling_hook, with_kwargs=True)
        model.pooling.attention.register_forward_hook(self._attention_hook)

    # -- the registry of padded time sizes --
    def _lookup(self, size: int) -> torch.Tensor | None:
        by_size = self._ctx.by_size
        return None if by_size is None else by_size.get(size)

    def _register(self, size: int, lengths: torch.Tensor) -> None:
        by_size = self._ctx.by_size
        if by_size is None:
            return
        known = by_size.get(size)
        if known is not None and not torch.equal(known, lengths):
            raise _Ambiguous(size)
        by_size[size] = lengths

    # -- hooks (each does nothing outside `embed`) --
    def _zero_past_end_hook(self, _module: Any, args: tuple) -> Any:
        x = args[0]  # [B, C, T]
        lengths = self._lookup(x.shape[-1])
        if lengths is None:
            return None
        valid = _valid(lengths, x.shape[-1], x.device)[:, None, :]
        return (torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)),) + tuple(args[1:])

    def _max_pool_hook(self, pool: torch.nn.MaxPool1d, args: tuple, out: torch.Tensor) -> None:
        lengths = self._lookup(args[0].shape[-1])
        if lengths is not None:
            k = pool.kernel_size if isinstance(pool.kernel_size, int) else pool.kernel_size[0]
            self._register(out.shape[-1], torch.div(lengths, k, rounding_mode="floor"))

    def _afms_hook(self, afms: Any, args: tuple, out: torch.Tensor) -> Any:
        x = args[0]
        lengths = self._lookup(x.shape[-1])
        if lengths is None:
            return None
        y = _masked_mean(x, lengths, 2).view(x.size(0), -1)
        y = afms.sig(afms.fc(y)).view(x.size(0), x.size(1), -1)
        return (x + afms.alpha) * y

    def _average_hook(self, _module: Any, args: tuple, out: torch.Tensor) -> Any:
        lengths = self._lookup(args[0].shape[-1])
        return None if lengths is None else _masked_mean(args[0], lengths, 2)

    def _pooling_hook(self, _module: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else kwargs["x"]
        frames = self._lookup(x.shape[-1])
        feat_lengths = self._ctx.feat_lengths
        if frames is None or feat_lengths is None:
            return None
        valid = _valid(frames, x.shape[-1], x.device)[:, None, :]
        x = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
        # alone, Speech2Embedding's pooling gets the frontend's frame count, also past a
        # downsampling encoder's end: its statistics divide by it
        kwargs = {k: v for k, v in kwargs.items() if k != "x"}
        kwargs["feat_lengths"] = feat_lengths
        self._ctx.pooled = frames
        return (x,), kwargs

    def _attention_hook(self, _module: Any, _args: tuple, w: torch.Tensor) -> Any:
        frames = getattr(self._ctx, "pooled", None)
        if frames is None or self._ctx.by_size is None:
            return None
        valid = _valid(frames, w.shape[-1], w.device)[:, None, :]
        return w.masked_fill(~valid, torch.finfo(w.dtype).min)

    def embed(self, waves: list[torch.Tensor]) -> torch.Tensor:
        """Embeddings [B, D] of 1-D ``waves`` (on the model's device), each equal (up to float
        rounding) to ``Speech2Embedding`` on that utterance alone.

        Raises `_Ambiguous` (private) when two time axes cannot be told apart by size.
        """
        model = self.model
        feats, feat_lengths = [], []
        for wave in waves:  # as Speech2Embedding: [1, T], no lengths
            f, n = model.extract_feats(wave[None], None)
            feats.append(f[0])
            feat_lengths.append(torch.as_tensor(f.shape[1] if n is None else n[0]))
        frames = torch.tensor([f.shape[0] for f in feats], device=feats[0].device)
        batch = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)  # [B, frames, D], zeros past each end
        self._ctx.by_size = {batch.shape[1]: frames}
        self._ctx.feat_lengths = torch.stack(feat_lengths).to(batch.device)
        self._ctx.pooled = None
        try:
            pooled = model.pooling(model.encode_frame(batch), feat_lengths=self._ctx.feat_lengths)
            return model.project_spk_embd(pooled)
        finally:
            self._ctx.by_size = None
            self._ctx.feat_lengths = None
            self._ctx.pooled = None
