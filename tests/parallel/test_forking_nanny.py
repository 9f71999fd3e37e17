"""The start method is set only while the nanny's own code runs (a killed worker restarted from the
forkserver: ``tests/parallel/test_forkserver.py``)."""

from __future__ import annotations

import asyncio

import dask
import pytest

from espnet3_flows.parallel.forking_nanny import _UnderConfig
from espnet3_flows.parallel.forkserver import MP_METHOD_KEY


def test_the_method_is_set_while_the_coroutine_runs_and_only_then():
    default = dask.config.get(MP_METHOD_KEY)
    seen: dict[str, list[str]] = {"forking": [], "other": []}

    async def look(name: str, steps: int) -> str:
        for _ in range(steps):
            seen[name].append(dask.config.get(MP_METHOD_KEY))
            await asyncio.sleep(0)  # the other coroutine runs here
        return name

    async def both() -> list[str]:
        # two under the setting, one beside them, all interleaved on one loop
        return await asyncio.gather(_UnderConfig(look("forking", 4), {MP_METHOD_KEY: "forkserver"}),
                                    look("other", 6),
                                    _UnderConfig(look("forking", 3), {MP_METHOD_KEY: "forkserver"}))

    assert asyncio.run(both()) == ["forking", "other", "forking"]
    assert seen["forking"] == ["forkserver"] * 7 and seen["other"] == [default] * 6
    assert dask.config.get(MP_METHOD_KEY) == default


def test_an_error_and_a_cancellation_reach_the_coroutine_and_leave_the_setting_unset():
    default = dask.config.get(MP_METHOD_KEY)
    cleanup: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("from the coroutine")

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleanup.append(dask.config.get(MP_METHOD_KEY))

    async def run() -> None:
        with pytest.raises(ValueError, match="from the coroutine"):
            await _UnderConfig(fails(), {MP_METHOD_KEY: "forkserver"})
        task = asyncio.ensure_future(_UnderConfig(waits(), {MP_METHOD_KEY: "forkserver"}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cleanup == ["forkserver"]  # its finally ran under the setting, as its own code
    assert dask.config.get(MP_METHOD_KEY) == default
