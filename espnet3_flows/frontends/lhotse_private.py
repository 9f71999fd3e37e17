"""The private names of lhotse this package reads: the layout of lhotse's Kaldi-compatible fbank
module (its framing function, window, mel matrix and floor), which :class:`~.fbank.FastFbank` runs
in fewer passes over memory. Behind the patches' switch (:mod:`espnet3_flows.patches`, name
``fbank_layout``); lhotse versions outside :data:`VERIFIED_LHOTSE` are refused too.

Without it :class:`~.fbank.FastFbank` runs lhotse's own ``Fbank.extract``: the same features,
slower. ``tests/test_patch_targets.py`` checks each name in the installed lhotse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: lhotse releases whose fbank layout was checked, as ``(major, minor)`` (1.30 to 1.33)
VERIFIED_LHOTSE = tuple((1, minor) for minor in range(30, 34))
#: the name of this read in :data:`espnet3_flows.patches.PATCHES`
PATCH = "fbank_layout"


class LayoutUnavailable(RuntimeError):
    """The layout may not be read: switched off (``warn`` false: asked for), or an lhotse it was not
    checked against (``warn`` true)."""

    def __init__(self, message: str, warn: bool):
        super().__init__(message)
        self.warn = warn


@dataclass(frozen=True)
class FbankLayout:
    """What lhotse's ``Wav2LogFilterBank`` computes with, read from its private attributes."""

    #: lhotse's framing: ``frame(waves (1, samples), length, shift, snip_edges) -> (1, frames, length)``
    frame: Callable[..., Any]
    length: int
    shift: int
    pad_length: int
    snip_edges: bool
    remove_dc_offset: bool
    preemph_coeff: float
    dither: float
    use_energy: bool
    use_fft_mag: bool
    #: the window, float32 ``(length,)``
    window: Any
    #: the mel matrix, float32 ``(pad_length // 2 + 1, num_mel_bins)``
    mel: Any
    #: the floor of the log, float32
    eps: Any


def lhotse_verified() -> bool:
    """Whether the installed lhotse is one of :data:`VERIFIED_LHOTSE`."""
    import lhotse

    major_minor = tuple(int(part) for part in str(lhotse.__version__).split(".")[:2])
    return major_minor in VERIFIED_LHOTSE


def fbank_layout(extractor: Any) -> FbankLayout:
    """The layout of ``extractor`` (a ``lhotse.Fbank``).

    Raises:
        LayoutUnavailable: the switch is off, or lhotse is not a verified version.
        AttributeError, ImportError, TypeError, ValueError, IndexError: lhotse's layout moved.
    """
    import lhotse
    import torch

    from espnet3_flows.patches import patches_enabled

    if not patches_enabled("fbank_layout"):
        raise LayoutUnavailable(f"ESPNET3_FLOWS_PATCHES turns {PATCH} off", warn=False)
    if not lhotse_verified():
        raise LayoutUnavailable(f"lhotse {lhotse.__version__} is not one whose fbank layout was checked "
                                f"({', '.join('.'.join(map(str, v)) for v in VERIFIED_LHOTSE)})", warn=True)
    from lhotse.features.kaldi.layers import _get_strided_batch

    module = extractor.extractor
    win = module.wav2win
    return FbankLayout(
        frame=_get_strided_batch, length=int(win._length), shift=int(win._shift), pad_length=int(win.pad_length),
        snip_edges=bool(win.snip_edges), remove_dc_offset=bool(win.remove_dc_offset),
        preemph_coeff=float(win.preemph_coeff), dither=float(win.dither), use_energy=bool(module.use_energy),
        use_fft_mag=bool(module.use_fft_mag), window=win._window.detach().to(torch.float32),
        mel=module._fb.detach().to(torch.float32), eps=module._eps.detach().to(torch.float32))
