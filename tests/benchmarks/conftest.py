"""The quick benchmark groups' parameters (tests/support/quick_benchmarks.py)."""

from __future__ import annotations

import pytest

from tests.support.quick_benchmarks import GROUPS, QuickGroup, QuickRun, run_quick


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A :class:`QuickGroup` test asking for ``name`` runs once per benchmark of its group."""
    if metafunc.cls is not None and issubclass(metafunc.cls, QuickGroup) and "name" in metafunc.fixturenames:
        metafunc.parametrize("name", GROUPS[metafunc.cls.group])


@pytest.fixture(scope="class")
def quick_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              session_api_url: str) -> QuickRun:
    """The quick run of the requesting :class:`QuickGroup`'s benchmarks, once for the class."""
    return run_quick(GROUPS[request.cls.group], tmp_path_factory.mktemp("bench"), session_api_url)
