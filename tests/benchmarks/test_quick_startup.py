"""The quick benchmarks of Prefect's startup (``startup``, ``espnet2``: each times a private
server and a running one). Each runs in ``--quick`` mode and writes its JSON with the expected keys; no timing is asserted."""

from __future__ import annotations

import pytest

from tests.support.quick_benchmarks import TIMEOUT, QuickGroup

pytestmark = [pytest.mark.slow, pytest.mark.dask, pytest.mark.prefect, pytest.mark.timeout(TIMEOUT)]


class TestStartupGroup(QuickGroup):
    group = "startup"
