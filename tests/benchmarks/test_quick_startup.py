"""The quick benchmarks of Prefect's startup (``startup``, ``espnet2``: each times a private
server and a running one) and of its cost per task run (``task_costs``). Each runs in ``--quick`` mode and writes its JSON with the expected keys; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from tests.support.quick_benchmarks import TIMEOUT, QuickGroup

pytestmark = [pytest.mark.slow, pytest.mark.dask, pytest.mark.prefect, pytest.mark.timeout(TIMEOUT)]


class TestStartupGroup(QuickGroup):
    group = "startup"

    def test_task_costs_measured_every_part(self, quick_run) -> None:
        results, _ = quick_run
        rows = json.loads((results / "task_costs.json").read_text())["rows"]
        assert [(r["part"], r["patches"]) for r in rows] == [("task engine", "on"), ("task engine", "off"),
                                                             ("driver", "on")]
        assert all(r["ok"] and r["cpu_ms"] > 0 for r in rows), rows
        assert rows[-1]["dask_cpu_ms"] > 0
