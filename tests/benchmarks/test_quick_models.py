"""The quick benchmarks of models over utterances, batching, the runners and object storage.
Each runs in ``--quick`` mode and writes its JSON with the expected keys; no timing is asserted."""

from __future__ import annotations

import pytest

from tests.support.quick_benchmarks import TIMEOUT, QuickGroup

pytestmark = [pytest.mark.slow, pytest.mark.dask, pytest.mark.prefect, pytest.mark.timeout(TIMEOUT)]


class TestModelsGroup(QuickGroup):
    group = "models"
