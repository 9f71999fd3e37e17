"""How the frontends run as callables over a call's waveforms (what :func:`~.frontend.build_frontend`
builds and :func:`~.frontend.extract_features` calls): one utterance at a time
(:class:`PerUtterance`), or torch modules (a model's ``collect_feats`` or an ESPnet2 frontend) over
length-bucketed padded batches, each utterance's valid frames cut back out (:class:`TorchFrontend`).
The built-in ``frontend.type`` values are one module each: :mod:`.fbank_type`, :mod:`.model_type`,
:mod:`.espnet2_type`, :mod:`.none_type`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from espnet3_flows.frontends.bucket_shapes import (LADDER_ALIGN, LADDER_BASE, LADDER_STEP, ROW_STEPS,
                                                   bucket_capacity, bucket_length, bucket_shape)
from espnet3_flows.frontends.checked import CheckedFeatures
from espnet3_flows.frontends.device_moments import FrameMoments, Moments, nonfinite_rows
from espnet3_flows.frontends.pinned import HostCopy, PinnedStaging, Result, overlapped
from espnet3_flows.frontends.precision import check_precision, precision_scope

if TYPE_CHECKING:
    import numpy as np

    from espnet3_flows.frontends.config import FrontendConfig


#: Version of how model and ESPnet2 frontends are run (one utterance per call unless batched)
TORCH_FRONTEND_IMPLEMENTATION = "espnet3_flows.stats.frontend.TorchFrontend/1"
#: Version of what ``bf16``/``fp16`` compute beyond autocast (in shard hashes of those precisions
#: only): 2, ``SSLFeatures``' first norm in the autocast dtype
REDUCED_PRECISION_VERSION = 2
#: The most padding a padded batch of :meth:`TorchFrontend.batches` takes on once it holds
#: :data:`FULL_ENOUGH` of ``max_batch_samples`` (a share of its samples)
MAX_PADDING = 0.05
#: How full a padded batch is before :data:`MAX_PADDING` closes it: below it, a call of few
#: utterances of scattered lengths would otherwise run them one or two at a time, which costs a
#: GPU more than their padding (calls of 16 utterances of 2-16 s: 523 batches of 2 under a strict
#: 5 % against 154 here and 80 without the bound)
FULL_ENOUGH = 0.25


class PerUtterance:
    """A frontend of one waveform (``samples -> (frames, dim)``) run on each waveform of a batch:
    nothing padded, features independent of what else is in the batch (lhotse's fbank, and
    ESPnet2's ``default`` frontend through :class:`~espnet3_flows.frontends.espnet2_default.FastDefaultFrontend`)."""

    def __init__(self, extract: Callable[[np.ndarray], np.ndarray]):
        self.extract = extract

    def __call__(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any]) -> list[np.ndarray]:
        return [self.extract(w) for w in waves]


def hop_samples(frontend: Any) -> int | None:
    """Samples between frames of a built frontend's features where its torch module says: the
    ``hop_length`` of ESPnet2's frontends (an ``s3prl`` upstream's downsampling rate among them),
    ``FusedFrontends``' common hop (``gcd``), or the ``hop_length`` of a model's own ``frontend``
    (an ESPnet model's); ``None`` for any other."""
    import numpy as np  # (not at import: the frontend types' declarations import this module)

    module = getattr(frontend, "module", None)
    for owner in (module, getattr(module, "frontend", None)):
        hop = getattr(owner, "hop_length", None) or getattr(owner, "gcd", None)
        if isinstance(hop, (int, np.integer)) and not isinstance(hop, bool) and hop > 0:
            return int(hop)
    return None


