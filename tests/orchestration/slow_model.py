"""A tiny ``collect_feats`` model that sleeps, so a test can kill a run mid-way."""

from __future__ import annotations

import time

import torch


class SlowFramer(torch.nn.Module):
    """Two features per 10 ms frame (log energy and mean), plus a delay per call."""

    def __init__(self, delay: float = 0.3, hop: int = 160):
        super().__init__()
        self.delay = delay
        self.hop = hop

    def collect_feats(self, speech: torch.Tensor, speech_lengths: torch.Tensor, **kwargs):
        time.sleep(self.delay)
        frames = speech[:, : speech.shape[1] // self.hop * self.hop].reshape(speech.shape[0], -1, self.hop)
        feats = torch.stack([torch.log(frames.pow(2).mean(-1) + 1e-6), frames.mean(-1)], dim=-1)
        return {"feats": feats, "feats_lengths": speech_lengths // self.hop}
