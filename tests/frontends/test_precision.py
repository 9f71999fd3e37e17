"""``frontends.precision.precision_scope``: the process-wide flags it sets for a model call, and
that it gives them back as they were, also when the call fails."""

from __future__ import annotations

import pytest
import torch

from espnet3_flows.frontends.precision import precision_scope


def flags() -> tuple[bool, bool, bool]:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.cudnn_sdp_enabled())


@pytest.mark.filterwarnings("ignore:User provided device_type of 'cuda'")
@pytest.mark.parametrize(("device", "precision", "inside"), [
    ("cpu", "float32", (False, False, True)),
    ("cpu", "bf16", (True, True, True)),
    ("cuda", "float32", (False, False, True)),
    ("cuda", "tf32", (True, True, True)),
    # cuDNN's attention plans each new input shape: off for padded batches under autocast
    ("cuda", "bf16", (True, True, False)),
    ("cuda", "fp16", (True, True, False)),
])
def test_the_scope_sets_the_flags_for_the_call_and_restores_them(device, precision, inside):
    before = flags()
    with precision_scope(device, precision):
        assert flags() == inside
    assert flags() == before
    with precision_scope(device, precision, planned_shapes=True):  # fixed shapes: cuDNN's attention stays
        assert flags() == (*inside[:2], True)
    assert flags() == before
    with pytest.raises(RuntimeError, match="model failed"), precision_scope(device, precision):
        raise RuntimeError("model failed")
    assert flags() == before
