"""A small random-weight model for ``frontend.type: model``: ESPnet's ``collect_feats`` on frames
of ``hop_length`` samples (an SSL model's 320 at 16 kHz), stated as its ``hop_length``."""

from __future__ import annotations

import torch


class StridedFrames(torch.nn.Module):
    """``(frames, dim)`` features: a linear map of each non-overlapping ``hop_length`` frame."""

    def __init__(self, hop_length: int = 320, dim: int = 4):
        super().__init__()
        self.hop_length = hop_length
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(hop_length, dim)

    def collect_feats(self, speech: torch.Tensor, speech_lengths: torch.Tensor, **kwargs: object) -> dict:
        frames = speech[:, : speech.shape[1] // self.hop_length * self.hop_length]
        feats = self.proj(frames.reshape(speech.shape[0], -1, self.hop_length))
        return {"feats": feats, "feats_lengths": speech_lengths // self.hop_length}
