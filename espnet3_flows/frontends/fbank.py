"""lhotse's Kaldi-compatible log-mel fbank, computed per utterance in fewer passes over memory.

lhotse's ``Wav2LogFilterBank`` spends most of its time on a 4 s utterance in three
operations that are cheap in principle: the complex ``abs()`` of the spectrum (a ``hypot`` per
bin, squared again), pre-emphasis through a ``replicate`` pad of every frame, and a dense mel
matrix product in which 87 % of the weights are zero. This module runs the same pipeline with
lhotse's own framing, window and mel matrix, but takes the power spectrum as ``re² + im²``,
pre-emphasises in place and multiplies each band of filters by its own bins only: about 2x
faster on one core (the kernel rows of ``benchmarks/bench_collect_stats.py``), features equal
to lhotse's within 1e-6 (float32 rounding; ``tests/frontends/test_fbank.py``).
Configurations it does not cover (energy features, magnitude spectra) run lhotse's own ``extract``.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from espnet3_flows.errors import BadItemError
from espnet3_flows.frontends.checked import CheckedFeatures
from espnet3_flows.frontends.device_moments import FrameMoments, Moments
from espnet3_flows.frontends.lhotse_private import FbankLayout, LayoutUnavailable, fbank_layout
from espnet3_flows.frontends.pinned import HostCopy, PinnedStaging, Result, overlapped



#: Samples per batch of :meth:`FastFbank.batch` (~17 min of 16 kHz audio: ~0.7 GB of frames on a GPU)
DEFAULT_BATCH_SAMPLES = 1 << 24


class FbankTooShortError(BadItemError):
    """A waveform is shorter than the framing can reflect at its edges (lhotse would fail)."""


class FastFbank:
    """Log-mel filterbank features of lhotse's ``Fbank`` extractor, one waveform at a time.

    Args:
        extractor: A ``lhotse.Fbank``; its config (frame length and shift, window, mel banks,
            pre-emphasis, DC removal, dither, snip_edges) defines the features.
    """

    def __init__(self, extractor: Any):
        self.extractor = extractor
        self.sampling_rate = int(extractor.config.sampling_rate)
        #: whether the fast path covers this config; otherwise lhotse's ``extract`` runs
        self.fast = False
        self._device_tensors: dict[str, Any] = {}
        self._staging = PinnedStaging()
        try:
            self._read_layout(fbank_layout(extractor))
        except LayoutUnavailable as exc:
            self._fall_back(str(exc), warn=exc.warn)
            return
        except (AttributeError, ImportError, TypeError, ValueError, IndexError) as exc:
            self._fall_back(f"lhotse's Fbank no longer has the private layout the fast path reads ({exc!r})")
            return
        if self.fast and not self._agrees_with_lhotse():
            self._fall_back("the fast path's features differ from lhotse's Fbank.extract on a test signal")

    def _read_layout(self, layout: FbankLayout) -> None:
        """Take lhotse's framing, window and mel matrix (:mod:`.lhotse_private`)."""
        self._frame = layout.frame
        self._length, self._shift, self._pad = layout.length, layout.shift, layout.pad_length
        self._snip_edges = layout.snip_edges
        self._remove_dc = layout.remove_dc_offset
        self._preemph = layout.preemph_coeff
        self._dither = layout.dither
        self._window = layout.window
        self._mel = layout.mel
        self._bands = mel_bands(layout.mel)
        self._num_mel_bins = int(layout.mel.shape[1])
        self._eps = layout.eps
        #: fewest samples lhotse's framing takes (with fewer it reads past the waveform's end)
        self.min_samples = _min_samples(self._length, self._shift, self._snip_edges)
        self.fast = not layout.use_energy and not layout.use_fft_mag

    def _agrees_with_lhotse(self) -> bool:
        """Both paths on 0.37 s of noise (skipped with dither, which makes each call differ)."""
        import torch

        if self._dither != 0.0:
            return True
        probe = np.random.default_rng(0).standard_normal(int(0.37 * self.sampling_rate)).astype(np.float32) * 0.1
        with torch.inference_mode():
            try:
                mine = self._features(torch.from_numpy(probe.copy())).numpy()
            except Exception:  # noqa: BLE001 - any failure of the private path means: do not use it
                return False
            ref = np.asarray(self.extractor.extract(probe, self.sampling_rate))
        return mine.shape == ref.shape and bool(np.allclose(mine, ref, rtol=1e-4, atol=1e-3))

    def _fall_back(self, why: str, warn: bool = True) -> None:
        import warnings

        import lhotse

        cfg = self.extractor.config
        length = int(round(cfg.frame_length * self.sampling_rate))
        shift = int(round(cfg.frame_shift * self.sampling_rate))
        self.min_samples = _min_samples(length, shift, bool(cfg.snip_edges))
        self.fast = False
        if warn:
            warnings.warn(f"FastFbank: {why} (lhotse {lhotse.__version__}; tested with 1.30-1.33): using lhotse's "
                          "Fbank.extract, same features, about 2x slower", RuntimeWarning, stacklevel=3)

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """``(frames, num_mel_bins)`` float32 features of a mono float32 waveform.

        Raises:
            FbankTooShortError: the waveform has fewer than ``min_samples`` samples.
        """
        return self._alone(self._checked(samples))

    def _checked(self, samples: np.ndarray) -> np.ndarray:
        """``samples`` as writable contiguous float32, checked: mono and at least ``min_samples`` long."""
        array = np.ascontiguousarray(samples, dtype=np.float32)
        if not array.flags.writeable:  # torch.from_numpy warns on read-only memory
            array = array.copy()
        if array.ndim != 1:
            raise ValueError(f"expected a mono waveform, got shape {tuple(array.shape)}")
        if array.size < self.min_samples:
            raise FbankTooShortError(f"audio of {array.size} samples is shorter than one fbank frame needs "
                                     f"({self.min_samples} samples at {self.sampling_rate} Hz)")
        return array

    def _alone(self, array: np.ndarray) -> np.ndarray:
        """The features of one checked waveform (:meth:`_checked`)."""
        import torch

        with torch.inference_mode():
            if not self.fast:
                return np.asarray(self.extractor.extract(array, self.sampling_rate))
            return self._features(torch.from_numpy(array)).numpy()

    def _features(self, wave: Any) -> Any:
        import torch

        if self._dither != 0.0:
            wave = wave + self._dither * torch.randn(wave.shape)
        frames = self._frame(wave[None], self._length, self._shift, self._snip_edges)[0]
        # a new tensor either way: the in-place steps below must never reach the caller's samples
        # (with snip_edges and shift == length the frames are a plain view of them)
        if self._remove_dc:
            frames = frames - frames.mean(dim=1, keepdim=True)
        else:
            frames = frames.clone(memory_format=torch.contiguous_format)
        if self._preemph != 0.0:
            # x[j] - c * x[j-1], and x[0] - c * x[0] (lhotse's replicate pad), without the pad copy
            first = frames[:, :1] - self._preemph * frames[:, :1]
            frames[:, 1:] -= self._preemph * frames[:, :-1]
            frames[:, :1] = first
        padded = frames.new_zeros((frames.shape[0], self._pad))
        torch.mul(frames, self._window, out=padded[:, :self._length])
        spectrum = torch.view_as_real(torch.fft.rfft(padded, dim=-1)).square_()
        power = spectrum[..., 0] + spectrum[..., 1]  # 6x faster than .sum(-1) over the pairs
        mel = power.new_empty((self._num_mel_bins, power.shape[0]))
        for first, last, low, high, weights in self._bands:
            torch.matmul(weights, power[:, low:high].T, out=mel[first:last])
        return mel.clamp_min_(self._eps).log_().T.contiguous()

    def batch(self, waves: Sequence[np.ndarray], device: str = "cpu",
              max_batch_samples: int = DEFAULT_BATCH_SAMPLES, gather: bool | None = None) -> list[np.ndarray]:
        """Features of many waveforms, computed on ``device`` in batches of concatenated frames.

        Every utterance's frames (lhotse's framing, edges reflected within that utterance) are
        gathered into one ``[frames, frame_length]`` matrix per batch, so no utterance is padded
        and each one's features equal what :meth:`__call__` gives it alone (float32 rounding of
        the device's FFT and matrix products aside: within 1e-5 on a CUDA GPU). Batches hold at
        most ``max_batch_samples`` samples (one longer utterance goes alone). ``gather`` (default:
        on a GPU only) takes that path; without it each waveform runs through :meth:`__call__`,
        which is ~15x faster on a CPU core than gathering frames into one matrix. Gathered, each
        batch's features come back in one copy (into pinned memory from a GPU, while it computes
        the next batch), each array a view of it, checked for NaN and Inf on the device
        (:class:`~espnet3_flows.frontends.checked.CheckedFeatures`).

        Raises:
            FbankTooShortError: a waveform has fewer than ``min_samples`` samples.
        """
        import torch

        arrays = [self._checked(w) for w in waves]
        dev = torch.device(device)
        if gather is None:
            gather = dev.type != "cpu"
        if not gather or not self.fast or self._dither != 0.0:  # (dither draws per call: keep __call__'s)
            return [self._alone(a) for a in arrays]

        def to_host(feats: Any, counts: list[int]) -> tuple[HostCopy, HostCopy, list[int]]:
            flags = self._nonfinite_arrays(feats, counts)
            return self._staging.to_host(feats), self._staging.to_host(flags), counts

        out: list[np.ndarray] = []
        nonfinite: list[bool] = []
        for feats, flags, counts in self._gathered(arrays, dev, max_batch_samples, to_host):
            nonfinite.extend(b > 0 for b in flags.wait().tolist())
            out.extend(np.split(feats.array(), np.cumsum(counts)[:-1]))
        return CheckedFeatures(out, nonfinite)

    def moments(self, waves: Sequence[np.ndarray], device: str,
                max_batch_samples: int = DEFAULT_BATCH_SAMPLES) -> FrameMoments:
        """The moments of the waveforms' features, computed on ``device`` by :meth:`batch`'s path
        (gathered frames, where the fast path applies; each waveform alone otherwise): only the
        frame counts and per-waveform NaN/Inf flags come to the host.

        Raises:
            FbankTooShortError: a waveform has fewer than ``min_samples`` samples.
        """
        import torch

        arrays = [self._checked(w) for w in waves]
        samples = sum(a.size for a in arrays)  # computed as they are: gathered frames pad nothing
        dev = torch.device(device)
        frames, nonfinite, total = [], [], Moments()
        dim = self._num_mel_bins if self.fast else 0
        if not self.fast or self._dither != 0.0:
            for a in arrays:
                rows = torch.from_numpy(self._alone(a)).to(dev)
                frames.append(int(rows.shape[0]))
                dim = int(rows.shape[1])
                nonfinite.append(not bool(torch.isfinite(rows).all()))
                total = total if nonfinite[-1] else total.merge(Moments.of_rows(rows))
            return FrameMoments(frames, dim, total, nonfinite, samples, samples)
        for feats, counts in self._gathered(arrays, dev, max_batch_samples, lambda *done: done):
            with torch.inference_mode():
                flags = [b > 0 for b in self._nonfinite_arrays(feats, counts).cpu().tolist()]  # the one wait per batch
                if not any(flags):
                    total = total.merge(Moments.of_rows(feats))
            frames.extend(counts)
            nonfinite.extend(flags)
        return FrameMoments(frames, dim, total, nonfinite, samples, samples)

    def _gathered(self, arrays: Sequence[np.ndarray], dev: Any, max_batch_samples: int,
                  then: Callable[[Any, list[int]], Result]) -> Iterator[Result]:
        """``then(features [frames, num_mel_bins] on dev, frames of each array)`` per batch of at most
        ``max_batch_samples`` samples (one longer array goes alone), queued right after the batch's
        compute; on a GPU the next batch's waveforms are concatenated, copied and launched before
        this one's result is handed over (:func:`~espnet3_flows.frontends.pinned.overlapped`)."""
        import torch

        spans: list[tuple[int, int]] = []
        start = 0
        while start < len(arrays):
            end, total = start + 1, arrays[start].size
            while end < len(arrays) and total + arrays[end].size <= max_batch_samples:
                total += arrays[end].size
                end += 1
            spans.append((start, end))
            start = end

        def launch(span: tuple[int, int], wave: Any) -> Result:
            with torch.inference_mode():
                return then(*self._batch_features(wave, [a.size for a in arrays[span[0]:span[1]]], dev))

        return overlapped(spans, lambda span: self._uploaded(arrays[span[0]:span[1]], dev), launch)

    @staticmethod
    def _nonfinite_arrays(feats: Any, counts: list[int]) -> Any:
        """``[arrays]`` counts, on ``feats``' device, of the frames holding NaN or Inf in each
        array's ``counts`` rows of the gathered ``feats``."""
        import torch

        dev = feats.device
        owner = torch.repeat_interleave(torch.arange(len(counts), device=dev), _int64_on(counts, dev),
                                        output_size=int(feats.shape[0]))  # (no wait for the device)
        bad = torch.zeros(len(counts), dtype=torch.long, device=dev)
        return bad.index_add_(0, owner, (~torch.isfinite(feats)).any(dim=1).to(torch.long))

    def _frame_positions(self, lengths: Sequence[int], dev: Any) -> tuple[Any, list[int]]:
        """Index of every frame sample in the concatenated waveforms ``[frames, length]`` (lhotse's
        ``_get_strided_batch`` per utterance: with ``snip_edges`` off, edges are mirrored with the
        edge sample repeated), and the frame count of each utterance."""
        import torch

        length, shift = self._length, self._shift
        counts = [1 + (n - length) // shift if self._snip_edges else (n + shift // 2) // shift for n in lengths]
        left = 0 if self._snip_edges else (length - shift) // 2
        n, c, total = _int64_on(lengths, dev), _int64_on(counts, dev), sum(counts)
        offsets = torch.cumsum(n, 0) - n
        utt = torch.repeat_interleave(torch.arange(len(lengths), device=dev), c, output_size=total)
        frame = torch.arange(total, device=dev) - torch.repeat_interleave(torch.cumsum(c, 0) - c, c, output_size=total)
        pos = (frame * shift - left)[:, None] + torch.arange(length, device=dev)[None, :]
        size = n[utt][:, None]
        pos = torch.where(pos < 0, -pos - 1, pos)
        pos = torch.where(pos >= size, 2 * size - 1 - pos, pos)
        return pos + offsets[utt][:, None], counts

    def _uploaded(self, arrays: Sequence[np.ndarray], dev: Any) -> Any:
        """The arrays concatenated on ``dev``: on a GPU through pinned memory, copied on a side stream."""
        import torch

        if dev.type != "cuda":
            return torch.from_numpy(np.concatenate(arrays))
        host = self._staging.take(sum(a.size for a in arrays))
        np.concatenate(arrays, out=host.numpy())
        return self._staging.to_device(host, dev)

    def _batch_features(self, wave: Any, lengths: Sequence[int], dev: Any) -> tuple[Any, list[int]]:
        """``([frames of all waveforms, num_mel_bins], frame counts)`` on ``dev`` of ``wave``, the
        concatenated waveforms of ``lengths`` samples each."""
        import torch

        positions, counts = self._frame_positions(lengths, dev)
        frames = wave[positions]
        if self._remove_dc:
            frames -= frames.mean(dim=1, keepdim=True)
        if self._preemph != 0.0:
            frames[:, 1:] -= self._preemph * frames[:, :-1]  # (the product is a new tensor)
            frames[:, :1] -= self._preemph * frames[:, :1]
        window, fb = self._on(dev)
        padded = torch.nn.functional.pad(frames * window, (0, self._pad - self._length))
        spectrum = torch.view_as_real(torch.fft.rfft(padded, dim=-1))
        power = spectrum.square_().sum(-1)
        return torch.matmul(power, fb).clamp_min_(float(self._eps)).log_(), counts

    def _on(self, dev: Any) -> tuple[Any, Any]:
        """The window and the dense mel matrix ``[bins, filters]`` on ``dev`` (kept per device)."""
        cached = self._device_tensors.get(str(dev))
        if cached is None:
            cached = self._device_tensors[str(dev)] = (self._window.to(dev), self._mel.to(dev))
        return cached


def _int64_on(values: Sequence[int], dev: Any) -> Any:
    """``values`` as an int64 tensor on ``dev``, copied without waiting for the device's queued
    work (a blocking copy to a GPU would wait for the batch before to finish computing)."""
    import torch

    return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)


