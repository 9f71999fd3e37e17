"""``frontends.pinned.overlapped``: the order that keeps batch k+1 queued on a GPU while the host
takes batch k's results and assembles the next (the pinned buffers and copies themselves need a GPU:
``test_gpu_paths``); a host tensor's copy to the host is the tensor itself."""

from __future__ import annotations

import pytest
import torch

from espnet3_flows.frontends.pinned import PinnedStaging, overlapped


def test_the_next_batch_is_staged_and_launched_before_a_batch_is_handed_over():
    events: list[str] = []

    def stage(batch: int) -> int:
        events.append(f"stage {batch}")
        return batch * 10

    def launch(batch: int, staged: int) -> int:
        events.append(f"launch {batch}")
        return staged + 1

    for result in overlapped(range(3), stage, launch):
        events.append(f"got {result}")
    assert events == ["stage 0", "launch 0", "stage 1", "launch 1", "got 1", "stage 2", "launch 2", "got 11",
                      "got 21"]
    assert list(overlapped([], stage, launch)) == []


def test_a_failing_batch_fails_once_the_batches_before_the_one_before_it_were_handed_over():
    def launch(batch: int, staged: int) -> int:
        if batch == 2:
            raise RuntimeError("out of memory")
        return batch

    got = []
    with pytest.raises(RuntimeError, match="out of memory"):
        for result in overlapped(range(4), lambda b: b, launch):
            got.append(result)
    assert got == [0]  # (batch 1 was launched, not handed over: its call fails as a whole)


def test_a_host_tensor_goes_to_the_host_as_it_is():
    tensor = torch.arange(6.0).view(2, 3)
    copy = PinnedStaging().to_host(tensor)
    assert copy.wait() is tensor and copy.wait() is tensor and not copy.pinned
    array = copy.array()  # its own memory: nothing pinned to copy out of
    array[0, 0] = 7.0
    assert tensor[0, 0] == 7.0

