"""Comparing the float outputs of two runs in different processes: within a tolerance, never bit
for bit. Another process may take another FFT or BLAS kernel path (MKL picks by memory alignment
and CPU, a worker may run on other threads), which moves last bits; what these tests guard against
(a lost or doubled utterance, a shard merged twice, features of another config) moves values by
far more. Measured (tests/test_output_versions.py, kernels switched by ATEN_CPU_CAPABILITY and
MKL_ENABLE_INSTRUCTIONS): at most 5e-5 of the largest magnitude for a log-mel value near the
floor, 1.2e-6 for x-vectors and stats; one frontend option changed (frame_length 0.025 -> 0.0249)
moves log-mel values by up to half the RMS and stats sums by 2e-3 of it."""

from __future__ import annotations

from typing import Any

import numpy as np

#: the default tolerance, relative to each value and to the largest magnitude of the expected array
REL = 1e-4


def assert_same_floats(got: Any, want: Any, rel: float = REL) -> None:
    """``got`` equals ``want`` in shape and within ``rel`` of each value plus ``rel`` of ``want``'s
    largest magnitude (``rel=0``: bit for bit, for copies of the same bytes)."""
    expected = np.asarray(want, dtype=np.float64)
    scale = float(np.abs(expected).max(initial=0.0))
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=rel, atol=rel * scale)
