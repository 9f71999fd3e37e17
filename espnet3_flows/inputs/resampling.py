"""Resampling an utterance to the job's rate, by the method :data:`~.audio_config.RESAMPLERS` names."""

from __future__ import annotations

import math

import numpy as np

from espnet3_flows.inputs.audio_config import RESAMPLERS


def resample(x: np.ndarray, orig_sr: int, target_sr: int, method: str = "poly") -> np.ndarray:
    """``x`` resampled from ``orig_sr`` to ``target_sr`` by ``method`` (one of `RESAMPLERS`; float32 out)."""
    if method == "librosa":
        import librosa

        return np.asarray(librosa.resample(x.astype(np.float32), orig_sr=int(orig_sr), target_sr=int(target_sr)),
                          dtype=np.float32)
    if method == "torchaudio":
        import torch
        import torchaudio

        return torchaudio.functional.resample(torch.from_numpy(x.astype(np.float32))[None], int(orig_sr),
                                              int(target_sr))[0].numpy()
    if method != "poly":
        raise ValueError(f"unknown resampler {method!r}; one of {RESAMPLERS}")
    from scipy.signal import resample_poly

    g = math.gcd(int(orig_sr), int(target_sr))
    up, down = int(target_sr) // g, int(orig_sr) // g
    return resample_poly(x.astype(np.float64), up, down).astype(np.float32)
