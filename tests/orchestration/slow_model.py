"""A tiny ``collect_feats`` model that sleeps, so a test can kill a run mid-way."""

from __future__ import annotations

import os
import signal
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


class KillOnceFramer(SlowFramer):
    """:class:`SlowFramer` that SIGKILLs its own process on its ``kill_at``-th call, once.

    The marker file is created before the kill, so whichever process runs the same batch again
    (a Dask retry on another worker, or a rerun) goes on normally. While the file ``poison``
    exists, every process dies at that call: a poison shard (a decoder that segfaults, an input
    that OOM-kills); removing the file cures it without changing the config (or shard hashes).
    """

    def __init__(self, marker: str, kill_at: int = 3, delay: float = 0.05, hop: int = 160,
                 poison: str | None = None):
        super().__init__(delay=delay, hop=hop)
        self.marker = marker
        self.poison = poison
        self.kill_at = kill_at
        self.calls = 0

    def collect_feats(self, speech: torch.Tensor, speech_lengths: torch.Tensor, **kwargs):
        self.calls += 1
        if self.calls == self.kill_at and (
                not os.path.exists(self.marker) or (self.poison and os.path.exists(self.poison))):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().collect_feats(speech, speech_lengths, **kwargs)


class FailOnLength(SlowFramer):
    """:class:`SlowFramer` that fails on any batch holding an utterance of exactly ``length``
    samples, counting each attempt in ``counter`` (one line per call): ``error="bad"`` raises
    BadItemError (a bad item), ``error="value"`` a plain ValueError (a bug in model code, as numpy
    or torch raise them), ``error="os"`` OSError (a transient I/O failure)."""

    def __init__(self, length: int, counter: str, error: str = "value", delay: float = 0.0, hop: int = 160):
        super().__init__(delay=delay, hop=hop)
        self.length, self.counter, self.error = length, counter, error

    def collect_feats(self, speech: torch.Tensor, speech_lengths: torch.Tensor, **kwargs):
        if bool((speech_lengths == self.length).any()):
            with open(self.counter, "a") as f:
                f.write(f"{os.getpid()}\n")
            from espnet3_flows.errors import BadItemError

            kind = {"bad": BadItemError, "value": ValueError, "os": OSError}[self.error]
            raise kind(f"poisoned length {self.length}")
        return super().collect_feats(speech, speech_lengths, **kwargs)
