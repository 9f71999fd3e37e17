"""``frontends.pinned.overlapped``: the order that lets the host assemble batch k+1 while a GPU
computes batch k (the pinned buffers themselves need a GPU: ``test_gpu_paths``)."""

from __future__ import annotations

import pytest

from espnet3_flows.frontends.pinned import overlapped


def test_the_next_batch_is_staged_before_a_batch_is_handed_over():
    events: list[str] = []

    def stage(batch: int) -> int:
        events.append(f"stage {batch}")
        return batch * 10

    def launch(batch: int, staged: int) -> int:
        events.append(f"launch {batch}")
        return staged + 1

    for result in overlapped(range(3), stage, launch):
        events.append(f"got {result}")
    assert events == ["stage 0", "launch 0", "stage 1", "got 1", "launch 1", "stage 2", "got 11", "launch 2",
                      "got 21"]
    assert list(overlapped([], stage, launch)) == []


def test_a_failing_batch_fails_after_the_batches_before_it_were_handed_over():
    def launch(batch: int, staged: int) -> int:
        if batch == 2:
            raise RuntimeError("out of memory")
        return batch

    got = []
    with pytest.raises(RuntimeError, match="out of memory"):
        for result in overlapped(range(4), lambda b: b, launch):
            got.append(result)
    assert got == [0, 1]

