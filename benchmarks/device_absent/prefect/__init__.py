"""Stands in for Prefect while ``benchmarks/gpu_check.sh --rehearse`` runs on a CPU: the lent GPU
machine has no Prefect unless its wheels travel (``make gpu-wheels`` says whether they fit), so the
rehearsal fails here on any import of it that the device run would fail on."""

raise ImportError("prefect is not installed on the GPU machine (benchmarks/device_absent: gpu_check.sh --rehearse)")
