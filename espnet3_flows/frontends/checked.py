"""Feature arrays whose NaN/Inf check was made where they were computed."""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable


class CheckedFeatures(list):
    """A frontend call's feature arrays (a list, in its waveforms' order) with ``nonfinite[i]``:
    whether array ``i`` holds NaN or Inf, found on the device that computed them (one flag per
    waveform comes back with the features), so that
    :func:`~espnet3_flows.frontends.frontend.extract_features` need not scan every array again on
    the host. A frontend may return a plain list: the host scans its arrays then."""

    def __init__(self, arrays: Iterable[Any], nonfinite: Iterable[bool]):
        super().__init__(arrays)
        self.nonfinite = [bool(b) for b in nonfinite]
        if len(self.nonfinite) != len(self):
            raise ValueError(f"{len(self.nonfinite)} NaN/Inf flags for {len(self)} feature arrays")