def _min_samples(length: int, shift: int, snip_edges: bool) -> int:
    """Shortest waveform whose reflected edges lhotse's ``_get_strided_batch`` can take from it."""
    if snip_edges:
        return length
    left = (length - shift) // 2
    n = max(left, 1)
    while True:  # a few hundred steps at most: the bound is below one frame length
        frames = (n + shift // 2) // shift
        if frames >= 1 and n >= (frames - 1) * shift + length - n - left:
            return n
        n += 1


def mel_bands(fb: Any, filters_per_band: int = 10) -> list[tuple[int, int, int, int, Any]]:
    """The mel matrix ``[bins, filters]`` cut into bands of filters with their nonzero bin ranges.

    Each triangular filter covers a few FFT bins, so ~87 % of lhotse's 257x80 matrix is zero;
    multiplying each band of filters by its bin range alone does 1/8 of the work (2x faster
    on 4 s utterances). Skipping exact zeros changes only the order of float32 additions.

    Returns:
        ``(first_filter, end_filter, low_bin, end_bin, weights[filters, bins])`` per band.
    """
    import torch

    bands = []
    for first in range(0, fb.shape[1], filters_per_band):
        last = min(first + filters_per_band, fb.shape[1])
        rows = torch.nonzero(fb[:, first:last].abs().sum(dim=1))[:, 0]
        low, high = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 1)
        bands.append((first, last, low, high, fb[low:high, first:last].T.contiguous()))
    return bands
