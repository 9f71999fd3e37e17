"""Shared pytest fixtures and options: real services are started here, once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slurm", action="store_true", default=False,
                     help="run tests marked 'slurm' (needs ci/slurm/start.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slurm"):
        return
    skip = pytest.mark.skip(reason="needs SLURM: run ci/slurm/start.sh and pass --run-slurm")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)
