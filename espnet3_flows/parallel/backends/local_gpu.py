"""``parallel.env: local_gpu``: dask-cuda's ``LocalCUDACluster``, a worker per visible GPU, each
seeing only its own."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from espnet3_flows.parallel.backends.local import OnThisMachine

if TYPE_CHECKING:
    from espnet3_flows.parallel.parallel_settings import ParallelSettings


def visible_gpu_count() -> int:
    """The CUDA GPUs this process sees (``torch.cuda.device_count()``, which honours
    ``CUDA_VISIBLE_DEVICES``), as ESPnet3 counts them; without torch, the entries of
    ``CUDA_VISIBLE_DEVICES`` (0 when it is unset)."""
    try:
        import torch
    except ImportError:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return int(torch.cuda.device_count())


class LocalGPUs(OnThisMachine):
    """A worker per visible GPU (``n_workers`` 0: every GPU), spawned."""

    def defaults(self, cfg: ParallelSettings) -> dict[str, Any]:
        out: dict[str, Any] = {"threads_per_worker": cfg.threads_per_worker, "dashboard_address": ":0"}
        if cfg.n_workers:
            out["n_workers"] = cfg.n_workers  # else one per visible GPU
        return out

    def default_workers(self) -> int:
        return visible_gpu_count()


LOCAL_GPU = LocalGPUs(
    "local_gpu", "dask_cuda.LocalCUDACluster", extra="gpu",
    doc="A worker per visible GPU, each seeing only its own (``n_workers`` 0: every GPU); dask-cuda needs "
        "``constraints-gpu.txt``'s dask.")