def check_cuda(device: str) -> None:
    """Fail with the fix when ``device`` names a CUDA GPU this process cannot see."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"frontend.device={device} but this worker sees no CUDA GPU (run it with "
                           "parallel.env=local_gpu, or SLURM with a GPU per job)")


class TorchFrontend:
    """A torch feature extractor on each utterance, or on length-sorted padded batches.

    Args:
        extract: ``(speech [B,T], speech_lengths [B], kwargs) -> (feats [B,T',D], lengths [B] or None)``.
        module: The torch module behind ``extract`` (moved to ``device``).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        max_batch_samples: 0: one utterance per call (features independent of padding);
            otherwise the most ``batch x longest`` samples per padded call.
        precision: What ``extract`` computes in (:data:`~espnet3_flows.frontends.precision.PRECISIONS`).
        bucket_shapes: Pad each batch to a fixed shape (:mod:`.bucket_shapes`; with
            ``max_batch_samples`` above 0): rows of zeros of the batch's length fill it, and
            are computed and dropped.
    """

    def __init__(self, extract: Callable[[Any, Any, Mapping[str, Any]], tuple[Any, Any]], module: Any,
                 device: str = "cpu", max_batch_samples: int = 0, precision: str = "float32",
                 bucket_shapes: bool = False):
        import torch

        check_cuda(device)
        check_precision(precision)
        self.extract, self.device, self.max_batch_samples = extract, torch.device(device), max_batch_samples
        self.precision, self.module = precision, module
        self.bucket_shapes = bucket_shapes and max_batch_samples > 0
        self._staging = PinnedStaging()  # where the padded batches are assembled on a GPU
        if hasattr(module, "to"):
            module.to(self.device)
        if hasattr(module, "eval"):
            module.eval()

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Positions grouped into calls: alone, or length-sorted into padded batches of at most
        ``max_batch_samples`` samples (batch x longest); a batch that holds :data:`FULL_ENOUGH`
        of them closes where the next utterance would take its padding past :data:`MAX_PADDING`.
        With :attr:`bucket_shapes`, a batch holds at most its ladder length's capacity."""
        if self.max_batch_samples <= 0:
            return [[i] for i in range(len(lengths))]
        groups: list[list[int]] = []
        total = 0  # the samples of the last group
        for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
            n = int(lengths[i])
            padded = (len(groups[-1]) + 1) * n if groups else 0  # (ascending: n is the longest)
            fits = bool(groups) and padded <= self.max_batch_samples and (
                not self.bucket_shapes or len(groups[-1]) < bucket_capacity(bucket_length(n), self.max_batch_samples))
            if fits and (
                    total + n >= (1 - MAX_PADDING) * padded or total < FULL_ENOUGH * self.max_batch_samples):
                groups[-1].append(i)
                total += n
            else:
                groups.append([i])
                total = n
        return groups

    def shape(self, sizes: list[int]) -> tuple[int, int]:
        """``(rows, samples)`` a batch of utterances of ``sizes`` samples is computed in: as they
        are, or with :attr:`bucket_shapes` a fixed shape (:func:`~.bucket_shapes.bucket_shape`)."""
        return bucket_shape(sizes, self.max_batch_samples) if self.bucket_shapes else (len(sizes), max(sizes))

    def _computed(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any],
                  then: Callable[[list[int], Any, Any], Result]) -> Iterator[Result]:
        """Per call (:meth:`batches`): ``then(positions, feats [B, T', D], lengths [B])``, queued on
        the device right after the call's compute; the lengths the extractor's or, where it gives
        none, ``T'`` for every row. On a GPU the next call's batch is assembled, copied and launched
        before this one's result is handed over (:func:`~espnet3_flows.frontends.pinned.overlapped`)."""
        import torch

        def launch(group: list[int], staged: tuple[Any, Any]) -> Result:
            speech, lengths = staged
            with torch.inference_mode():
                with precision_scope(self.device, self.precision, planned_shapes=self.bucket_shapes):
                    feats, flens = self.extract(speech, lengths, kwargs)
                if flens is None:
                    if self.bucket_shapes:
                        raise ValueError("frontend.bucket_shapes needs a frontend that gives its features' lengths "
                                         "(feats_lengths): every utterance would keep its batch's padded frames")
                    flens = torch.full((feats.shape[0],), feats.shape[1], dtype=torch.long, device=feats.device)
                rows = len(group)  # (the rows of zeros filling a fixed shape dropped)
                return then(group, feats[:rows].detach(), flens[:rows].detach())

        return overlapped(self.batches([len(w) for w in waves]), lambda group: self._staged(waves, group), launch)

    def __call__(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any]) -> CheckedFeatures:
        """Each waveform's features (float32, a view of its batch's features) with its NaN/Inf
        flag. On a GPU each batch's padded features are cast to float32 and checked there, and
        come back in one copy through pinned memory while the GPU computes the next batch."""
        import numpy as np
        import torch

        def to_host(group: list[int], feats: Any, flens: Any) -> tuple[list[int], HostCopy, HostCopy]:
            lengths, feats = flens.to(device=feats.device, dtype=torch.long), feats.float()
            meta = torch.stack([lengths, nonfinite_rows(feats, lengths).to(torch.long)])
            return group, self._staging.to_host(feats), self._staging.to_host(meta)

        out: list[np.ndarray] = [np.empty(0)] * len(waves)
        nonfinite = [False] * len(waves)
        for group, feats, meta in self._computed(waves, kwargs, to_host):
            lengths, bad = meta.wait().tolist()
            host = feats.array()
            for row, i in enumerate(group):
                out[i], nonfinite[i] = host[row, : int(lengths[row])], bool(bad[row])
        return CheckedFeatures(out, nonfinite)

    #: :meth:`moments` runs here: on the CPU as on a GPU, the same code (what CI tests of the GPU's)
    computes_moments = True

    def moments(self, waves: Sequence[np.ndarray], kwargs: Mapping[str, Any]) -> FrameMoments:
        """The moments of the waveforms' features, computed where the features are: only each
        call's frame counts and NaN/Inf flags come to the host (:mod:`.device_moments`)."""
        import torch

        frames, nonfinite = [0] * len(waves), [False] * len(waves)
        total, dim, computed = Moments(), 0, 0
        for group, feats, flens in self._computed(waves, kwargs, lambda *done: done):
            rows, longest = self.shape([len(waves[i]) for i in group])
            computed += rows * longest
            with torch.inference_mode():
                lengths = flens.to(torch.long)
                bad = nonfinite_rows(feats, lengths)
                host = torch.stack([lengths, bad.to(torch.long)]).cpu().tolist()  # the one wait per call
                dim = int(feats.shape[2])
                if not any(host[1]):
                    total = total.merge(Moments.of_padded(feats, lengths, int(sum(host[0]))))
            for row, i in enumerate(group):
                frames[i], nonfinite[i] = int(host[0][row]), bool(host[1][row])
        return FrameMoments(frames, dim, total, nonfinite, sum(len(w) for w in waves), computed)

    def _staged(self, waves: Sequence[np.ndarray], group: list[int]) -> tuple[Any, Any]:
        """``(speech [rows, longest], lengths [rows])`` of ``group``'s waveforms, zero-padded, on the
        device: on a GPU assembled in pinned memory and copied on a side stream
        (:class:`~espnet3_flows.frontends.pinned.PinnedStaging`)."""
        import numpy as np
        import torch

        sizes = [len(waves[i]) for i in group]
        rows, longest = self.shape(sizes)
        gpu = self.device.type == "cuda"
        speech = self._staging.take(rows * longest).view(rows, longest) if gpu else torch.empty(rows, longest)
        for row, (i, n) in enumerate(zip(group, sizes, strict=True)):
            speech[row, :n] = torch.from_numpy(np.asarray(waves[i], dtype=np.float32))
            speech[row, n:] = 0.0
        speech[len(sizes):] = 0.0
        lengths = torch.tensor(sizes + [longest] * (rows - len(sizes)), dtype=torch.long)
        if not gpu:
            return speech, lengths
        return self._staging.to_device(speech, self.device), lengths.to(self.device, non_blocking=True)


