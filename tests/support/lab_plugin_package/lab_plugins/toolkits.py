"""``xvector.toolkit: mean_std``: a two-number "speaker embedding" (mean and standard deviation of
the samples), each utterance's own whatever its batch."""

from __future__ import annotations

from espnet3_flows.xvector.toolkits import XVectorToolkit


def mean_std(wavs, wav_lens):
    """``[B, 2]``: each row's mean and standard deviation over its valid samples."""
    import torch

    lengths = (wav_lens * wavs.shape[1]).round().long()
    return torch.stack([torch.stack([w[:n].mean(), w[:n].std()]) for w, n in zip(wavs, lengths, strict=True)])


class MeanStd(XVectorToolkit):
    name = "mean_std"
    version = "1"

    def embedder(self, xv):
        return mean_std
