"""The quick benchmarks of the collect-stats flow: its speed, its per-shard overhead, its memory.
Each runs in ``--quick`` mode and writes its JSON with the expected keys; no timing is asserted
(tests/support/quick_benchmarks.py)."""

from __future__ import annotations

import pytest

from tests.support import quick_benchmarks as quick

NAMES = quick.GROUPS["flows"]

pytestmark = [pytest.mark.slow, pytest.mark.dask, pytest.mark.prefect, pytest.mark.timeout(quick.TIMEOUT)]

quick_results = quick.quick_fixture(NAMES)


def test_quick_run_succeeds(quick_results) -> None:
    quick.assert_run_succeeded(quick_results, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_result_json_has_expected_keys(quick_results, name: str) -> None:
    quick.assert_result_json(quick_results, name)