def espnet2_frontend(frontend: Any, device: str = "cpu", max_batch_samples: int = 0,
                     precision: str = "float32", bucket_shapes: bool = False) -> TorchFrontend:
    """A frontend from an ESPnet2 frontend module (``forward(speech, lengths) -> (feats, lengths)``),
    run as ESPnet2's ``collect_feats`` runs it."""

    def extract(speech: Any, lengths: Any, kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
        return frontend(speech, lengths)

    return TorchFrontend(extract, frontend, device, max_batch_samples, precision, bucket_shapes)


def torch_batching(cfg: FrontendConfig) -> dict[str, Any]:
    """What of a torch frontend's run decides its features, for the shard hashes (``precision``
    only when set: float32 shards keep the hashes they had before precision existed; the padding
    bound of the batches only where there are batches)."""
    return {"max_batch_samples": cfg.max_batch_samples, "implementation": TORCH_FRONTEND_IMPLEMENTATION,
            **({"precision": cfg.precision, "reduced_precision": REDUCED_PRECISION_VERSION}
               if cfg.precision != "float32" else {}),
            **({"max_padding": [MAX_PADDING, FULL_ENOUGH]} if cfg.max_batch_samples > 0 else {}),
            **({"bucket_shapes": [LADDER_BASE, LADDER_STEP, LADDER_ALIGN, ROW_STEPS]} if cfg.bucket_shapes else {})}
