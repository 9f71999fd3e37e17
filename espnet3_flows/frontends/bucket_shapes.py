"""Fixed batch shapes for padded torch frontends (``frontend.bucket_shapes``): each batch's longest
utterance is padded up to a length on a ladder of 5 % steps and its rows up to a count that depends
only on that length, so a GPU sees the same few shapes call after call (cuDNN's attention, which
plans each new shape, then plans once per shape; CUDA graphs and ``torch.compile`` need it too)."""

from __future__ import annotations

import math

#: The ladder's first length (samples): 0.1 s at 16 kHz; shorter utterances are padded to it
LADDER_BASE = 1600
#: The ladder's ratio: each length is 5 % above the one before, so a batch's longest utterance is
#: padded by less than 5 % (and the alignment's 10 ms)
LADDER_STEP = 1.05
#: Ladder lengths are multiples of this many samples (10 ms at 16 kHz)
LADDER_ALIGN = 160
#: A batch's rows are rounded up to a multiple of this share of its length's capacity (at least 8)
ROW_STEPS = 16


def bucket_length(samples: int) -> int:
    """The shortest ladder length that holds ``samples``."""
    if samples <= LADDER_BASE:
        return LADDER_BASE
    step = max(0, math.ceil(math.log(samples / LADDER_BASE) / math.log(LADDER_STEP)) - 1)
    while True:  # (the logarithm's rounding: at most a step or two)
        length = -(-math.ceil(LADDER_BASE * LADDER_STEP ** step) // LADDER_ALIGN) * LADDER_ALIGN
        if length >= samples:
            return length
        step += 1


def bucket_capacity(length: int, max_batch_samples: int) -> int:
    """The most rows a batch of ladder length ``length`` holds (at least one)."""
    return max(1, max_batch_samples // length)


def bucket_shape(sizes: list[int], max_batch_samples: int) -> tuple[int, int]:
    """``(rows, length)`` a batch of utterances of ``sizes`` samples is padded to: the ladder length
    of the longest (but never past ``max_batch_samples`` for an utterance that fits in it), and its
    rows rounded up to a power of two up to 8, above that to a multiple of a :data:`ROW_STEPS`-th of
    the length's capacity (at least 8), at most the capacity: about 20 row counts per length."""
    longest = max(sizes)
    length = min(bucket_length(longest), max(longest, max_batch_samples))
    capacity = bucket_capacity(length, max_batch_samples)
    rows = len(sizes)
    if rows <= 8:
        return min(max(capacity, rows), 1 << (rows - 1).bit_length()), length
    step = max(8, capacity // ROW_STEPS)
    return max(rows, min(capacity, -(-rows // step) * step)), length
