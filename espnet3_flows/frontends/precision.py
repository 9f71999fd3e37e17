"""The arithmetic a model runs in: ``float32``, ``tf32``, ``bf16`` or ``fp16`` (``frontend.precision``
and ``xvector.precision``), as one context manager around each model call.

``float32`` is exact float32, also on a GPU: TF32 tensor cores are switched off for matrix products
and cuDNN convolutions (torch leaves cuDNN's on by default, which rounds convolution inputs to 10
mantissa bits). ``tf32`` switches them on: float32 storage, products on tensor cores. ``bf16`` and
``fp16`` run the model under ``torch.autocast`` to that dtype (and TF32 for what autocast keeps in
float32). The ``gpu`` benchmark measures each one's speed and its error against float32.

Under autocast on a GPU, torch's cuDNN attention kernels are switched off: cuDNN builds a plan for
each new shape of its inputs (~200 ms), and padded batches of utterances have a new shape nearly
every call. Measured on an H200 (HuBERT-base, bf16, batches of 4M samples whose shapes it had not
seen): 252-1,787x real time with cuDNN's attention, 2,618-3,719x without; on shapes seen before the
two are within 3 % (``python -m benchmarks.bench_gpu --only hubert``).

These switches are torch's process-wide flags: set for the call and restored after it.
"""

from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import Iterator

#: The precisions, fastest last
PRECISIONS = ("float32", "tf32", "bf16", "fp16")
#: ``precision`` -> the dtype torch autocasts to (None: no autocast)
AUTOCAST_DTYPES = {"float32": None, "tf32": None, "bf16": "bfloat16", "fp16": "float16"}


def check_precision(precision: str, name: str = "precision") -> None:
    """ValueError naming ``name`` unless ``precision`` is one of :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {', '.join(PRECISIONS)}, got {precision!r}")


@contextlib.contextmanager
def precision_scope(device: Any, precision: str, planned_shapes: bool = False) -> Iterator[None]:
    """Run the block's torch calls on ``device`` (a ``torch.device`` or its name) in ``precision``;
    ``planned_shapes``: the inputs come in a few fixed shapes (``frontend.bucket_shapes``), so
    cuDNN's attention, which plans each shape once, stays on under autocast."""
    import torch

    check_precision(precision)
    device_type = torch.device(device).type
    dtype = AUTOCAST_DTYPES[precision]
    tf32 = precision != "float32"
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    cudnn_attention = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if dtype is not None and device_type == "cuda" and not planned_shapes:
        torch.backends.cuda.enable_cudnn_sdp(False)  # (a plan per new input shape: see above)
    try:
        with torch.autocast(device_type, dtype=getattr(torch, dtype) if dtype else None, enabled=dtype is not None):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        torch.backends.cuda.enable_cudnn_sdp(cudnn_attention)
