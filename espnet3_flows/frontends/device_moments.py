"""Per-dimension moments of feature frames computed where the features are (a GPU, or the CPU):
count, mean and M2 in float64, folded together with Chan's formula. Collect-stats with a torch
frontend keeps its features on the device and copies only these, once per shard, to the host.

Float64 on the device, not compensated float32: the work is one pass over each batch's features,
bound by memory, not arithmetic, and data-centre GPUs run float64 at half their float32 rate
(consumer GPUs at 1/64, still far above the memory's pace for this). The result equals the host's
float64 :class:`~espnet3_flows.stats.accumulator.StatsAccumulator` to float64 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Moments:
    """Count, mean and M2 (sum of squared deviations from the mean) per feature dimension; ``mean``
    and ``m2`` are float64 tensors on the features' device (``None`` while ``count`` is 0)."""

    count: int = 0
    mean: Any = None
    m2: Any = None

    @classmethod
    def of_padded(cls, feats: Any, lengths: Any, count: int) -> Moments:
        """The moments of the valid frames of padded features.

        Args:
            feats: ``[batch, frames, dim]`` features on any device, any float dtype.
            lengths: ``[batch]`` valid frames of each row (a tensor on ``feats``' device).
            count: ``sum(lengths)``, known on the host.
        """
        import torch

        if count == 0:
            return cls()
        valid = valid_frames(feats, lengths)[..., None]
        x = feats.to(torch.float64, copy=True).masked_fill_(~valid, 0.0)
        mean = x.sum(dim=(0, 1)) / count
        x.sub_(mean).masked_fill_(~valid, 0.0)
        return cls(count, mean, torch.einsum("btd,btd->d", x, x))

    @classmethod
    def of_rows(cls, rows: Any) -> Moments:
        """The moments of ``[frames, dim]`` features, every row a frame."""
        import torch

        if rows.shape[0] == 0:
            return cls()
        x = rows.to(torch.float64, copy=True)
        mean = x.sum(dim=0) / rows.shape[0]
        x.sub_(mean)
        return cls(int(rows.shape[0]), mean, torch.einsum("nd,nd->d", x, x))

    def merge(self, other: Moments) -> Moments:
        """Both together (Chan et al.'s formula, computed on the device: no copy to the host)."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        if other.mean.shape != self.mean.shape:
            raise ValueError(f"cannot merge {other.mean.shape[0]}-dim features into {self.mean.shape[0]}-dim ones")
        n = self.count + other.count
        delta = other.mean.to(self.mean.device) - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2.to(self.m2.device) + delta.square() * (self.count * other.count / n)
        return Moments(n, mean, m2)

    def to_host(self) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """``(count, mean, m2)`` as float64 NumPy arrays (one copy from the device)."""
        if self.count == 0:
            return 0, None, None
        return self.count, self.mean.cpu().numpy(), self.m2.cpu().numpy()


@dataclass
class FrameMoments:
    """What a frontend computed over one call's waveforms without handing back their features."""

    #: valid frames of each waveform
    frames: list[int]
    #: the features' dimension
    dim: int
    #: the moments of every waveform's valid frames together
    moments: Moments = field(default_factory=Moments)
    #: whether each waveform's features hold NaN or Inf (then ``moments`` must not be used)
    nonfinite: list[bool] = field(default_factory=list)
    #: the waveforms' samples, and the samples computed (padding included) to get their features
    samples: int = 0
    computed_samples: int = 0


def valid_frames(feats: Any, lengths: Any) -> Any:
    """``[batch, frames]`` booleans: which frames of padded ``feats`` are within each row's length."""
    import torch

    return torch.arange(feats.shape[1], device=feats.device)[None, :] < lengths.to(feats.device)[:, None]


def nonfinite_rows(feats: Any, lengths: Any) -> Any:
    """``[batch]`` booleans on the device: which rows hold NaN or Inf within their valid frames."""
    import torch

    bad = ~torch.isfinite(feats)
    return (bad & valid_frames(feats, lengths)[..., None]).flatten(1).any(dim=1)
